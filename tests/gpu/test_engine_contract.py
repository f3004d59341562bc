"""The engine contract on every GPU engine, on a real model (SmolLM2-135M-Instruct): the
same tests for exllamav2 and exllamav3, through the engine's own calls and end to end
(SDK -> Redis -> worker -> engine -> pub/sub -> SDK). Prints the figures it checks."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exlq.producer import AsyncProducer, DoneEvent, JobFailed, TokenEvent
from exlq.protocol.models import GenerationRequest, InvalidRequest
from exlq.worker.engines.base import Engine, JobEnded, TokenChunk
from tests.gpu.engine_runs import run

ENGINES = ["exllamav2", "exllamav3"]
PROMPT = "Write a short story about a lighthouse keeper and the sea."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Rome", "Berlin"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, smollm2: tuple[Path, Any, Any]) -> Iterator[Engine]:
    name: str = request.param
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    from exlq.worker.engines import build_engine
    from exlq.worker.settings import WorkerSettings

    settings = WorkerSettings.load(
        {"cache_tokens": 16_384}, engine=name, model=smollm2[0], max_batch_size=16
    )
    loaded = build_engine(name, settings.load_request())
    print(f"\n{name}: {loaded.info()}")
    assert loaded.info()["structured_output"] == "on"
    yield loaded
    loaded.close()


def chat(prompt: str = PROMPT, max_new_tokens: int = 48, **fields: Any) -> GenerationRequest:
    fields.setdefault("sampling", {"temperature": 0.0})
    return GenerationRequest(
        messages=[{"role": "user", "content": prompt}],  # type: ignore[list-item]
        max_new_tokens=max_new_tokens,
        **fields,
    )


def greedy_text(engine: Engine, **fields: Any) -> tuple[str, list[int]]:
    out = run(engine, {"g": chat(**fields)})
    return out["texts"]["g"], out["ids"]["g"]


def test_greedy_is_repeatable_and_a_batch_gives_each_job_its_own_text(engine: Engine) -> None:
    prompts = [PROMPT, "Name three primary colors.", "What is 12 plus 30?"]
    alone = [greedy_text(engine, prompt=p)[0] for p in prompts]
    again = [greedy_text(engine, prompt=p)[0] for p in prompts]
    print(f"\n{engine.name}: {alone}")
    assert len(set(alone)) == 3 and all(alone) and again == alone
    # In a batch each job keeps its own text; a batch's kernels may round otherwise than one
    # job's, so only the opening tokens must agree.
    alone_ids = [greedy_text(engine, prompt=p, max_new_tokens=8)[1] for p in prompts]
    together = run(engine, {str(n): chat(p, max_new_tokens=8) for n, p in enumerate(prompts)})
    assert [together["ids"][str(n)] for n in range(3)] == alone_ids


def test_a_stop_string_ends_the_text_before_it(engine: Engine) -> None:
    text, _ = greedy_text(engine)
    words = text.split()
    assert len(words) > 6, text
    stop = " " + words[5]
    out = run(engine, {"s": chat(stop=[stop])})
    assert out["ends"]["s"].finish_reason == "stop"
    assert out["texts"]["s"] == text[: text.index(stop)]


def test_a_stop_token_id_ends_the_job_and_is_not_part_of_it(engine: Engine) -> None:
    _, ids = greedy_text(engine, ignore_eos=True)
    stop_id = ids[4]
    out = run(engine, {"t": chat(stop_token_ids=[stop_id], ignore_eos=True)})
    end = out["ends"]["t"]
    assert end.finish_reason == "stop"
    assert out["ids"]["t"] == ids[: ids.index(stop_id)]
    assert end.completion_tokens == ids.index(stop_id) + 1


def test_max_new_tokens_ends_a_job_with_length(engine: Engine) -> None:
    out = run(engine, {"l": chat(max_new_tokens=5, ignore_eos=True)})
    end = out["ends"]["l"]
    assert (end.finish_reason, end.completion_tokens, len(out["ids"]["l"])) == ("length", 5, 5)
    assert end.prompt_tokens > 10


def test_a_banned_string_never_appears(engine: Engine) -> None:
    text, _ = greedy_text(engine)
    banned = text.split()[3].strip(".,!?;:'\"")
    assert len(banned) > 1, text
    out = run(engine, {"b": chat(banned_strings=[banned])})
    print(f"\n{engine.name}: banned {banned!r}: {out['texts']['b']!r}")
    assert banned.lower() not in out["texts"]["b"].lower()
    assert out["texts"]["b"]


def test_a_seed_repeats_its_sample_and_another_seed_draws_apart(engine: Engine) -> None:
    def sampled(seed: int) -> list[int]:
        fields = {"sampling": {"temperature": 1.0, "seed": seed}, "ignore_eos": True}
        return run(engine, {"r": chat(max_new_tokens=32, **fields)})["ids"]["r"]

    first, again, other = sampled(7), sampled(7), sampled(8)
    assert first == again and first != other


def test_cancel_ends_a_running_job_and_frees_its_slot(engine: Engine) -> None:
    engine.add("long", chat(max_new_tokens=400, ignore_eos=True))
    engine.add("short", chat(max_new_tokens=8, ignore_eos=True))
    seen = 0
    while seen < 3:
        seen += sum(
            1 for out in engine.step() if isinstance(out, TokenChunk) and out.job_id == "long"
        )
    ended = engine.cancel("long")
    assert ended is not None and ended.finish_reason == "cancelled"
    assert ended.completion_tokens >= 3 and ended.prompt_tokens > 10
    assert engine.cancel("long") is None
    ends = {}
    while engine.active_jobs:
        ends.update({o.job_id: o for o in engine.step() if isinstance(o, JobEnded)})
    assert set(ends) == {"short"} and ends["short"].completion_tokens == 8


def test_logprobs_come_with_every_token_likeliest_first(engine: Engine) -> None:
    # Their values against each engine's own logits: test_smollm2_on_gpu.py (exllamav2),
    # test_exllamav3_engine.py (exllamav3).
    out = run(engine, {"p": chat(max_new_tokens=6, logprobs=3, ignore_eos=True)})
    choices = [c for chunk in out["chunks"]["p"] for c in chunk.logprobs or []]
    ids = out["ids"]["p"]
    assert len(choices) == len(ids) == 6
    for chosen, choice in zip(ids, choices, strict=True):
        values = [t.logprob for t in choice.top]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert values[0] <= 0 and sum(math.exp(v) for v in values) <= 1.0001
        assert choice.top[0].token_id == chosen  # greedy: the chosen token is the likeliest


def test_json_schema_output_validates_and_bad_requests_are_refused(engine: Engine) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    requests = {
        f"j{n}": chat(
            "Describe a person as JSON.",
            max_new_tokens=80,
            response_format=fmt,
            sampling={"temperature": 0.8, "seed": n},
        )
        for n in range(4)
    }
    requests["plain"] = chat(max_new_tokens=16, ignore_eos=True)
    out = run(engine, requests)
    for n in range(4):
        value = json.loads(out["texts"][f"j{n}"])
        assert set(value) == {"name", "age", "city"}, value
        assert isinstance(value["name"], str) and len(value["name"]) <= 20
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
        assert value["city"] in SCHEMA["properties"]["city"]["enum"]  # type: ignore[index]
        assert out["ends"][f"j{n}"].finish_reason == "stop"
    assert out["texts"]["plain"] and out["ends"]["plain"].completion_tokens == 16
    with pytest.raises(InvalidRequest, match="regex"):
        engine.add("bad", chat(regex="(unclosed"))
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        engine.add("long", chat(max_new_tokens=60_000))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.add("ids", GenerationRequest(input_ids=[1, 2, 10_000_000], max_new_tokens=4))
    assert engine.active_jobs == 0


def test_a_repeated_prompt_reuses_its_cached_prefix(engine: Engine) -> None:
    long_prompt = "The harbour log of the lighthouse: " + "wind north, sea calm. " * 120
    first = run(engine, {"a": chat(long_prompt, max_new_tokens=4)})["ends"]["a"]
    second = run(engine, {"b": chat(long_prompt, max_new_tokens=4)})["ends"]["b"]
    print(f"\n{engine.name}: prompt {first.prompt_tokens}, cached {second.cached_tokens}")
    assert first.prompt_tokens > 600
    assert second.cached_tokens is not None and second.cached_tokens >= 512


# -- end to end, through Redis and a worker ---------------------------------------------


async def test_several_jobs_at_once_stream_and_store_the_same_text(
    engine: Engine, start_worker: Any, redis_url: str, queue_name: str
) -> None:
    await start_worker(engine=engine)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = [
            await producer.submit(
                f"Job number {i} tells a story about",
                max_new_tokens=24,
                ignore_eos=True,
                sampling={"temperature": 0.8, "seed": i},
            )
            for i in range(6)
        ]

        async def follow(handle: Any) -> tuple[list[Any], Any]:
            events = [e async for e in handle.stream()]
            return events, await handle.result(timeout=120)

        outcomes = await asyncio.wait_for(asyncio.gather(*(follow(h) for h in handles)), 300)

    for events, result in outcomes:
        done = events[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "length"
        assert done.usage.completion_tokens == 24
        assert done.usage.prompt_tokens > 5
        assert [e.seq for e in events] == list(range(len(events)))
        assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == result.text
        assert sum(len(e.token_ids) for e in events if isinstance(e, TokenEvent)) == 24


async def test_greedy_through_the_queue_and_logprobs_on_the_wire(
    engine: Engine, start_worker: Any, redis_url: str, queue_name: str
) -> None:
    await start_worker(engine=engine)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        request = {"max_new_tokens": 16, "ignore_eos": True, "sampling": {"temperature": 0}}
        first = await (await producer.submit("The capital of", **request)).result(timeout=120)
        second = await (await producer.submit("The capital of", **request)).result(timeout=120)
        assert first.text == second.text and first.usage and first.usage.completion_tokens == 16
        handle = await producer.submit("The capital of", logprobs=3, **request)
        events = [e async for e in handle.stream()]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert tokens[0].logprobs is not None and len(tokens[0].logprobs[0].top) >= 3


async def test_prompt_too_long_fails_with_a_clear_error_and_worker_goes_on(
    engine: Engine, start_worker: Any, redis_url: str, queue_name: str
) -> None:
    await start_worker(engine=engine)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("word " * 20, max_new_tokens=60_000)
        with pytest.raises(JobFailed, match="max_new_tokens"):
            await handle.result(timeout=60)
        ok = await (await producer.submit("Hello", max_new_tokens=4, ignore_eos=True)).result(
            timeout=60
        )
    assert ok.usage is not None and ok.usage.completion_tokens == 4


async def test_cancel_frees_the_slot_on_the_gpu(
    engine: Engine, start_worker: Any, redis_url: str, queue_name: str
) -> None:
    await start_worker(engine=engine)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("Once upon a time", max_new_tokens=4000, ignore_eos=True)
        seen = 0
        async for event in handle.stream():
            if isinstance(event, TokenEvent):
                seen += 1
                if seen == 5:
                    await handle.cancel()
        result = await handle.result(timeout=60)
    assert result.finish_reason == "cancelled" and result.state == "cancelled"
    assert engine.active_jobs == 0
