"""Logprobs, structured output and speculative decoding on the exllamav2 engine (GPU)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest, InvalidRequest
from exlq.worker.engines.base import Engine
from tests.gpu.engine_runs import run

PROMPT = "The queue holds jobs and the workers take them in turn"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def load(model_dir: Path, **options: Any) -> Engine:
    from exlq.worker.engines import build_engine
    from exlq.worker.settings import WorkerSettings

    settings = WorkerSettings.load(
        {"cache_tokens": 16_384, **options}, model=model_dir, max_batch_size=16
    )
    return build_engine("exllamav2", settings.load_request())


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    loaded = load(model_dir)
    assert loaded.info()["structured_output"] == "on"
    yield loaded
    loaded.close()


def greedy(prompt: str = PROMPT, **fields: Any) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt,
        max_new_tokens=fields.pop("max_new_tokens", 8),
        sampling={"temperature": 0.0},
        **fields,  # type: ignore[arg-type]
    )


def test_logprobs_are_the_same_on_every_sampling_path(engine: Engine) -> None:
    # Random weights: the values are checked against transformers on SmolLM2
    # (test_smollm2_on_gpu.py); here, that both samplers report the same distribution.
    cpu_sampled = {"temperature": 1.0, "top_p": 0.5, "seed": 1}  # exllamav2's CPU sampler
    requests = {
        "gpu": greedy(logprobs=3),
        "cpu": GenerationRequest(prompt=PROMPT, max_new_tokens=8, logprobs=3, sampling=cpu_sampled),  # type: ignore[arg-type]
    }
    outcome = run(engine, requests)
    firsts = {}
    for job_id in requests:
        chunks = outcome["chunks"][job_id]
        first = chunks[0].logprobs[0].top
        values = [t.logprob for t in first[:3]]
        assert values == sorted(values, reverse=True), job_id
        assert chunks[0].token_ids[0] in [t.token_id for t in first]  # always reported
        tokens = sum(len(c.token_ids) for c in chunks)
        assert tokens == sum(len(c.logprobs or []) for c in chunks)
        firsts[job_id] = [(t.token_id, round(t.logprob, 3)) for t in first[:3]]
    assert firsts["gpu"] == firsts["cpu"]  # the same first position, before any sampling
    greedy_first = outcome["chunks"]["gpu"][0]
    assert greedy_first.token_ids[0] == greedy_first.logprobs[0].top[0].token_id
    assert greedy_first.logprobs[0].top[0].logprob < -0.01  # not the sampler's 1.0
    assert greedy_first.logprobs[0].top[1].logprob > -60  # nor its zeros


def test_json_schema_jobs_return_json_that_validates(engine: Engine) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    requests = {
        f"j{seed}": GenerationRequest(
            prompt=f"{seed} {PROMPT}",
            max_new_tokens=200,
            response_format=response_format,  # type: ignore[arg-type]
            sampling={"temperature": 0.8, "seed": seed},  # type: ignore[arg-type]
        )
        for seed in range(12)
    }
    outcome = run(engine, requests)
    for job_id in requests:
        text = "".join(c.text for c in outcome["chunks"][job_id])
        assert outcome["ends"][job_id].finish_reason == "stop", text
        value = json.loads(text)
        assert set(value) == {"name", "age", "role", "tags"}
        assert isinstance(value["name"], str) and isinstance(value["age"], int)
        assert value["role"] in ("admin", "user", "guest") and isinstance(value["tags"], list)


def test_a_regex_job_matches_and_plain_jobs_beside_it_are_untouched(engine: Engine) -> None:
    plain_alone = run(engine, {"p": greedy(max_new_tokens=16, ignore_eos=True)})
    outcome = run(
        engine,
        {
            "r": greedy(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}", max_new_tokens=20),
            "p": greedy(max_new_tokens=16, ignore_eos=True),
        },
    )
    date = "".join(c.text for c in outcome["chunks"]["r"])
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date), date
    assert token_ids(outcome, "p") == token_ids(plain_alone, "p")


def test_a_schema_that_cannot_compile_is_an_invalid_request(engine: Engine) -> None:
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}
    with pytest.raises(InvalidRequest, match="json_schema"):
        engine.add("bad", greedy(response_format=bad))  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [{"ngram_draft": True}, {"draft_model": "SELF"}])
def test_drafting_gives_the_greedy_text_of_no_drafting(
    engine: Engine, model_dir: Path, options: dict[str, Any]
) -> None:
    requests = {
        f"j{i}": greedy(f"{i} {PROMPT} " * 4, max_new_tokens=48, ignore_eos=True, logprobs=2)
        for i in range(4)
    }
    want = run(engine, requests)
    if options.get("draft_model") == "SELF":
        options = {"draft_model": str(model_dir)}
    drafting = load(model_dir, **options)
    try:
        info = drafting.info()
        # The verify step (and a draft model's steps) replay graphs of their own shape.
        assert info["drafting"] != "off" and info["decode_graphs"] == "on"
        got = run(drafting, requests)
        with pytest.raises(InvalidRequest, match="drafts tokens"):
            drafting.add("c", greedy(regex="[0-9]+"))
    finally:
        drafting.close()
    for job_id in requests:
        # max_new_tokens holds, though exllamav2 ends a drafting job num_draft_tokens early.
        ended = got["ends"][job_id]
        assert ended.completion_tokens == 48
        # What exlq_draft_tokens_total and its accepted count add up; a draft equal to the
        # model has its drafts accepted, and the plain engine drafts nothing.
        assert want["ends"][job_id].draft_tokens is None
        assert 0 <= ended.accepted_draft_tokens <= ended.draft_tokens
        if "draft_model" in options:
            assert ended.accepted_draft_tokens > 0
        plain, drafted = token_ids(want, job_id), token_ids(got, job_id)
        parted = next(
            (n for n, (a, b) in enumerate(zip(plain, drafted, strict=True)) if a != b), None
        )
        # Random weights: near-ties everywhere, and verification runs other kernel shapes,
        # so greedy may part after a while (SmolLM2's test compares a real model's text).
        margin = None
        if parted is not None:
            choices = [c for chunk in want["chunks"][job_id] for c in chunk.logprobs or []]
            top = choices[parted].top
            margin = round(top[0].logprob - top[1].logprob, 4)  # the top two logits' gap
        print(f"\n{options}: {job_id} parted at {parted}, top-two margin there {margin}")
        assert plain[:4] == drafted[:4], (job_id, parted)


def token_ids(outcome: dict[str, Any], job_id: str) -> list[int]:
    return [t for c in outcome["chunks"][job_id] for t in c.token_ids]
