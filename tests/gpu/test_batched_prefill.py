"""Batched prefill gives what exllamav2's one-job-at-a-time prefill gives, in fewer passes."""

from __future__ import annotations

import inspect
import random
import re
from typing import Any

import pytest


def _prompts(vocab: int) -> list[list[int]]:
    """Ragged lengths (one page, several pages, one past max_chunk_size so it prefills in two
    iterations, a short one), an exact duplicate and a prompt that shares a page and a half
    with the first: the prefix cache's whole-page and partial-page paths."""
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    first = tokens(300)
    return [
        first,
        tokens(300),
        tokens(517),
        tokens(40),
        tokens(1000),
        tokens(2600),
        tokens(256),
        list(first),
        first[:290] + tokens(25),
    ]


def _first_logits(
    generator: Any, prompts: list[list[int]], started: list[list[int]] | None = None
) -> list[Any]:
    """Logits each job samples its first token from, all jobs enqueued at once. ``started``
    gets, for each iterate() that started jobs, their indices."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    generator.enqueue(
        [
            ExLlamaV2DynamicJob(
                input_ids=torch.tensor([ids]),
                max_new_tokens=2,
                stop_conditions=[],
                gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                return_logits=True,
                identifier=i,
            )
            for i, ids in enumerate(prompts)
        ]
    )
    first: dict[int, Any] = {}
    while generator.num_remaining_jobs():
        results = generator.iterate()
        now = [r["identifier"] for r in results if r.get("stage") == "started"]
        if started is not None and now:
            started.append(now)
        for result in results:
            if result.get("stage") == "streaming" and "logits" in result:
                first.setdefault(result["identifier"], result["logits"][0, 0].float().cpu())
    return [first[i] for i in range(len(prompts))]


def test_same_logits_as_one_job_at_a_time_in_fewer_passes(make_generator: Any) -> None:
    stock = make_generator(exlq=False, max_batch=16)
    prompts = _prompts(stock.tokenizer.get_vocab_size())
    want = _first_logits(stock, prompts)
    batched = make_generator(exlq=False, max_batch=16, prefill_batch_tokens=4096)
    batcher = batched.prefill_batcher
    assert batcher is not None and batcher.padding
    got = _first_logits(batched, prompts)
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    top1 = sum(int(g.argmax() == w.argmax()) for g, w in zip(got, want, strict=True))
    print(
        f"\nbatched prefill: {batcher.chunks} chunks in {batcher.passes} passes; first-token "
        f"logits max abs diff {worst:.4f}, top-1 agreement {top1}/{len(prompts)}"
    )
    assert worst < 0.05
    assert top1 >= len(prompts) - 1  # random weights: a near tie may flip one
    # Fewer passes than chunks, so rows were padded and batched; padding maps onto page 0,
    # which a job here owns, and its logits still agree.
    assert batcher.passes < batcher.chunks


def test_a_prompt_budget_starts_a_burst_in_slices_with_the_same_logits(
    make_generator: Any,
) -> None:
    stock = make_generator(exlq=False, max_batch=16)
    prompts = _prompts(stock.tokenizer.get_vocab_size())
    want = _first_logits(stock, prompts)
    paced = make_generator(
        exlq=False, max_batch=16, prefill_batch_tokens=4096, admit_prompt_tokens=1024
    )
    started: list[list[int]] = []
    got = _first_logits(paced, prompts, started)
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    top1 = sum(int(g.argmax() == w.argmax()) for g, w in zip(got, want, strict=True))
    print(f"\nstarted per step: {started}; max abs diff {worst:.4f}, top-1 {top1}/{len(prompts)}")
    assert worst < 0.05
    assert top1 >= len(prompts) - 1
    # In order, each step within the budget, or one job alone (the 1000 and 2600 prompts).
    assert [i for step in started for i in step] == list(range(len(prompts)))
    for step in started:
        assert len(step) == 1 or sum(len(prompts[i]) for i in step) <= 1024
    assert len(started) >= 4


def test_equal_lengths_share_one_pass(make_generator: Any) -> None:
    generator = make_generator(exlq=False, max_batch=16, prefill_batch_tokens=4096)
    rng = random.Random(3)
    vocab = generator.tokenizer.get_vocab_size()
    prompts = [[rng.randrange(1, vocab) for _ in range(256)] for _ in range(12)]
    _first_logits(generator, prompts)
    # 12 chunks of 255 tokens (the last prompt token is the first decode input): 3060 padded
    # tokens fit one pass of 4096.
    assert (generator.prefill_batcher.chunks, generator.prefill_batcher.passes) == (12, 1)


def test_exllamav2_still_prefills_the_way_the_batcher_relies_on(cuda: None) -> None:
    from exllamav2.generator import ExLlamaV2DynamicGenerator
    from exllamav2.generator.dynamic import ExLlamaV2DynamicJob

    from exlq.worker.engines.exllamav2.prefill import PREFILL_KWARGS

    source = inspect.getsource(ExLlamaV2DynamicJob.prefill)
    calls = re.findall(r"(\S*)\s*self\.generator\.model\.forward_chunk\((.*?)\n\s*\)", source, re.S)
    assert len(calls) == 1, "prefill no longer makes one forward_chunk call"
    before, arguments = calls[0]
    assert not before.endswith("="), "prefill now uses what forward_chunk returns"
    assert set(re.findall(r"(\w+)\s*=", arguments)) == PREFILL_KWARGS
    assert "copy_states(" in source  # the partial-page match, which flushes recorded passes
    # ExlqDynamicGenerator.iterate_start_jobs offers exllamav2's a slice of pending_jobs:
    # exllamav2 must read the waiting jobs from that list and take the ones it starts out.
    start = inspect.getsource(ExLlamaV2DynamicGenerator.iterate_start_jobs)
    assert "for job in self.pending_jobs.copy():" in start
    assert "self.pending_jobs.remove(job)" in start
    iterate = inspect.getsource(ExLlamaV2DynamicGenerator.iterate)
    steps = [
        "self.iterate_start_jobs(results)",
        "job.prefill(results)",
        "self.iterate_gen(results)",
    ]
    at = [iterate.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), "iterate() changed: ExlqDynamicGenerator copies it"


def _compiled_variants() -> int:
    from exlq.worker.kernels.paged_attention import _paged_attn_fwd

    caches = getattr(_paged_attn_fwd, "device_caches", None)
    if caches is None:
        pytest.fail("triton moved its kernel cache: update how this test counts variants")
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.parametrize(
    "lengths",
    [
        [1100, 700, 300, 200, 180, 40, 30, 21, 9, 6, 4, 3, 2],  # ragged: padded passes
        [256] * 8,  # one length: unpadded passes of several rows
        [40, 40, 1000, 1000, 1000],
    ],
    ids=["ragged", "equal-256", "equal-mixed"],
)
def test_warm_up_compiles_what_a_burst_needs(make_generator: Any, lengths: list[int]) -> None:
    generator = make_generator(exlq=False, max_batch=16, prefill_batch_tokens=4096)
    generator.warmup()
    seconds = generator.warm_up_prefill()
    compiled = _compiled_variants()
    rng = random.Random(5)
    vocab = generator.tokenizer.get_vocab_size()
    _first_logits(generator, [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths])
    print(f"\nprefill warm-up {seconds:.1f} s, {compiled} attention variants")
    if _compiled_variants() != compiled:
        from exlq.worker.kernels.paged_attention import _paged_attn_fwd

        keys = [key for entry in _paged_attn_fwd.device_caches.values() for key in entry[0]]
        pytest.fail(f"a burst compiled a kernel variant mid-service; variants now: {keys}")
