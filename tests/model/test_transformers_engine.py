"""The transformers engine on SmolLM2-135M-Instruct, driven step by step as the engine loop
drives it: batching, ends, cancels, logprobs and the requests it refuses."""

from __future__ import annotations

import pytest

from exlq.protocol.models import ChatMessage, GenerationRequest, InvalidRequest
from exlq.worker.engines.base import Engine, JobEnded
from tests.model.jobs import Run, alone, capital, step_until_idle

pytestmark = pytest.mark.model


def chat(question: str, max_new_tokens: int) -> GenerationRequest:
    """A greedy job of a set length (past the end-of-text token)."""
    return GenerationRequest(
        messages=[ChatMessage(role="user", content=question)],
        max_new_tokens=max_new_tokens,
        sampling={"temperature": 0.0},  # type: ignore[arg-type]
        ignore_eos=True,
    )


def test_the_capital_of_france_is_paris(engine: Engine) -> None:
    engine.add("q", capital())
    run = step_until_idle(engine)
    assert "Paris" in run.text("q")
    end = run.ends["q"]
    assert isinstance(end, JobEnded) and end.finish_reason == "stop"
    assert end.prompt_tokens > 20 and 0 < end.completion_tokens < 16


def test_jobs_that_join_and_leave_a_batch_get_the_text_each_gets_alone(engine: Engine) -> None:
    # Each job's prompt is a different length; the second is longest (the batch is padded
    # to it when it joins), the third shortest (it is padded to the batch), and the second
    # ends first (the columns only it used are trimmed), the others running on after it.
    jobs = {
        "short-first": chat("Name a color.", 12),
        "long-second": chat("List three animals that live in the sea and say why.", 5),
        "shorter-third": chat("Hi", 9),
    }
    expected = {job_id: alone(engine, request) for job_id, request in jobs.items()}

    run = Run()
    engine.add("short-first", jobs["short-first"])
    for _ in range(2):
        run.take(engine.step())
    engine.add("long-second", jobs["long-second"])
    run.take(engine.step())
    engine.add("shorter-third", jobs["shorter-third"])
    step_until_idle(engine, run)

    assert run.most_jobs_in_a_step == 3
    assert {job_id: run.text(job_id) for job_id in jobs} == expected
    for job_id, request in jobs.items():
        end = run.ends[job_id]
        assert isinstance(end, JobEnded) and end.finish_reason == "length"
        assert end.completion_tokens == request.max_new_tokens


def test_a_seeded_job_draws_the_same_tokens_beside_other_jobs(engine: Engine) -> None:
    seeded = capital(sampling={"temperature": 1.0, "seed": 42}, max_new_tokens=20)
    expected = alone(engine, seeded)
    engine.add("beside", chat("Tell me a story.", 20))
    engine.add("seeded", seeded)
    engine.add("other-seed", capital(sampling={"temperature": 1.0, "seed": 43}, max_new_tokens=20))
    run = step_until_idle(engine)
    assert run.text("seeded") == expected
    assert run.text("other-seed") != expected


def test_stop_token_ids_end_the_job_without_the_tokens_text(engine: Engine) -> None:
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    france = tokenizer(" France", add_special_tokens=False)["input_ids"]
    assert len(france) == 1
    engine.add("q", capital(stop_token_ids=france))
    run = step_until_idle(engine)
    assert run.text("q") == "The capital of"
    end = run.ends["q"]
    assert isinstance(end, JobEnded) and end.finish_reason == "stop"
    assert end.completion_tokens == 4  # the stop token was made, so it counts


def test_ignore_eos_runs_past_the_end_of_text(engine: Engine) -> None:
    engine.add("q", capital(ignore_eos=True, max_new_tokens=12))
    run = step_until_idle(engine)
    end = run.ends["q"]
    assert isinstance(end, JobEnded) and end.finish_reason == "length"
    assert end.completion_tokens == 12
    assert run.text("q").startswith("The capital of France is Paris.")


def test_a_character_made_of_several_tokens_goes_out_whole(engine: Engine) -> None:
    # SmolLM2 writes this emoji as three byte tokens: the first two decode to U+FFFD alone.
    engine.add("q", chat("Reply with only a heart emoji.", 6))
    chunks = step_until_idle(engine).chunks["q"]
    whole = [chunk for chunk in chunks if len(chunk.token_ids) > 1]
    assert whole and all(len(chunk.text) == 1 and ord(chunk.text) > 0xFFFF for chunk in whole)
    assert not any("\ufffd" in chunk.text for chunk in chunks)


def test_token_ids_are_the_same_prompt_as_their_text(engine: Engine) -> None:
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    text = tokenizer.apply_chat_template(
        [m.model_dump() for m in capital().messages or []],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    by_ids = GenerationRequest(
        input_ids=ids,
        max_new_tokens=16,
        sampling={"temperature": 0.0},  # type: ignore[arg-type]
    )
    assert alone(engine, by_ids) == alone(engine, capital())


def test_cancel_ends_a_job_at_once_and_the_others_run_on(engine: Engine) -> None:
    keep = chat("Name a color.", 8)
    expected = alone(engine, keep)
    engine.add("keep", keep)
    engine.add("cancel", chat("Tell me a story.", 50))
    run = Run()
    for _ in range(3):
        run.take(engine.step())
    cancelled = engine.cancel("cancel")
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    assert cancelled.completion_tokens == 3 and cancelled.prompt_tokens > 20
    assert engine.cancel("cancel") is None
    engine.add("never-stepped", keep)
    ended = engine.cancel("never-stepped")
    assert ended is not None and ended.completion_tokens == 0
    step_until_idle(engine, run)
    assert run.text("keep") == expected
    assert engine.active_jobs == 0


def test_logprobs_name_the_likeliest_tokens_and_the_chosen_one(engine: Engine) -> None:
    engine.add("q", capital(logprobs=3))
    run = step_until_idle(engine)
    chunks = run.chunks["q"]
    for chunk in chunks:
        assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)
        for token_id, choices in zip(chunk.token_ids, chunk.logprobs, strict=True):
            values = [choice.logprob for choice in choices.top]
            assert len(values) == 3 and values == sorted(values, reverse=True)
            assert choices.top[0].token_id == token_id  # greedy: the likeliest
            assert all(value <= 0 for value in values)
    assert chunks[0].logprobs is not None and chunks[0].logprobs[0].top[0].token == "The"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"prompt": "Hi", "max_new_tokens": 9000}, "exceeds the 8192 tokens"),
        ({"input_ids": [1, 49152]}, "outside the vocabulary"),
        ({"prompt": "Hi", "banned_strings": ["x"]}, "banned_strings"),
        ({"prompt": ""}, "no tokens"),
    ],
)
def test_requests_it_can_never_run_are_refused(
    engine: Engine, fields: dict[str, object], says: str
) -> None:
    with pytest.raises(InvalidRequest, match=says):
        engine.add("bad", GenerationRequest(**fields))  # type: ignore[arg-type]
    assert engine.active_jobs == 0
