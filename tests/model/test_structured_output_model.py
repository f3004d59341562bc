"""Structured output on SmolLM2-135M-Instruct through the transformers engine: JSON that
matches its schema on every seed, regexes matched in full, any JSON object, the model's own
logprobs beside the mask, and a schema llguidance refuses as an error event of the worker."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import pytest

from exlq.producer import AsyncProducer, ErrorEvent
from exlq.protocol.models import ChatMessage, GenerationRequest
from exlq.worker.engines.base import Engine, JobEnded
from tests.model.jobs import step_until_idle

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "color", "hobbies"],
    "additionalProperties": False,
}
# The longest output the schema allows, in SmolLM2's tokens, is well under this: a job
# never ends "length" part way through its object.
PERSON_TOKENS = 160
SAMPLED_RUNS = 100


def ask(question: str, **fields: Any) -> GenerationRequest:
    fields.setdefault("sampling", {"temperature": 0.0})
    return GenerationRequest(messages=[ChatMessage(role="user", content=question)], **fields)


def person(seed: int) -> GenerationRequest:
    return ask(
        "Describe a person as JSON: name, age, favourite color and hobbies.",
        max_new_tokens=PERSON_TOKENS,
        sampling={"temperature": 0.7 + 0.1 * (seed % 4), "seed": seed},
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        },
    )


def test_a_hundred_sampled_jobs_at_once_all_match_the_schema(engine: Engine) -> None:
    for seed in range(SAMPLED_RUNS):
        engine.add(f"p{seed}", person(seed))
    began = time.perf_counter()
    run = step_until_idle(engine)
    print(f"{SAMPLED_RUNS} constrained jobs in {time.perf_counter() - began:.1f} s")
    assert run.most_jobs_in_a_step == SAMPLED_RUNS
    texts = set()
    for seed in range(SAMPLED_RUNS):
        end = run.ends[f"p{seed}"]
        assert isinstance(end, JobEnded) and end.finish_reason == "stop", end
        text = run.text(f"p{seed}")
        jsonschema.validate(json.loads(text), PERSON)
        texts.add(text)
    assert len(texts) > SAMPLED_RUNS // 2  # sampled: the seeds tell the jobs apart


@pytest.mark.parametrize(
    ("question", "pattern"),
    [
        ("When did Apollo 11 land on the Moon? Answer with the date.", r"\d{4}-\d{2}-\d{2}"),
        ("Write a phone number in the United States.", r"\(\d{3}\) \d{3}-\d{4}"),
        ("Is Paris in France? Answer yes or no.", r"(yes|no)\."),
    ],
)
def test_a_regex_is_matched_in_full_greedy_and_sampled(
    engine: Engine, question: str, pattern: str
) -> None:
    samplings: list[dict[str, Any]] = [{"temperature": 0.0}]
    samplings += [{"temperature": 1.0, "seed": seed} for seed in range(4)]
    for n, sampling in enumerate(samplings):
        engine.add(f"r{n}", ask(question, regex=pattern, max_new_tokens=24, sampling=sampling))
    run = step_until_idle(engine)
    for n in range(len(samplings)):
        end = run.ends[f"r{n}"]
        assert isinstance(end, JobEnded) and end.finish_reason == "stop"
        assert re.fullmatch(pattern, run.text(f"r{n}")), run.text(f"r{n}")


def test_json_object_gives_an_object_and_ends_there_even_with_ignore_eos(engine: Engine) -> None:
    any_object: Any = {"type": "json_object"}
    engine.add("greedy", ask("Describe a cat as JSON.", response_format=any_object))
    engine.add(
        "past-eos",
        ask(
            "Describe a dog as JSON.",
            response_format=any_object,
            ignore_eos=True,  # the grammar decides where a constrained output ends
            sampling={"temperature": 0.8, "seed": 3},
        ),
    )
    run = step_until_idle(engine)
    for job_id in ("greedy", "past-eos"):
        end = run.ends[job_id]
        assert isinstance(end, JobEnded) and end.finish_reason == "stop"
        assert isinstance(json.loads(run.text(job_id)), dict)


def test_a_job_cut_short_ends_length_with_its_text_unfinished(engine: Engine) -> None:
    engine.add("short", person(0).model_copy(update={"max_new_tokens": 6}))
    run = step_until_idle(engine)
    end = run.ends["short"]
    assert isinstance(end, JobEnded) and end.finish_reason == "length"
    assert end.completion_tokens == 6
    assert run.text("short").startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(run.text("short"))


def test_logprobs_of_a_constrained_job_are_the_models_own(engine: Engine) -> None:
    import torch

    from exlq.worker.engines.transformers.prompt import prompt_ids

    request = ask(
        "What is the capital of France?",
        regex=r"\{ ?[A-Z][a-z]+ ?\}",  # a start the model would not choose: "{"
        logprobs=2,
        max_new_tokens=8,
    )
    engine.add("q", request)
    first = step_until_idle(engine).chunks["q"][0]
    assert first.logprobs is not None
    chosen = first.token_ids[0]
    by_id = {choice.token_id: choice.logprob for choice in first.logprobs[0].top}

    # The model's distribution at the first position, unmasked.
    loaded: Any = engine
    ids = prompt_ids(request, loaded.tokenizer, loaded.vocab_size)
    with torch.inference_mode():
        logits = loaded.loaded.model(torch.tensor([ids])).logits[0, -1].float()
    expected = torch.log_softmax(logits, dim=-1)
    assert loaded.tokenizer.decode([chosen]) == "{"
    assert by_id[chosen] == pytest.approx(float(expected[chosen]), abs=1e-3)
    assert by_id[chosen] < -0.1  # under the mask it would be the only token: 0.0
    assert first.logprobs[0].top[0].token_id == int(expected.argmax()) != chosen


@pytest.mark.integration
async def test_through_a_worker_a_schema_matches_and_a_bad_one_is_an_error_event(
    engine: Engine, redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker(engine=engine)
    bad_schema = {"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        good = await producer.submit(request=person(7))
        bad = await producer.submit(
            messages=[{"role": "user", "content": "Hi"}], response_format=bad_schema
        )
        bad_regex = await producer.submit("Hi", regex="(unclosed")
        matched = await good.result(timeout=60)
        refused = [event async for event in bad.stream()]
        refused_regex = [event async for event in bad_regex.stream()]
    assert matched.state == "done" and matched.finish_reason == "stop"
    jsonschema.validate(json.loads(matched.text), PERSON)
    [error] = refused
    assert isinstance(error, ErrorEvent) and error.error.code == "invalid_request"
    assert error.error.message == "response_format.json_schema.schema: Invalid type: frobnicate"
    [error] = refused_regex
    assert isinstance(error, ErrorEvent) and error.error.code == "invalid_request"
    assert error.error.message.startswith("regex: regex parse error")
    assert "unclosed group" in error.error.message
