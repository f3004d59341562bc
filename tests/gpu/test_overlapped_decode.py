"""Overlapped decode steps (engines/exllamav2/overlap.py) give every job what steps run to
their end give it: the same tokens, text and end, on SmolLM2, through the engine's own calls,
with jobs that end early (stop strings, stop tokens, end of text, max_new_tokens), jobs that
join a running batch, a job cancelled with a step in flight, and jobs that need the host's
view of each token (top_p, banned strings, logprobs) forcing steps back to their end and
back again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest
from exlq.worker.engines.base import Engine, JobEnded, TokenChunk

QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Explain in two sentences why the sky is blue.",
    "List the days of the week.",
    "What is 12 plus 30?",
    "Tell me a short story about a cat who learns to fly.",
    "Give me a recipe for pancakes.",
]


def _chat(question: str, max_new_tokens: int, **fields: Any) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": question}],  # type: ignore[list-item]
        max_new_tokens=max_new_tokens,
        **fields,
    )


@pytest.fixture(scope="module")
def engine(smollm2: tuple[Path, Any, Any]) -> Iterator[Engine]:
    from exlq.worker.engines import build_engine
    from exlq.worker.settings import WorkerSettings

    settings = WorkerSettings.load({"cache_tokens": 16_384}, model=smollm2[0], max_batch_size=16)
    loaded = build_engine("exllamav2", settings.load_request())
    assert loaded.info()["overlapped_steps"] == "on"
    yield loaded
    loaded.close()


def _first_wave() -> dict[str, GenerationRequest]:
    greedy = {"temperature": 0.0}
    return {
        "plain-long": _chat(QUESTIONS[6], 300, sampling=greedy, ignore_eos=True),
        "eos": _chat(QUESTIONS[0], 64, sampling=greedy),
        "stop-string": _chat(QUESTIONS[4], 120, sampling=greedy, stop=["Wednesday"]),
        "short": _chat(QUESTIONS[5], 3, sampling=greedy),
        "seeded": _chat(QUESTIONS[1], 80, sampling={"temperature": 0.8, "top_k": 40, "seed": 11}),
        "to-cancel": _chat(QUESTIONS[7], 200, sampling=greedy, ignore_eos=True),
    }


def _second_wave(stop_token: int) -> dict[str, GenerationRequest]:
    greedy = {"temperature": 0.0}
    return {
        "stop-token": _chat(QUESTIONS[3], 100, sampling=greedy, stop_token_ids=[stop_token]),
        "top-p": _chat(QUESTIONS[2], 20, sampling={"temperature": 0.7, "top_p": 0.9, "seed": 3}),
        "banned": _chat(QUESTIONS[3], 40, sampling=greedy, banned_strings=["blue"]),
        "logprobs": _chat(QUESTIONS[2], 12, sampling=greedy, logprobs=2),
        "joins-late": _chat(QUESTIONS[7], 90, sampling=greedy),
    }


class _Record:
    """What the jobs of a run got: token ids, text and end by job, and any chunk a
    cancelled job got after its cancel."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}
        self.texts: dict[str, str] = {}
        self.ends: dict[str, JobEnded] = {}
        self.cancelled: set[str] = set()
        self.after_cancel: list[TokenChunk] = []

    def take(self, outputs: list[Any]) -> None:
        for out in outputs:
            if isinstance(out, TokenChunk):
                if out.job_id in self.cancelled:
                    self.after_cancel.append(out)
                self.ids.setdefault(out.job_id, []).extend(out.token_ids)
                self.texts[out.job_id] = self.texts.get(out.job_id, "") + out.text
            elif isinstance(out, JobEnded):
                self.ends[out.job_id] = out
            else:
                raise AssertionError(f"{out}")


def _drive(engine: Engine, stop_token: int) -> tuple[_Record, int]:
    """The first wave at once; `to-cancel` cancelled after 6 steps; the second wave added
    after 10 steps and `joins-late` alone once the host-view jobs have ended. Returns what
    the jobs got and the steps that ran."""
    record = _Record()
    first = _first_wave()
    late = _second_wave(stop_token)
    joins_late = late.pop("joins-late")
    for job_id, request in first.items():
        engine.add(job_id, request)
    expected = len(first) + len(late) + 1
    steps = 0
    while len(record.ends) < expected:
        if steps == 6:
            ended = engine.cancel("to-cancel")
            assert ended is not None and ended.finish_reason == "cancelled"
            record.ends["to-cancel"] = ended
            record.cancelled.add("to-cancel")
        if steps == 10:
            for job_id, request in late.items():
                engine.add(job_id, request)
        if steps > 10 and "joins-late" not in record.ids and late.keys() <= record.ends.keys():
            engine.add("joins-late", joins_late)
            record.ids["joins-late"] = []
        record.take(engine.step())
        steps += 1
        if steps == 2000:
            stuck = _describe_unfinished(engine)
            engine.abort_all()  # the module's next test starts from an empty engine
            raise AssertionError(f"the jobs never ended: {stuck}")
    assert not record.after_cancel, "a cancelled job got tokens"
    assert engine.active_jobs == 0
    return record, steps


def _describe_unfinished(engine: Any) -> str:
    generator = engine.generator
    return "; ".join(
        f"{job.identifier}: {job.new_tokens} new, kv_position {job.sequences[0].kv_position} "
        f"of {len(job.sequences[0].sequence_ids)} tokens"
        for job in [*generator.active_jobs, *generator.pending_jobs]
    )


def test_overlapped_steps_give_each_job_what_steps_run_to_their_end_give(engine: Any) -> None:
    generator = engine.generator
    overlap = generator.overlap
    # A stop token the greedy answer reaches: its 10th token.
    probe = _drive_one(engine, _chat(QUESTIONS[3], 12, sampling={"temperature": 0.0}))
    stop_token = probe[9]

    overlap.enabled = False
    try:
        want, want_steps = _drive(engine, stop_token)
    finally:
        overlap.enabled = True
    launched = overlap.launched
    got, got_steps = _drive(engine, stop_token)
    launched = overlap.launched - launched

    assert launched > 50, "the steps did not overlap"
    for job_id, want_end in want.ends.items():
        got_end = got.ends[job_id]
        if job_id == "to-cancel":
            # Cancelled at the same step: the run ahead had read one token fewer by then.
            assert want.ids[job_id][: len(got.ids[job_id])] == got.ids[job_id]
            continue
        assert got.ids[job_id] == want.ids[job_id], job_id
        assert got.texts[job_id] == want.texts[job_id], job_id
        assert (got_end.finish_reason, got_end.completion_tokens) == (
            want_end.finish_reason,
            want_end.completion_tokens,
        ), job_id
    # The jobs ended where their requests say, the stop token and string not output.
    assert got.ends["stop-token"].finish_reason == "stop"
    assert got.ids["stop-token"] == probe[: probe.index(stop_token)]
    assert got.ends["stop-string"].finish_reason == "stop"
    assert "Wednesday" not in got.texts["stop-string"]
    assert "blue" not in got.texts["banned"].lower()
    assert got.ends["plain-long"].completion_tokens == 300
    assert got.ends["short"].finish_reason == "length"
    # Every page went back: nothing holds one once the jobs have ended.
    assert not generator.referenced_pages
    print(
        f"\n{launched} steps launched ahead of the step before's read; "
        f"{got_steps} engine steps against {want_steps} run to their end"
    )


def test_a_prompt_that_repeats_an_overlapped_jobs_output_finds_its_pages(engine: Any) -> None:
    """The pages a job fills while its steps overlap are hashed as exllamav2 hashes them: a
    later prompt that repeats the job's prompt and output reuses them."""
    first = _chat(QUESTIONS[6], 400, sampling={"temperature": 0.0}, ignore_eos=True)
    tokens = _drive_one(engine, first)
    from exlq.worker.engines.exllama_prompt import prompt_tensor

    prompt = prompt_tensor(first, engine.tokenizer, engine.chat, engine.model.config.vocab_size)
    follow = GenerationRequest(
        input_ids=prompt[0].tolist() + tokens[:380], max_new_tokens=4, sampling={"temperature": 0}
    )
    engine.add("follow", follow)
    end = _until_end(engine, "follow")
    assert end.cached_tokens is not None
    whole_pages = (prompt.shape[-1] + 380 - 1) // 256 * 256
    assert end.cached_tokens >= whole_pages, (end.cached_tokens, whole_pages)


def _drive_one(engine: Engine, request: GenerationRequest) -> list[int]:
    engine.add("one", request)
    ids: list[int] = []
    while True:
        for out in engine.step():
            if isinstance(out, TokenChunk):
                ids += out.token_ids
            elif isinstance(out, JobEnded):
                return ids


def _until_end(engine: Engine, job_id: str) -> JobEnded:
    while True:
        for out in engine.step():
            if isinstance(out, JobEnded) and out.job_id == job_id:
                return out
