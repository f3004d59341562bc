"""Property-based tests of the worker against raw stream entries: whatever is XADDed, every
entry ends acknowledged with either a stored result (valid id) or a dead-letter entry that
names it, no job runs twice (a second entry of an id that has ended hears duplicate_id),
and the worker goes on serving."""

from __future__ import annotations

import asyncio
import itertools
import json
import string
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys, check_name
from exlq.protocol.models import GenerationRequest, InvalidRequest, parse_event, parse_request
from exlq.worker.broker import ENTRY_HEAD_BYTES
from exlq.worker.limits import RequestLimits
from tests.conftest import RunningWorker

pytestmark = pytest.mark.integration

ENTRIES = settings(
    max_examples=25,
    deadline=None,
    database=None,  # leave no .hypothesis/ folder in the checkout
    phases=[Phase.explicit, Phase.generate],  # shrinking batches against a worker takes minutes
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one worker serves every example, on purpose
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
SETTLE_S = 20.0
_runs = itertools.count()
ID_ALPHABET = string.ascii_letters + string.digits + "._:-"
ODD_IDS = ["has space", "{tag}", "a}b{", "é", "x" * 129, "", "tab\there", "slash/", "nul\x00"]

# -- what goes into an entry ---------------------------------------------------------------

prompts = (
    st.text(max_size=60)
    | st.builds(lambda word, n: f"{word} " * n, st.text(max_size=8), st.integers(1, 20_000))
    | st.builds(lambda c, n: c * n, st.characters(), st.just(100_000))  # a 100 KB prompt
)
inputs = (
    st.fixed_dictionaries({"prompt": prompts})
    | st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["system", "user", "assistant"]),
                        "content": st.text(max_size=30),
                    }
                ),
                min_size=1,
                max_size=3,
            )
        }
    )
    | st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 2**40), min_size=1, max_size=8)})
)
valid_requests = st.builds(
    lambda given, more: {**given, **more},
    inputs,
    st.fixed_dictionaries(
        {"max_new_tokens": st.integers(1, 5)},
        optional={
            "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
            "sampling": st.fixed_dictionaries(
                {}, optional={"temperature": st.floats(0, 2), "seed": st.integers(0, 99)}
            ),
            "ignore_eos": st.booleans(),
            "deadline": st.sampled_from([None, 1.0]),  # 1.0: long past, so it expires
            "metadata": st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
        },
    ),
)
# Values that make a valid request invalid in one field.
breakages = st.sampled_from(
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 10_000_000),
        ("max_new_tokens", "3"),
        ("max_new_tokens", 2.5),
        ("prompt", 7),
        ("messages", []),
        ("input_ids", [-1]),
        ("sampling", {"temperature": -1}),
        ("sampling", {"temprature": 0.5}),
        ("stop", [""]),
        ("logprobs", 21),
        ("deadline", 0),
        ("ignore_eos", "yes"),
        ("v", 3),
        ("colour", "red"),
    ]
)
json_trees = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=15,
)
garbage_texts = st.one_of(
    json_trees.map(json.dumps),  # NaN and Infinity too
    st.sampled_from(["", " ", "null", "[]", "{}", '{"id": ', "NaN", '"\\ud800"', "1e400"]),
    st.text("0123456789", min_size=300, max_size=5000),  # a huge integer
    st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 5000).map(lambda n: '{"id": "deep", "prompt": ' + "[" * n + "]" * n + "}"),
    st.builds(lambda c: json.dumps(c * 100_000), st.characters()),  # 100 KB
)
field_names = st.binary(max_size=12).filter(lambda name: name != b"job")
extra_fields = st.dictionaries(field_names, st.binary(max_size=40), max_size=3)


@dataclass(frozen=True)
class Valid:
    request: dict[str, Any]
    id_suffix: str


@dataclass(frozen=True)
class Duplicate:
    """Another entry for the id of an earlier valid entry of the batch (the ``of``-th mod n)."""

    of: int
    request: dict[str, Any] | None  # None: the very same payload


@dataclass(frozen=True)
class Invalid:
    request: dict[str, Any]
    breakage: tuple[str, Any]
    id_mode: str  # usable | none | odd
    odd_id: str


@dataclass(frozen=True)
class Garbage:
    payload: bytes


@dataclass(frozen=True)
class NoJob:
    """An entry without a ``job`` field."""


@dataclass(frozen=True)
class Spec:
    what: Valid | Duplicate | Invalid | Garbage | NoJob
    extra: dict[bytes, bytes] = field(default_factory=dict)


entry_specs = st.builds(
    Spec,
    st.one_of(
        # Valid twice: about half the entries run, the rest are refused.
        st.builds(Valid, valid_requests, st.text(ID_ALPHABET, max_size=20)),
        st.builds(Valid, valid_requests, st.text(ID_ALPHABET, max_size=20)),
        st.builds(Duplicate, st.integers(0, 50), st.none() | valid_requests),
        st.builds(
            Invalid,
            valid_requests,
            breakages,
            st.sampled_from(["usable", "none", "odd"]),
            st.sampled_from(ODD_IDS),
        ),
        st.builds(Garbage, st.binary(max_size=300)),
        st.builds(Garbage, garbage_texts.map(lambda text: text.encode(errors="surrogatepass"))),
        st.just(NoJob()),
    ),
    extra_fields,
)
batches = st.lists(entry_specs, min_size=2, max_size=20)

# -- turning specs into entries, with what each must end as ---------------------------------


@dataclass
class Expect:
    fields: dict[bytes, bytes]
    job_id: str | None = None  # an id whose result must be stored
    runs: bool = False  # a valid entry: it runs (or is skipped as a duplicate), never dies
    # A second entry of a valid entry's id: skipped in silence while that job runs, or, read
    # after it ended, dead-lettered as duplicate_id with an error event on its channel.
    duplicate: bool = False
    usable_bad_id: str | None = None  # an invalid entry whose id gets the failed result
    entry_id: str = ""


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def materialise(tag: str, specs: list[Spec], limits: RequestLimits) -> list[Expect]:
    """Entries for ``specs``; a request over the worker's own limits is expected refused
    like an invalid one (under its usable id)."""
    expects: list[Expect] = []
    running: list[tuple[str, bytes]] = []  # (id, payload) of entries expected to run
    for i, spec in enumerate(specs):
        fields = dict(spec.extra)
        what = spec.what
        if isinstance(what, Valid):
            job_id = f"{tag}-v{i}-{what.id_suffix}"
            payload = _dumps({**what.request, "id": job_id})
            if _fits(payload, limits):
                running.append((job_id, payload))
                expects.append(Expect({**fields, b"job": payload}, job_id=job_id, runs=True))
            else:
                expects.append(Expect({**fields, b"job": payload}, usable_bad_id=job_id))
        elif isinstance(what, Duplicate) and running:
            job_id, payload = running[what.of % len(running)]
            if what.request is not None:
                other = _dumps({**what.request, "id": job_id})
                # An over-limit duplicate would be rejected onto the running job's id: that is
                # test_invalid_entry_does_not_overwrite_an_ended_job, not this property.
                payload = other if _fits(other, limits) else payload
            expects.append(
                Expect({**fields, b"job": payload}, job_id=job_id, runs=True, duplicate=True)
            )
        elif isinstance(what, Invalid):
            request = dict(what.request)
            key, value = what.breakage
            request[key] = value
            bad_id = {"usable": f"{tag}-g{i}", "odd": what.odd_id, "none": None}[what.id_mode]
            if bad_id is not None:
                request["id"] = bad_id
            usable = _usable(bad_id)
            expects.append(Expect({**fields, b"job": _dumps(request)}, usable_bad_id=usable))
        elif isinstance(what, Garbage):
            payload = what.payload
            if _decodes(payload):  # garbage that happens to be a request: make it garbage
                payload += b"}"
            expects.append(Expect({**fields, b"job": payload}))
        else:  # NoJob, or a Duplicate with nothing before it
            expects.append(Expect(fields or {b"payload": b"{}"}))
    return expects


def _fits(payload: bytes, limits: RequestLimits) -> bool:
    try:
        limits.check_size(len(payload))
        limits.check(parse_request(payload))
    except InvalidRequest:
        return False
    return True


def _usable(job_id: str | None) -> str | None:
    try:
        return None if job_id is None else check_name("job id", job_id)
    except ValueError:
        return None


def _decodes(payload: bytes) -> bool:
    try:
        parse_request(payload)
    except InvalidRequest:
        return False
    return True


# -- typed access to the replies (the client returns bytes: decode_responses is off) -------


async def xadd(client: aioredis.Redis, stream: str, fields: dict[bytes, bytes]) -> str:
    entry_id = await client.xadd(stream, cast("dict[Any, Any]", fields))
    return cast("bytes", entry_id).decode()


async def dead_letters(
    client: aioredis.Redis, stream: str, first: str = "-"
) -> list[dict[bytes, bytes]]:
    reply = await client.xrange(stream, min=first)
    return [fields for _, fields in cast("list[tuple[bytes, dict[bytes, bytes]]]", reply)]


async def stored_result(client: aioredis.Redis, key: str) -> dict[str, Any] | None:
    raw = cast("bytes | None", await client.get(key))
    return None if raw is None else cast("dict[str, Any]", json.loads(raw))


# -- waiting and checking -------------------------------------------------------------------


def _entry_key(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq)


async def settle(client: aioredis.Redis, keys: QueueKeys, last_entry: str) -> None:
    """Wait until the group has been handed every entry up to ``last_entry`` and none is
    pending (results and dead letters are written in the same transaction as the ack)."""
    group: dict[str, Any] = {}
    try:
        async with asyncio.timeout(SETTLE_S):
            while True:
                [group] = [
                    g
                    for g in await client.xinfo_groups(keys.jobs)
                    if g["name"] == CONSUMER_GROUP.encode()
                ]
                delivered = _entry_key(group["last-delivered-id"].decode())
                if delivered >= _entry_key(last_entry) and group["pending"] == 0:
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"entries not settled within {SETTLE_S}s: group {group}, last {last_entry}")


async def collect_events(
    pubsub: aioredis.client.PubSub, client: aioredis.Redis, keys: QueueKeys, tag: str
) -> dict[str, list[Any]]:
    """Every event published for this run's ids, up to a sentinel sent after settling."""
    sentinel = keys.events(f"{tag}-sentinel")
    await client.publish(sentinel, "end")
    events: dict[str, list[Any]] = defaultdict(list)
    async with asyncio.timeout(10):
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is None:
                continue
            channel = message["channel"].decode()
            if channel == sentinel:
                return events
            events[channel].append(parse_event(message["data"]))


async def check_outcomes(
    client: aioredis.Redis,
    keys: QueueKeys,
    expects: list[Expect],
    events: dict[str, list[Any]],
    limits: RequestLimits,
) -> None:
    dead: dict[str, list[dict[bytes, bytes]]] = defaultdict(list)
    first = min((e.entry_id for e in expects), key=_entry_key)
    for fields in await dead_letters(client, keys.dead, first):
        dead[fields[b"entry"].decode()].append(fields)
    ended_twice: dict[str, int] = defaultdict(int)
    for expect in expects:
        letters = dead.get(expect.entry_id, [])
        if expect.duplicate and letters:
            assert [letter[b"error"] for letter in letters] == [b"duplicate_id"], letters
            ended_twice[cast("str", expect.job_id)] += 1
        elif expect.runs:
            assert not letters, f"valid entry {expect.entry_id} was dead-lettered: {letters}"
        else:
            assert len(letters) == 1, f"entry {expect.entry_id} has {len(letters)} dead letters"
            [letter] = letters
            assert letter[b"error"] == b"invalid_request" and letter[b"message"]
            # A refused entry's dead letter keeps its head and its size (docs/SECURITY.md).
            sent = expect.fields.get(b"job")
            kept = (sent or b"")[:ENTRY_HEAD_BYTES]
            assert letter[b"job"] == kept.decode(errors="replace").encode()
            assert letter[b"job_bytes"] == str(-1 if sent is None else len(sent)).encode()
    for job_id in {e.job_id for e in expects if e.job_id is not None}:
        own: list[Any] = []
        late: list[Any] = []  # the answers to its later entries
        for e in events.get(keys.events(job_id), []):
            is_late = e.type == "error" and e.error.code == "duplicate_id"
            (late if is_late else own).append(e)
        assert len(late) == ended_twice[job_id], f"job {job_id}: {late}"
        await check_valid_job(client, keys, job_id, own)
    for job_id in {e.usable_bad_id for e in expects if e.usable_bad_id is not None}:
        stored = await stored_result(client, keys.result(job_id))
        assert stored is not None, f"no failed result stored for {job_id!r}"
        assert stored["state"] == "failed" and stored["error"]["code"] == "invalid_request"
        [event] = events.get(keys.events(job_id), [])
        assert event.type == "error" and event.error.code == "invalid_request"


async def check_valid_job(
    client: aioredis.Redis, keys: QueueKeys, job_id: str, events: list[Any]
) -> None:
    raw = await client.get(keys.result(job_id))
    assert raw is not None, f"no result stored for valid job {job_id}"
    stored = json.loads(raw)
    assert stored["state"] in ("done", "expired"), stored
    attempts = await client.hget(keys.job(job_id), "attempts")
    assert attempts == b"1", f"job {job_id} ran {attempts!r} times"
    ends = [e for e in events if e.type in ("done", "error")]
    assert len(ends) == 1 and ends[0].type == "done", f"job {job_id} ended {len(ends)} times"
    assert [e.seq for e in events] == list(range(len(events)))
    assert {e.attempt for e in events} == {1}


async def serves_a_fresh_job(client: aioredis.Redis, keys: QueueKeys, tag: str) -> None:
    job_id = f"{tag}-fresh"
    request = GenerationRequest(id=job_id, prompt="still serving", max_new_tokens=2)
    await client.xadd(keys.jobs, {"job": request.model_dump_json()})
    try:
        async with asyncio.timeout(10):
            while (raw := await client.get(keys.result(job_id))) is None:
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail("the worker no longer serves a fresh valid job")
    assert json.loads(raw)["text"] == " still serving"


# -- the properties ------------------------------------------------------------------------


@pytest.fixture
async def echo_worker(start_worker: Any) -> RunningWorker:
    running: RunningWorker = await start_worker(max_batch_size=8, echo_tokens_per_second=2000.0)
    return running


@ENTRIES
@given(batches)
async def test_every_raw_entry_ends_acked_with_a_result_or_a_dead_letter(
    echo_worker: RunningWorker, queue_name: str, redis_client: aioredis.Redis, specs: list[Spec]
) -> None:
    keys = QueueKeys(queue_name)
    tag = f"fz{next(_runs)}"
    limits = echo_worker.worker.settings.limits
    expects = materialise(tag, specs, limits)
    for expect in expects:
        event(
            "runs" if expect.runs else "rejected, usable id" if expect.usable_bad_id else "rejected"
        )
    pubsub = redis_client.pubsub()
    await pubsub.psubscribe(keys.events(tag).removesuffix("}") + "-*")
    try:
        for expect in expects:
            expect.entry_id = await xadd(redis_client, keys.jobs, expect.fields)
        await settle(redis_client, keys, expects[-1].entry_id)
        events = await collect_events(pubsub, redis_client, keys, tag)
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
    await check_outcomes(redis_client, keys, expects, events, limits)
    assert not echo_worker.task.done(), "the worker stopped"
    await serves_a_fresh_job(redis_client, keys, tag)


# -- what these properties found ------------------------------------------------------------------


# Found by this file's first run (RecursionError out of _job_id_of killed the reader);
# fixed since. Kept as a regression test.
async def test_deeply_nested_entry_is_dead_lettered_and_worker_goes_on(
    echo_worker: RunningWorker, queue_name: str, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    payload = '{"id": "deep", "prompt": ' + "[" * 5000 + "]" * 5000 + "}"
    entry_id = await xadd(redis_client, keys.jobs, {b"job": payload.encode()})
    await serves_a_fresh_job(redis_client, keys, "deep")
    await settle(redis_client, keys, entry_id)
    [letter] = await dead_letters(redis_client, keys.dead)
    assert letter[b"entry"].decode() == entry_id


async def test_invalid_entry_does_not_overwrite_an_ended_job(
    echo_worker: RunningWorker, queue_name: str, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await serves_a_fresh_job(redis_client, keys, "ended")  # job "ended-fresh" is done
    entry_id = await xadd(redis_client, keys.jobs, {b"job": b'{"id": "ended-fresh", "prompt": 5}'})
    await settle(redis_client, keys, entry_id)
    stored = await stored_result(redis_client, keys.result("ended-fresh"))
    assert stored is not None and stored["state"] == "done", stored
    assert await redis_client.hget(keys.job("ended-fresh"), "state") == b"done"
