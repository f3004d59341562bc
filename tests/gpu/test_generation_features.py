"""Logprobs, structured output and speculative decoding on the exllamav2 engine (GPU)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest, InvalidRequest
from exlq.worker.engines.base import Engine, TokenChunk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

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


def run(engine: Engine, requests: dict[str, GenerationRequest]) -> dict[str, Any]:
    for job_id, request in requests.items():
        engine.add(job_id, request)
    chunks: dict[str, list[TokenChunk]] = {job_id: [] for job_id in requests}
    ends: dict[str, Any] = {}
    while len(ends) < len(requests):
        for out in engine.step():
            if isinstance(out, TokenChunk):
                chunks[out.job_id].append(out)
            else:
                ends[out.job_id] = out
    return {"chunks": chunks, "ends": ends}


def greedy(prompt: str = PROMPT, **fields: Any) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt,
        max_new_tokens=fields.pop("max_new_tokens", 8),
        sampling={"temperature": 0.0},
        **fields,  # type: ignore[arg-type]
    )


def test_logprobs_are_the_models_distribution_on_every_sampling_path(engine: Any) -> None:
    import torch

    ids = engine.tokenizer.encode(PROMPT, add_bos=True)
    with torch.inference_mode():
        logits = engine.model.forward(ids)[0, -1].float()
    vocab = engine.tokenizer.get_vocab_size()
    expected = torch.log_softmax(logits[:vocab], dim=-1).topk(3)
    requests = {
        "gpu": greedy(logprobs=3),  # GPU sampling
        # top_p is sampled by exllamav2's CPU sampler
        "cpu": GenerationRequest(
            prompt=PROMPT,
            max_new_tokens=8,
            logprobs=3,
            sampling={"temperature": 1.0, "top_p": 0.5, "seed": 1},
        ),  # type: ignore[arg-type]
    }
    outcome = run(engine, requests)
    for job_id in requests:
        first = outcome["chunks"][job_id][0].logprobs[0].top
        assert [t.token_id for t in first[:3]] == expected.indices.tolist(), job_id
        for got, want in zip(first[:3], expected.values.tolist(), strict=True):
            assert math.isclose(got.logprob, want, abs_tol=0.05), (job_id, got, want)
        chosen = outcome["chunks"][job_id][0].token_ids[0]
        assert chosen in [t.token_id for t in first]  # the chosen token is always reported
    greedy_first = outcome["chunks"]["gpu"][0]
    assert greedy_first.logprobs[0].top[0].logprob < -0.01  # not the sampler's 1.0
    assert greedy_first.logprobs[0].top[1].logprob > -60  # nor its zeros
    total = sum(len(c.token_ids) for c in outcome["chunks"]["gpu"])
    assert total == sum(len(c.logprobs or []) for c in outcome["chunks"]["gpu"])


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
        f"j{i}": greedy(f"{i} {PROMPT} " * 4, max_new_tokens=48, ignore_eos=True) for i in range(4)
    }
    want = run(engine, requests)
    if options.get("draft_model") == "SELF":
        options = {"draft_model": str(model_dir)}
    drafting = load(model_dir, **options)
    try:
        assert drafting.info()["drafting"] != "off"
        got = run(drafting, requests)
        with pytest.raises(InvalidRequest, match="drafts tokens"):
            drafting.add("c", greedy(regex="[0-9]+"))
    finally:
        drafting.close()
    for job_id in requests:
        assert got["ends"][job_id].completion_tokens == 48
        plain, drafted = token_ids(want, job_id), token_ids(got, job_id)
        same = sum(a == b for a, b in zip(plain, drafted, strict=True))
        # Verification runs other kernel shapes: greedy may part where two logits tie.
        assert plain[:8] == drafted[:8] and same >= 40, (job_id, same)


def token_ids(outcome: dict[str, Any], job_id: str) -> list[int]:
    return [t for c in outcome["chunks"][job_id] for t in c.token_ids]
