"""The capacity bench's cost fit: two runs that differ only in tokens a job give what a
job costs Redis apart from its tokens, and what each token adds."""

from __future__ import annotations

from bench.cluster_capacity import per_token_costs


def test_a_straight_line_through_two_runs_splits_a_jobs_cost_from_its_tokens() -> None:
    # A job costs 100 us and 20 commands, and each token 2 us and 1 command more.
    short = {
        "tokens_per_job": 8,
        "redis_cpu_us_per_job": 116.0,
        "commands_per_job": 28.0,
        "bytes_in_per_job": 1000.0,
        "bytes_out_per_job": 900.0,
    }
    long = {
        "tokens_per_job": 64,
        "redis_cpu_us_per_job": 228.0,
        "commands_per_job": 84.0,
        "bytes_in_per_job": 1000.0,
        "bytes_out_per_job": 900.0 + 56 * 150,
    }
    costs = per_token_costs(short, long)  # fmt: skip
    assert costs["redis_cpu_us_per_token"] == 2.0
    assert costs["redis_cpu_us_per_job_fixed"] == 100.0
    assert costs["commands_per_token"] == 1.0 and costs["commands_per_job_fixed"] == 20.0
    assert costs["bytes_in_per_token"] == 0.0 and costs["bytes_out_per_token"] == 150.0
