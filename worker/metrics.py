"""Metrics: the worker's Prometheus collectors; the only module that imports prometheus_client."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    make_wsgi_app,
)

from exlq.protocol.keys import LANES, Lane
from exlq.protocol.models import FinishReason

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2)
_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_DURATION_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1)
# Tokens per request, in vLLM's 1-2-5 steps (its request_prompt_tokens and
# request_generation_tokens), up to 200,000: a dashboard built for vLLM reads exlq's too.
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class Metrics:
    """Typed methods over the collectors, so the rest of the worker never names one."""

    def __init__(
        self, queue: str, model: str = "", *, registry: CollectorRegistry | None = None
    ) -> None:
        """``model``: the name of the model the worker serves (vLLM's model_name), a label of
        every series. A worker that serves none (the echo engine) leaves it out, which is
        what Prometheus makes of an empty label anyway."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        q = ["queue", "model"] if model else ["queue"]
        bound = (queue, model) if model else (queue,)
        self._bound = bound

        # A series labelled by queue (and model) alone is bound to this worker's once, here:
        # the token path updates some for every token, and labels() costs as much as the
        # update. Binding also creates each series now, so dashboards show zeros, not gaps.
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, q, registry=r).labels(*bound)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, q, registry=r).labels(*bound)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, q, buckets=buckets, registry=r).labels(*bound)

        # Series of each priority lane, bound once (keys.LANES).
        def by_lane(collector: Counter | Gauge | Histogram) -> dict[Lane, Any]:
            return {lane: collector.labels(*bound, lane) for lane in LANES}

        ql = [*q, "lane"]
        self._received: dict[Lane, Counter] = by_lane(
            Counter("exlq_jobs_received", "Jobs taken from the stream.", ql, registry=r)
        )
        completed = Counter(
            "exlq_jobs_completed",
            "Jobs that ended normally: stop, length, cancelled or expired.",
            [*ql, "finish_reason"],
            registry=r,
        )
        self._completed: dict[tuple[Lane, str], Counter] = {
            (lane, reason): completed.labels(*bound, lane, reason)
            for lane in LANES
            for reason in get_args(FinishReason)
        }
        self._failed = Counter(
            "exlq_jobs_failed", "Jobs that ended in an error.", [*q, "error_type"], registry=r
        )
        self._requeued = counter("exlq_jobs_requeued", "Jobs taken over from a dead worker.")
        self._dead = counter("exlq_jobs_dead_lettered", "Entries moved to the dead stream.")
        self._running: dict[Lane, Gauge] = by_lane(
            Gauge("exlq_jobs_running", "Jobs this worker holds.", ql, registry=r)
        )
        self._capacity = gauge("exlq_batch_capacity", "Jobs this worker can run at once.")
        self._queue_wait: dict[Lane, Histogram] = by_lane(
            Histogram(
                "exlq_queue_wait_seconds",
                "Enqueue to start.",
                ql,
                buckets=_WAIT_BUCKETS_S,
                registry=r,
            )
        )
        self._ttft: dict[Lane, Histogram] = by_lane(
            Histogram(
                "exlq_time_to_first_token_seconds",
                "Enqueue to first token.",
                ql,
                buckets=_LATENCY_BUCKETS_S,
                registry=r,
            )
        )
        self._itl = histogram(
            "exlq_inter_token_latency_seconds", "Time between tokens of a job.", _ITL_BUCKETS_S
        )
        self._duration = histogram(
            "exlq_job_duration_seconds", "Enqueue to end.", _DURATION_BUCKETS_S
        )
        self._step = histogram(
            "exlq_engine_step_seconds", "Wall time of one engine iteration.", _STEP_BUCKETS_S
        )
        self._prompt_tokens = counter("exlq_prompt_tokens", "Prompt tokens of ended jobs.")
        self._generated_tokens = counter("exlq_generated_tokens", "Tokens generated.")
        self._request_prompt = histogram(
            "exlq_request_prompt_tokens",
            "Prompt tokens of each job the engine ended.",
            _TOKEN_COUNT_BUCKETS,
        )
        self._request_generation = histogram(
            "exlq_request_generation_tokens",
            "Tokens generated for each job the engine ended.",
            _TOKEN_COUNT_BUCKETS,
        )
        # As vLLM counts them, in tokens: the prompt tokens an engine with a prefix cache
        # looked up there, and those it found. An engine without one adds to neither, so
        # the hit ratio reads "no data" there instead of a false 0%.
        self._prefix_queries = counter(
            "exlq_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter(
            "exlq_prefix_cache_hits", "Prompt tokens found in the prefix cache (no prefill)."
        )
        # Speculative decoding, as vLLM counts it: the acceptance rate is accepted / drafted.
        self._draft_tokens = counter(
            "exlq_draft_tokens", "Tokens drafted (a draft model or n-grams) and verified."
        )
        self._draft_accepted = counter(
            "exlq_draft_tokens_accepted", "Drafted tokens the model accepted."
        )
        self._pages_used = gauge("exlq_cache_pages_used", "KV cache pages in use.")
        self._pages_total = gauge("exlq_cache_pages_total", "KV cache pages in all.")
        self._redis_connected = gauge("exlq_redis_connected", "1 while Redis answers.")
        self._ready = gauge("exlq_worker_ready", "1 while the worker takes jobs.")
        # exlq_worker_info: the build, the engine and how it runs (each engine's own keys).
        self._info = Info("exlq_worker", "Worker build and configuration.", q, registry=r)

    def info(self, version: str, engine: str, engine_info: dict[str, str]) -> None:
        """The worker's build, its engine and the engine's own description of how it runs
        (the model is a label of every series)."""
        labels = {**engine_info, "version": version, "engine": engine}
        self._info.labels(*self._bound).info(labels)

    def job_received(self, lane: Lane = "interactive") -> None:
        self._received[lane].inc()

    def job_completed(self, finish_reason: FinishReason, lane: Lane = "interactive") -> None:
        self._completed[lane, finish_reason].inc()

    def job_failed(self, error_type: str) -> None:
        self._failed.labels(*self._bound, error_type).inc()

    def job_requeued(self) -> None:
        self._requeued.inc()

    def dead_lettered(self) -> None:
        self._dead.inc()

    def set_running(self, by_lane: Mapping[Lane, int]) -> None:
        for lane, gauge in self._running.items():
            gauge.set(by_lane.get(lane, 0))

    def set_capacity(self, jobs: int) -> None:
        self._capacity.set(jobs)

    def observe_queue_wait(self, seconds: float, lane: Lane = "interactive") -> None:
        self._queue_wait[lane].observe(seconds)

    def observe_ttft(self, seconds: float, lane: Lane = "interactive") -> None:
        self._ttft[lane].observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_duration(self, seconds: float) -> None:
        self._duration.observe(seconds)

    def observe_step(self, seconds: float) -> None:
        self._step.observe(seconds)

    def add_generated_tokens(self, tokens: int) -> None:
        self._generated_tokens.inc(tokens)

    def job_tokens(self, prompt: int, generated: int, cached: int | None) -> None:
        """The token counts of a job the engine ended, once, at its end. ``cached``: the
        prompt tokens found in the prefix cache, or None where no lookup was made (an
        engine without a prefix cache, or a job cancelled before its prefill)."""
        self._prompt_tokens.inc(prompt)
        self._request_prompt.observe(prompt)
        self._request_generation.observe(generated)
        if cached is not None:
            self._prefix_queries.inc(prompt)
            self._prefix_hits.inc(cached)

    def drafts(self, drafted: int, accepted: int) -> None:
        """A drafting engine's counts for a job it ended: tokens drafted and accepted."""
        self._draft_tokens.inc(drafted)
        self._draft_accepted.inc(accepted)

    def set_cache_pages(self, used: int, total: int) -> None:
        self._pages_used.set(used)
        self._pages_total.set(total)

    def set_redis_connected(self, connected: bool) -> None:
        self._redis_connected.set(1 if connected else 0)

    def set_ready(self, ready: bool) -> None:
        self._ready.set(1 if ready else 0)

    def wsgi_app(self) -> WsgiApp:
        app: WsgiApp = make_wsgi_app(self.registry)
        return app
