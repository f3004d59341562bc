"""A burst of jobs reaches the engine together, so its prompts are prefilled together."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from exlq.producer import AsyncProducer
from exlq.producer.submit_batch import EAGER_SEND
from exlq.protocol.keys import QueueKeys
from exlq.protocol.models import GenerationRequest, JobResult
from exlq.worker.broker import Broker, Read, StreamEntry
from exlq.worker.engines.base import EngineOutput
from exlq.worker.engines.echo.engine import EchoEngine
from exlq.worker.lanes import TakePlan

pytestmark = pytest.mark.integration


class CountingEngine(EchoEngine):
    """Echo that records how many jobs each step ran."""

    def __init__(self, capacity: int = 8) -> None:
        super().__init__(capacity=capacity, tokens_per_second=1000)
        self.jobs_per_step: list[int] = []

    def step(self) -> list[EngineOutput]:
        self.jobs_per_step.append(self.active_jobs)
        return super().step()


def _log_reads_and_parses(
    monkeypatch: pytest.MonkeyPatch,
    after_read: Callable[[list[StreamEntry]], Awaitable[None]] | None = None,
    by_id: bool = False,
) -> list[str]:
    """The worker's reads and parses, in order, in the list returned: each read when sent
    (blocked or not) and how many entries it brought, each parse by prompt; ``by_id``: each
    read as "read sent", then each entry it brought and each parse by job id.
    ``after_read`` runs on each read's entries before the worker has them."""
    from exlq.worker.runner import Worker

    log: list[str] = []
    real_read, real_decode = Broker.read, Worker._decode

    async def read(self: Broker, plan: TakePlan, block_ms: int | None) -> Read:
        blocked = block_ms is not None and not by_id
        log.append(f"blocked read of {plan.total} sent" if blocked else "read sent")
        done = await real_read(self, plan, block_ms)
        entries = done.entries
        if by_id:
            log.extend(f"read {json.loads(e.payload or b'{}')['id']}" for e in entries)
        else:
            log.append(f"read {len(entries)}")
        if after_read is not None:
            await after_read(entries)
        return done

    def decode(self: Worker, entry: StreamEntry) -> GenerationRequest:
        request = real_decode(self, entry)
        log.append(f"parse {request.id if by_id else request.prompt}")
        return request

    monkeypatch.setattr(Broker, "read", read)
    monkeypatch.setattr(Worker, "_decode", decode)
    return log


async def test_a_read_that_returns_less_than_it_asked_for_goes_to_the_engine_at_once(
    redis_url: str, queue_name: str, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis answers a read with every entry that has landed, up to its count: a read that
    returns fewer has them all, and its piece goes to the engine without another round
    trip. What lands after it runs too, taken by the next read."""
    engine = CountingEngine()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        rest: list[Any] = []
        landed = asyncio.Event()

        async def land_the_rest(entries: list[StreamEntry]) -> None:
            if entries and not landed.is_set():
                landed.set()
                # The read returned on the first job; more lands as it returns.
                rest.extend(
                    await asyncio.gather(
                        *(producer.submit(f"rest {i}", max_new_tokens=3) for i in range(5))
                    )
                )

        log = _log_reads_and_parses(monkeypatch, after_read=land_the_rest)
        await start_worker(engine=engine, max_batch_size=8)
        first = await producer.submit("first", max_new_tokens=3)
        await asyncio.wait_for(landed.wait(), 10)
        while len(rest) < 5:
            await asyncio.sleep(0.01)
        results = await asyncio.wait_for(
            asyncio.gather(*(h.result() for h in [first, *rest])), timeout=20
        )
    assert [r.state for r in results] == ["done"] * 6
    first_read = log.index("read 1")
    assert log[first_read - 1 : first_read + 2] == [
        "blocked read of 8 sent",
        "read 1",
        "parse first",
    ]
    assert "read sent" not in log
    assert sum(engine.jobs_per_step) >= 6


async def _free_slots_under_a_blocked_read(producer: AsyncProducer) -> None:
    """On a worker of 4 slots (read_block_ms long): the short job frees one slot, and the
    next read asks for that 1 entry and blocks; the long ones free three more while it
    waits. A burst of 4 written now meets a read that returns its count, and 3 behind it."""
    first = [await producer.submit("short", max_new_tokens=1)]
    first += [await producer.submit(f"long {i}", max_new_tokens=100) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(h.result() for h in first)), timeout=20)


async def _burst(producer: AsyncProducer, jobs: int) -> list[Any]:
    return list(
        await asyncio.gather(
            *(producer.submit(f"burst {i}", max_new_tokens=3) for i in range(jobs))
        )
    )


async def test_a_burst_meeting_a_read_sized_before_slots_freed_starts_in_one_engine_step(
    redis_url: str, queue_name: str, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that returns its count may have left entries behind: the worker reads them
    into the same piece, with a read sent before it parses what it has, so Redis answers
    while it parses."""
    log = _log_reads_and_parses(monkeypatch)
    engine = CountingEngine(capacity=4)
    await start_worker(engine=engine, max_batch_size=4, read_block_ms=2000)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        await _free_slots_under_a_blocked_read(producer)
        steps_before = len(engine.jobs_per_step)
        burst = await _burst(producer, 4)
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in burst)), timeout=20)
    assert [r.state for r in results] == ["done"] * 4
    # The read returned one entry; the worker took the other three at once.
    assert next(n for n in engine.jobs_per_step[steps_before:] if n) == 4
    taken = log.index("parse burst 0")
    assert log[taken - 3 : taken + 3] == [
        "blocked read of 1 sent",
        "read 1",
        "read sent",
        "parse burst 0",
        "read 3",
        "parse burst 1",
    ]


async def test_entries_read_before_a_failed_follow_up_read_still_run(
    redis_url: str, queue_name: str, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_read = Broker.read
    failed: list[bool] = []

    async def read(self: Broker, count: int, block_ms: int | None) -> Read:
        if block_ms is None and not failed:
            failed.append(True)
            raise RedisConnectionError("connection reset while reading the rest of a burst")
        return await real_read(self, count, block_ms)

    monkeypatch.setattr(Broker, "read", read)
    # Claims go stale only after a minute: the jobs must run now, not after a reclaim.
    await start_worker(
        engine=CountingEngine(capacity=4),
        max_batch_size=4,
        read_block_ms=2000,
        claim_idle_ms=60_000,
    )
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        await _free_slots_under_a_blocked_read(producer)
        burst = await _burst(producer, 4)
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in burst)), timeout=20)
    assert failed and [r.state for r in results] == ["done"] * 4


async def test_a_large_burst_reaches_the_engine_in_pieces_in_order(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each piece of a read is started and handed to the engine before the next is
    started, so the engine can prefill the first while the worker takes in the rest. Each
    piece is offered in parts as it is parsed, before its start script, and admitted (every
    offered job by id alone) once the last part is out, before the script's verdict."""
    from exlq.worker.engine_loop import EngineLoop
    from exlq.worker.offer_round import OFFER_PART
    from exlq.worker.runner import ACCEPT_PIECE

    log: list[tuple[str, list[str]]] = []
    real_start = Broker.start_jobs
    real_offer, real_admit = EngineLoop.offer, EngineLoop.admit

    async def start_jobs(self: Broker, jobs: list[tuple[str, str]]) -> Any:
        log.append(("start", [job_id for job_id, _ in jobs]))
        return await real_start(self, jobs)

    def offer(self: EngineLoop, round_id: int, jobs: list[tuple[str, Any]]) -> None:
        log.append(("offer", [job_id for job_id, _ in jobs]))
        real_offer(self, round_id, jobs)

    def admit(self: EngineLoop, round_id: int, jobs: list[tuple[str, Any]]) -> None:
        assert all(request is None for _, request in jobs)  # each was offered
        log.append(("add", [job_id for job_id, _ in jobs]))
        real_admit(self, round_id, jobs)

    monkeypatch.setattr(Broker, "start_jobs", start_jobs)
    monkeypatch.setattr(EngineLoop, "offer", offer)
    monkeypatch.setattr(EngineLoop, "admit", admit)
    count = 2 * ACCEPT_PIECE + 5
    await start_worker(
        engine=CountingEngine(capacity=128),
        max_batch_size=128,
    )
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        burst = await asyncio.gather(
            *(producer.submit(f"burst {i}", max_new_tokens=2) for i in range(count))
        )
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in burst)), timeout=30)
    assert [r.state for r in results] == ["done"] * count
    # Accepted in pieces: each piece's offers, its start script and its hand-over, in the
    # order the settings give.
    assert ACCEPT_PIECE == 32 and OFFER_PART == 8
    last = ("add", "start")
    rounds: list[list[tuple[str, int]]] = [[]]
    for kind, ids in log:
        rounds[-1].append((kind, len(ids)))
        if kind == last[1]:
            rounds.append([])
    assert rounds.pop() == []
    assert [r[-2:] for r in rounds] == [
        [(last[0], n), (last[1], n)] for n in (ACCEPT_PIECE, ACCEPT_PIECE, 5)
    ]
    for piece in rounds:
        offered = [n for kind, n in piece[:-2]]
        assert all(kind == "offer" for kind, _ in piece[:-2])
        # The first job alone, then up to OFFER_PART at a time.
        assert offered[0] == 1 and max(offered) <= OFFER_PART
        assert sum(offered) == piece[-1][1]
    if not EAGER_SEND:
        # The burst landed in one write: one read took it whole, and a piece of 32 went
        # in 1, 8, 8, 8, 7, one of 5 in 1, 4. (With the SDK's first piece of 8 written
        # first, the read may bring those 8 alone, and the worker offers them before it
        # reads the rest: 1, 7, 8, ...)
        assert [[n for _, n in r[:-2]] for r in rounds] == [[1, 8, 8, 8, 7]] * 2 + [[1, 4]]
    handed = [job_id for kind, ids in log if kind == "add" for job_id in ids]
    assert handed == [h.id for h in burst]
    offered = [job_id for kind, ids in log if kind == "offer" for job_id in ids]
    assert offered == handed


async def test_a_full_piece_goes_to_the_engine_before_the_worker_reads_again(
    redis_url: str, queue_name: str, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that brings a whole piece does not wait on one more read for what landed
    behind it: the engine starts on the piece first, and the next read takes the rest."""
    from exlq.worker.runner import ACCEPT_PIECE

    log: list[tuple[str, int]] = []
    real_read, real_start = Broker.read, Broker.start_jobs

    async def read(self: Broker, count: int, block_ms: int | None) -> Read:
        done = await real_read(self, count, block_ms)
        log.append(("read" if block_ms is not None else "read without waiting", len(done.entries)))
        return done

    async def start_jobs(self: Broker, jobs: list[tuple[str, str]]) -> Any:
        log.append(("start", len(jobs)))
        return await real_start(self, jobs)

    monkeypatch.setattr(Broker, "read", read)
    monkeypatch.setattr(Broker, "start_jobs", start_jobs)
    count = 2 * ACCEPT_PIECE
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        # The burst is in the stream before the worker's first read.
        burst = await asyncio.gather(
            *(producer.submit(f"burst {i}", max_new_tokens=2) for i in range(count))
        )
        await start_worker(engine=CountingEngine(capacity=128), max_batch_size=128)
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in burst)), timeout=30)
    assert [r.state for r in results] == ["done"] * count
    first_read = log.index(("read", count))
    assert log[first_read + 1 : first_read + 3] == [("start", ACCEPT_PIECE)] * 2


async def _results(client: aioredis.Redis, keys: QueueKeys, job_ids: list[str]) -> list[JobResult]:
    """The stored results of these jobs, once all are written."""
    async with asyncio.timeout(20):
        while True:
            raw = [await client.get(keys.result(job_id)) for job_id in job_ids]
            if all(raw):
                return [JobResult.model_validate_json(r) for r in raw if r]
            await asyncio.sleep(0.01)


async def _xadd(client: aioredis.Redis, keys: QueueKeys, job_id: str, more: bool) -> None:
    """An entry as a producer without the SDK writes it; ``more`` as the SDK marks one that
    more of its burst follows."""
    request = GenerationRequest(id=job_id, prompt=f"words of {job_id}", max_new_tokens=2)
    fields = {"job": request.model_dump_json(), **({"more": "1"} if more else {})}
    await client.xadd(keys.jobs, fields)  # type: ignore[arg-type]


async def test_a_burst_that_says_more_follows_starts_in_one_engine_step(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first entries of a burst say more follows (more=1). The worker offers them to the
    engine, then waits for the rest, which lands 50 ms later, and starts all five in one
    engine step."""
    from exlq.worker.engine_loop import EngineLoop

    keys = QueueKeys(queue_name)
    log: list[str] = []
    real_read, real_offer = Broker.read, EngineLoop.offer

    async def write_rest() -> None:
        await asyncio.sleep(0.05)
        log.append("rest written")
        await _xadd(redis_client, keys, "b-3", more=True)
        await _xadd(redis_client, keys, "b-4", more=False)

    async def read(self: Broker, count: int, block_ms: int | None) -> Read:
        if "read b-2" in log and "rest written" not in log and not writer:
            writer.append(asyncio.create_task(write_rest()))
        done = await real_read(self, count, block_ms)
        log.extend(f"read {json.loads(e.payload or b'{}')['id']}" for e in done.entries)
        return done

    def offer(self: EngineLoop, round_id: int, jobs: list[tuple[str, Any]]) -> None:
        log.extend(f"offer {job_id}" for job_id, _ in jobs)
        real_offer(self, round_id, jobs)

    writer: list[asyncio.Task[None]] = []
    monkeypatch.setattr(Broker, "read", read)
    monkeypatch.setattr(EngineLoop, "offer", offer)
    engine = CountingEngine(capacity=16)
    await start_worker(engine=engine, max_batch_size=16, burst_wait_ms=5000)
    for i in range(3):
        await _xadd(redis_client, keys, f"b-{i}", more=True)
    results = await _results(redis_client, keys, [f"b-{i}" for i in range(5)])
    assert [r.state for r in results] == ["done"] * 5
    assert next(n for n in engine.jobs_per_step if n) == 5
    # The first three were offered while the worker waited for the rest.
    assert log.index("offer b-2") < log.index("rest written") < log.index("read b-4")


async def test_a_burst_whose_rest_never_comes_runs_after_the_burst_wait(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    """An entry says more follows, and nothing does (its producer died mid-burst): the job
    waits burst_wait_ms at most, then runs."""
    keys = QueueKeys(queue_name)
    engine = CountingEngine()
    await start_worker(engine=engine, burst_wait_ms=300)
    began = time.monotonic()
    await _xadd(redis_client, keys, "orphan", more=True)
    [result] = await _results(redis_client, keys, ["orphan"])
    assert result.state == "done"
    assert time.monotonic() - began >= 0.3
    assert next(n for n in engine.jobs_per_step if n) == 1


async def test_the_read_for_a_bursts_rest_goes_out_before_the_worker_parses_what_it_has(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each read of a burst that says more follows is sent before the worker parses the
    entries the last read brought: Redis answers while the worker parses. The rest, which
    lands while that read waits, still joins the same engine step, and every entry runs
    once."""
    keys = QueueKeys(queue_name)
    log = _log_reads_and_parses(monkeypatch, by_id=True)
    engine = CountingEngine(capacity=16)
    await start_worker(engine=engine, max_batch_size=16, burst_wait_ms=5000)
    await _xadd(redis_client, keys, "p-0", more=True)
    async with asyncio.timeout(10):
        while "parse p-0" not in log:
            await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # the read for the rest is out, and blocked
    await _xadd(redis_client, keys, "p-1", more=True)
    await _xadd(redis_client, keys, "p-2", more=False)
    results = await _results(redis_client, keys, ["p-0", "p-1", "p-2"])
    assert [r.state for r in results] == ["done"] * 3
    assert next(n for n in engine.jobs_per_step if n) == 3
    # p-0's read returned; the next read went out before p-0 was parsed. p-1 came alone
    # or with p-2; after a read that ends on p-1's mark, the next went out before p-1's
    # parse.
    first = log.index("read p-0")
    assert log[first + 1 : first + 3] == ["read sent", "parse p-0"]
    if log[log.index("read p-1") + 1] != "read p-2":
        after_p1 = log[log.index("read p-1") + 1 :]
        assert after_p1[:2] == ["read sent", "parse p-1"]
    assert [line for line in log if line.startswith("parse")] == [
        "parse p-0",
        "parse p-1",
        "parse p-2",
    ]
