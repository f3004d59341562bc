"""The worker's metrics: every per-queue series exists from the start, and updates land there;
the model is a label of every series; the per-job token histograms and the prefix cache
counters read as vLLM's do."""

from __future__ import annotations

from typing import get_args

from prometheus_client import generate_latest

from exlq.protocol.keys import LANES
from exlq.protocol.models import FinishReason
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
    "exlq_prefix_cache_queries_total",
    "exlq_prefix_cache_hits_total",
    "exlq_request_prompt_tokens_count",
    "exlq_request_generation_tokens_count",
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
    # Every finish reason of every lane, so that a rate over any of them reads 0, not nothing.
    for lane in LANES:
        for reason in get_args(FinishReason):
            labels = {"queue": "q1", "lane": lane, "finish_reason": reason}
            assert metrics.registry.get_sample_value("exlq_jobs_completed_total", labels) == 0.0


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


def test_every_series_carries_the_model_the_worker_serves() -> None:
    metrics = Metrics("q1", "Llama-3-8B")
    metrics.info("1.0", "exllamav2", {"attention": "exlq"})
    metrics.job_completed("stop")
    metrics.job_failed("engine_error")
    samples = [s for family in metrics.registry.collect() for s in family.samples]
    assert len(samples) > 100
    unlabelled = {s.name for s in samples if s.labels.get("model") != "Llama-3-8B"}
    assert not unlabelled
    assert all(s.labels["queue"] == "q1" for s in samples)
    value = metrics.registry.get_sample_value
    labels = {"queue": "q1", "model": "Llama-3-8B", "lane": "interactive", "finish_reason": "stop"}
    assert value("exlq_jobs_completed_total", labels) == 1


def test_a_worker_serving_no_model_writes_no_model_label() -> None:
    """Prometheus reads an absent label and an empty one alike; the page leaves it out."""
    page = generate_latest(Metrics("q1").registry).decode()
    assert "model=" not in page
    assert 'exlq_generated_tokens_total{queue="q1"} 0.0' in page


def test_a_jobs_tokens_land_in_vllms_per_request_buckets() -> None:
    metrics = Metrics("q1")
    value = metrics.registry.get_sample_value
    metrics.job_tokens(prompt=300, generated=7, cached=None)
    metrics.job_tokens(prompt=40, generated=128, cached=None)
    q = {"queue": "q1"}
    prompt = "exlq_request_prompt_tokens_bucket"
    generation = "exlq_request_generation_tokens_bucket"
    assert [value(prompt, {**q, "le": le}) for le in ("20.0", "50.0", "200.0", "500.0")] == [
        0,
        1,
        1,
        2,
    ]
    assert [value(generation, {**q, "le": le}) for le in ("5.0", "10.0", "100.0", "200.0")] == [
        0,
        1,
        1,
        2,
    ]
    assert value("exlq_request_prompt_tokens_sum", q) == 340
    assert value("exlq_request_generation_tokens_sum", q) == 135
    assert value("exlq_prompt_tokens_total", q) == 340
    buckets = {
        s.labels["le"]
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == prompt
    }
    assert {"1.0", "2.0", "5.0", "1000.0", "100000.0", "200000.0", "+Inf"} <= buckets


def test_prefix_cache_counts_only_prompts_an_engine_looked_up() -> None:
    """As vLLM counts: queries and hits in tokens. A job whose engine has no prefix cache
    (cached None) adds its prompt to exlq_prompt_tokens_total but not to the queries, so
    the hit ratio over such a worker reads no data instead of 0%."""
    metrics = Metrics("q1")
    value = metrics.registry.get_sample_value
    q = {"queue": "q1"}
    metrics.job_tokens(prompt=512, generated=10, cached=256)
    metrics.job_tokens(prompt=100, generated=10, cached=0)
    metrics.job_tokens(prompt=900, generated=10, cached=None)
    assert value("exlq_prefix_cache_queries_total", q) == 612
    assert value("exlq_prefix_cache_hits_total", q) == 256
    assert value("exlq_prompt_tokens_total", q) == 1512


def test_draft_counts_add_up_to_the_acceptance_rate() -> None:
    """As vLLM counts speculative decoding: tokens drafted and verified, and those the model
    accepted; the rate is their ratio."""
    metrics = Metrics("q1")
    value = metrics.registry.get_sample_value
    q = {"queue": "q1"}
    assert value("exlq_draft_tokens_total", q) == 0
    metrics.drafts(drafted=40, accepted=30)
    metrics.drafts(drafted=8, accepted=0)
    assert value("exlq_draft_tokens_total", q) == 48
    assert value("exlq_draft_tokens_accepted_total", q) == 30
