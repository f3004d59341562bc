"""The worker's metrics: every per-queue series exists from the start, and updates land there."""

from __future__ import annotations

from exlq.protocol.keys import LANES
from exlq.worker.metrics import Metrics

PER_LANE = [
    "exlq_jobs_received_total",
    "exlq_jobs_running",
    "exlq_queue_wait_seconds_count",
    "exlq_time_to_first_token_seconds_count",
]
PER_QUEUE = [
    "exlq_jobs_requeued_total",
    "exlq_jobs_dead_lettered_total",
    "exlq_batch_capacity",
    "exlq_inter_token_latency_seconds_count",
    "exlq_job_duration_seconds_count",
    "exlq_engine_step_seconds_count",
    "exlq_prompt_tokens_total",
    "exlq_generated_tokens_total",
    "exlq_cached_prompt_tokens_total",
    "exlq_cache_pages_used",
    "exlq_cache_pages_total",
    "exlq_redis_connected",
    "exlq_worker_ready",
]


def test_every_per_queue_series_reads_zero_before_any_job() -> None:
    metrics = Metrics("q1")
    for name in PER_QUEUE:
        assert metrics.registry.get_sample_value(name, {"queue": "q1"}) == 0.0, name
    for name in PER_LANE:
        for lane in LANES:
            labels = {"queue": "q1", "lane": lane}
            assert metrics.registry.get_sample_value(name, labels) == 0.0, (name, lane)


def test_token_path_updates_land_in_the_queues_series() -> None:
    metrics = Metrics("q1")
    value = metrics.registry.get_sample_value
    metrics.add_generated_tokens(3)
    metrics.add_generated_tokens(2)
    metrics.observe_ttft(0.02, "batch")
    metrics.observe_inter_token(0.004)
    metrics.observe_step(0.003)
    metrics.set_cache_pages(5, 256)
    metrics.job_completed("length", "batch")
    metrics.set_running({"interactive": 2, "batch": 5})
    batch = {"queue": "q1", "lane": "batch"}
    assert value("exlq_generated_tokens_total", {"queue": "q1"}) == 5
    assert value("exlq_time_to_first_token_seconds_sum", batch) == 0.02
    assert value("exlq_time_to_first_token_seconds_bucket", {**batch, "le": "0.01"}) == 0
    assert value("exlq_time_to_first_token_seconds_bucket", {**batch, "le": "0.025"}) == 1
    assert (
        value("exlq_time_to_first_token_seconds_count", {"queue": "q1", "lane": "interactive"}) == 0
    )
    assert value("exlq_jobs_running", batch) == 5
    assert value("exlq_jobs_running", {"queue": "q1", "lane": "interactive"}) == 2
    assert value("exlq_inter_token_latency_seconds_count", {"queue": "q1"}) == 1
    assert value("exlq_engine_step_seconds_count", {"queue": "q1"}) == 1
    assert value("exlq_cache_pages_used", {"queue": "q1"}) == 5
    assert value("exlq_cache_pages_total", {"queue": "q1"}) == 256
    assert value("exlq_jobs_completed_total", {**batch, "finish_reason": "length"}) == 1
