"""The exllamav2 engine's own paths on a random-weight model: packed ids, shared sampler
settings, jobs built ahead and in the device wait. The contract every engine keeps (end to
end through Redis too) is in test_engine_contract.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Any:
    from exlq.worker.engines import build_engine
    from exlq.worker.settings import WorkerSettings

    settings = WorkerSettings.load({"cache_tokens": 16_384}, model=model_dir, max_batch_size=16)
    loaded = build_engine("exllamav2", settings.load_request())
    info = loaded.info()
    print(f"\nexllamav2 engine: {info} capacity={loaded.capacity}")
    assert info["attention"] in ("exlq", "flash-attn") and loaded.capacity == 16
    # The defaults hold on one GPU with an fp16 model: graphs, GPU sampling, the embedding
    # table on the GPU, batched prefill.
    assert (info["decode_graphs"], info["gpu_sampling"], info["gpu_embedding"]) == ("on",) * 3
    assert 0 < int(info["prefill_batch_tokens"]) <= 4096
    yield loaded
    loaded.close()


def _run_on_engine(engine: Any, requests: dict[str, Any]) -> dict[str, list[int]]:
    """The token ids each job made, straight on the engine (no queue)."""
    from exlq.worker.engines.base import JobEnded, TokenChunk

    for job_id, request in requests.items():
        engine.add(job_id, request)
    outputs: list[Any] = []
    while engine.active_jobs:
        outputs += engine.step()
    assert {o.job_id for o in outputs if isinstance(o, JobEnded)} == set(requests), outputs
    tokens: dict[str, list[int]] = {job_id: [] for job_id in requests}
    for output in outputs:
        if isinstance(output, TokenChunk):
            tokens[output.job_id] += output.token_ids
    return tokens


def test_input_ids_run_as_the_same_prompt_and_unseeded_jobs_draw_apart(engine: Any) -> None:
    from exlq.protocol.models import GenerationRequest

    ids = engine.tokenizer.encode("Once upon a time", add_bos=True)[0].tolist()
    greedy = {"max_new_tokens": 12, "ignore_eos": True, "sampling": {"temperature": 0}}
    by_text = GenerationRequest(prompt="Once upon a time", **greedy)
    by_ids = GenerationRequest(input_ids=ids, **greedy)
    made = _run_on_engine(engine, {"text": by_text}) | _run_on_engine(engine, {"ids": by_ids})
    assert made["ids"] == made["text"] and len(made["ids"]) == 12

    sampled = {"max_new_tokens": 16, "ignore_eos": True}
    runs = [
        _run_on_engine(
            engine,
            {
                "seeded": GenerationRequest(
                    input_ids=ids, sampling={"temperature": 1.0, "top_k": 0, "seed": 7}, **sampled
                ),
                "unseeded": GenerationRequest(
                    input_ids=ids, sampling={"temperature": 1.0, "top_k": 0}, **sampled
                ),
            },
        )
        for _ in range(2)
    ]
    # A seed repeats itself; jobs without one draw their own (16 tokens at temperature 1
    # over the whole vocabulary of random weights: equal by chance essentially never).
    assert runs[0]["seeded"] == runs[1]["seeded"]
    assert runs[0]["unseeded"] != runs[1]["unseeded"]


def test_jobs_of_equal_sampling_share_settings_that_exllamav2_never_changes(
    engine: Any,
) -> None:
    """The engine gives jobs of equal sampling (seeds aside) one ExLlamaV2Sampler.Settings.
    Fails loudly if exllamav2 0.3.2 writes to a job's settings anywhere but for DRY and
    mirostat, which exlq's settings never turn on."""
    import inspect
    import re

    import exllamav2.generator.dynamic as dynamic
    import exllamav2.generator.sampler as sampler

    from exlq.protocol.models import GenerationRequest

    def settings(**sampling: Any) -> Any:
        return engine._sampler(GenerationRequest(prompt="x", sampling=sampling))

    warm = settings(temperature=0.7, top_k=20, seed=1)
    assert settings(temperature=0.7, top_k=20, seed=2) is warm
    assert settings(temperature=0.7, top_k=21) is not warm
    greedy = settings(temperature=0)
    assert settings(temperature=0, seed=9) is greedy and greedy.top_k == 1
    assert (warm.temperature, warm.top_k) == (0.7, 20)
    for made in (warm, greedy):
        assert made.dry_multiplier == 0.0 and not made.mirostat

    source = inspect.getsource(sampler)
    written = re.findall(r"settings\.(\w+)(?: = |\.append\()", source)
    assert set(written) == {
        "ngram_trie",
        "ngram_index",
        "ngram_history",
        "dry_sequence_breakers",
        "mirostat_mu",
    }
    assert "if settings.dry_multiplier > 0.0:" in source
    assert re.search(r"settings\.\w+ = ", inspect.getsource(dynamic)) is None


def test_a_packed_request_makes_the_same_tokens_and_ids_outside_the_vocabulary_fail(
    engine: Any,
) -> None:
    """What the engine process gets (a PackedRequest: ids in a uint32 array) runs as the
    request it came from; an id past the vocabulary is refused in either form, also one
    too large for 32 or 64 bits, which crosses as it is."""
    from exlq.protocol.models import GenerationRequest, InvalidRequest
    from exlq.worker.command_pipe import decode_command, encode_frame
    from exlq.worker.engine_loop import Offer
    from exlq.worker.engines.engine_request import packed_request

    def crossed(request: GenerationRequest) -> Any:
        offer = decode_command(encode_frame(Offer(1, [("a", packed_request(request))]))[8:])
        assert isinstance(offer, Offer)
        return offer.jobs[0][1]

    ids = engine.tokenizer.encode("Once upon a time", add_bos=True)[0].tolist()
    request = GenerationRequest(
        input_ids=ids,
        max_new_tokens=12,
        ignore_eos=True,
        sampling={"temperature": 0.9, "top_k": 50, "seed": 5},
        stop_token_ids=[3],
    )
    made = _run_on_engine(engine, {"plain": request}) | _run_on_engine(
        engine, {"packed": crossed(request)}
    )
    assert made["packed"] == made["plain"] and len(made["plain"]) > 0

    vocab = engine.model.config.vocab_size
    for bad in (vocab, 2**31, 2**64):
        wrong = GenerationRequest(input_ids=[*ids, bad], max_new_tokens=4)
        for form in (wrong, crossed(wrong)):
            with pytest.raises(InvalidRequest, match="outside the vocabulary"):
                engine.prepare("bad", form)
    assert engine.active_jobs == 0


def _run_burst(engine: Any, admit_in_wait: bool) -> dict[str, Any]:
    """12 jobs of 1,000-token prompts (slices of 8); b11 cancelled before its build, and
    b09's build made to fail. What each step started and ended, and what step 1 left."""
    from exlq.worker.engines.base import JobEnded, TokenChunk

    generator = engine.generator
    for job_id, request in _distinct_prompts(engine, 12, 1000, "b").items():
        engine.add(job_id, request)
    assert engine.active_jobs == 12 and generator.num_remaining_jobs() == 0  # none built
    assert engine.cancel("b11") == JobEnded("b11", "cancelled", 1000, 0)
    assert engine.active_jobs == 11

    build = engine._build

    def failing_build(accepted: Any) -> None:
        if accepted.job_id == "b09":
            raise RuntimeError("no pages")
        build(accepted)

    engine._build = failing_build
    # As the engine loop does with admit_in_wait: the step's wait for the GPU readies the
    # next step, and what that ends is the step's.
    in_wait: list[Any] = []
    if admit_in_wait:
        engine.set_wait_work(lambda: in_wait.extend(engine.prepare_next_step()))
    burst: dict[str, Any] = {"started_in": {}, "ended_in": {}, "tokens": {}}
    step = 0
    try:
        while engine.active_jobs:
            step += 1
            outputs = engine.step() + in_wait
            in_wait.clear()
            for output in outputs:
                if isinstance(output, TokenChunk):
                    burst["tokens"].setdefault(output.job_id, []).extend(output.token_ids)
                else:
                    burst["ended_in"][output.job_id] = (step, output)
            for job in generator.active_jobs:
                burst["started_in"].setdefault(job.identifier, step)
            if step == 1:
                burst["after_step_1"] = (
                    len(generator.pending_jobs),  # built, waiting to start
                    engine.active_jobs - generator.num_remaining_jobs(),  # not built
                )
    finally:
        del engine._build
        engine.set_wait_work(None)
    return burst


def test_a_burst_is_built_as_its_slices_start_in_order(engine: Any) -> None:
    """Jobs are checked on arrival and built only when a step could start them (one past
    the admission budget's slice); with admit_in_wait, the next slice is built in the
    step's wait for the GPU (prepare_next_step). A job cancelled before its build ends with
    no tokens; a build that fails ends its job alone, in the step that tried it; slices
    start in order; the tokens do not depend on where the jobs were built."""
    from exlq.worker.engines.base import JobEnded, JobErrored

    assert engine.admit_prompt_tokens == 8192  # the default: slices of 8 prompts of 1,000
    between = _run_burst(engine, admit_in_wait=False)
    in_wait = _run_burst(engine, admit_in_wait=True)

    # Step 1 built nine (9,000 waiting tokens > 8,192) and started eight. Between steps,
    # the other two wait for step 2; in the wait, step 1 built them (b09 failing there).
    assert between["after_step_1"] == (1, 2)
    assert in_wait["after_step_1"] == (2, 0)
    error = JobErrored("b09", "engine_error", "RuntimeError: no pages")
    assert between["ended_in"]["b09"] == (2, error)
    assert in_wait["ended_in"]["b09"] == (1, error)

    job_ids = [f"b{n:02d}" for n in range(11) if n != 9]
    for burst in (between, in_wait):
        assert sorted(burst["started_in"]) == job_ids
        order = [burst["started_in"][job_id] for job_id in job_ids]
        assert order == sorted(order) and order[8] > 1  # the second slice starts later
        ends = [burst["ended_in"][job_id][1] for job_id in job_ids]
        assert all(isinstance(e, JobEnded) and e.finish_reason == "length" for e in ends)
        assert all(isinstance(e, JobEnded) and e.completion_tokens == 4 for e in ends)
    assert in_wait["tokens"] == between["tokens"]
    assert in_wait["started_in"] == between["started_in"]


def _distinct_prompts(engine: Any, count: int, tokens: int, prefix: str = "o") -> dict[str, Any]:
    """Greedy requests of distinct prompts, so no job reuses another's cached pages, under
    the ids {prefix}00, {prefix}01, ..."""
    from exlq.protocol.models import GenerationRequest

    vocab = engine.model.config.vocab_size
    return {
        f"{prefix}{n:02d}": GenerationRequest(
            input_ids=[1 + (n * 7919 + i * 104_729) % (vocab - 1) for i in range(tokens)],
            max_new_tokens=4,
            ignore_eos=True,
            sampling={"temperature": 0},
        )
        for n in range(count)
    }


def _step_until_idle(engine: Any) -> tuple[dict[str, list[int]], dict[str, Any]]:
    from exlq.worker.engines.base import TokenChunk

    tokens: dict[str, list[int]] = {}
    ends: dict[str, Any] = {}
    while engine.active_jobs:
        for output in engine.step():
            if isinstance(output, TokenChunk):
                tokens.setdefault(output.job_id, []).extend(output.token_ids)
            else:
                ends[output.job_id] = output
    return tokens, ends


def test_jobs_built_ahead_of_their_start_run_as_jobs_added_after_it(engine: Any) -> None:
    """--offer-before-start: prepare() checks a job without queuing it; build_ahead() builds
    the ones the first step would start (the admission budget's slice, one past it); only
    admitted jobs run, with the same tokens as added ones, in order; a job that cannot be
    built ahead is built again by its step and fails there, alone."""
    from exlq.worker.engines.base import JobEnded, JobErrored

    requests = _distinct_prompts(engine, 12, 1000)
    added = {job_id: request for job_id, request in requests.items() if job_id != "o05"}
    for job_id, request in added.items():
        engine.add(job_id, request)
    tokens_added, _ = _step_until_idle(engine)

    generator = engine.generator
    new_job = engine._new_job

    def failing_new_job(checked: Any) -> Any:
        if checked.job_id == "o03":
            raise RuntimeError("no pages")
        return new_job(checked)

    engine._new_job = failing_new_job
    try:
        prepared = {job_id: engine.prepare(job_id, r) for job_id, r in requests.items()}
        assert engine.active_jobs == 0 and generator.num_remaining_jobs() == 0
        engine.build_ahead(list(prepared.values()))
        # 8 prompts of 1,000 hold 8,000 tokens, within 8,192: one more, and no further.
        built = [job_id for job_id, p in prepared.items() if p.job is not None]
        assert built == [f"o{n:02d}" for n in range(9) if n != 3]
        assert generator.num_remaining_jobs() == 0  # built, not queued
        serial = generator.job_serial
        # The start script refused o05: the engine never hears of it again.
        for job_id in added:
            engine.admit(job_id, prepared[job_id])
        tokens_ahead, ends = _step_until_idle(engine)
    finally:
        del engine._new_job
    assert ends["o03"] == JobErrored("o03", "engine_error", "RuntimeError: no pages")
    ran = [job_id for job_id in added if job_id != "o03"]
    assert all(isinstance(ends[j], JobEnded) and ends[j].completion_tokens == 4 for j in ran)
    assert "o05" not in ends and "o05" not in tokens_ahead
    assert tokens_ahead == {j: tokens_added[j] for j in ran}
    # Queued as enqueue() would: a serial each, in admission order.
    assert generator.job_serial == serial + len(ran)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0},  # greedy on the GPU
        {"temperature": 0.9, "top_k": 40, "seed": 3},  # drawn on the GPU
        {"temperature": 0.9, "top_p": 0.8, "seed": 3},  # exllamav2's CPU sampler
    ],
    ids=["greedy", "gpu-drawn", "cpu-sampled"],
)
def test_each_decode_step_runs_the_wait_work_once_and_the_tokens_stay(
    engine: Any, sampling: dict[str, Any]
) -> None:
    """The engine loop's report goes out in the decode step's wait for the GPU: the step
    runs that work once, whichever sampler its jobs take, and makes the same tokens."""
    from exlq.protocol.models import GenerationRequest

    def requests() -> dict[str, Any]:
        return {
            f"w{n}": GenerationRequest(
                prompt=f"Story {n}:", max_new_tokens=10, ignore_eos=True, sampling=sampling
            )
            for n in range(3)
        }

    without = _run_on_engine(engine, requests())
    calls = 0

    def work() -> None:
        nonlocal calls
        calls += 1

    replays = engine.graphs.replays
    engine.set_wait_work(work)
    try:
        with_work = _run_on_engine(engine, requests())
    finally:
        engine.set_wait_work(None)
    assert with_work == without
    decode_steps = engine.graphs.replays - replays
    assert decode_steps >= 10 and calls == decode_steps
