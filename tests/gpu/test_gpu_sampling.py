"""GPU sampling draws from exllamav2's distribution; the generator's output stays the same."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from tests.gpu.greedy import seeded_tokens

VOCAB = 32000
PADDED = 32032  # the output layer's padding: never drawn


class _Tokenizer:
    """What ExLlamaV2Sampler.sample asks of a tokenizer for these settings."""

    def get_vocab_size(self) -> int:
        return VOCAB


def _exllamav2_distribution(row: Any, temperature: float, top_k: int, min_p: float) -> Any:
    """(token ids, probabilities) exllamav2's CPU sampler keeps, most probable first."""
    import torch
    from exllamav2.generator import ExLlamaV2Sampler

    settings = ExLlamaV2Sampler.Settings(
        temperature=temperature,
        top_k=top_k,
        top_p=1.0,
        min_p=min_p,
        token_repetition_penalty=1.0,
    )
    _, ids, probs, _, _ = ExLlamaV2Sampler.sample(
        row.float().cpu().view(1, 1, -1).clone(),
        settings,
        torch.zeros((1, 1), dtype=torch.long),
        0.5,
        _Tokenizer(),
        return_top_tokens=256,
    )
    keep = probs[0, 0] > 0
    return ids[0, 0][keep], probs[0, 0][keep]


@pytest.mark.parametrize(
    ("temperature", "top_k", "min_p"),
    [(1.0, 0, 0.0), (0.7, 0, 0.0), (1.3, 40, 0.0), (1.0, 0, 0.1), (0.8, 50, 0.05), (2.0, 7, 0.0)],
)
def test_distribution_matches_exllamav2s_sampler(
    cuda: None, temperature: float, top_k: int, min_p: float
) -> None:
    import torch

    from exlq.worker.kernels.sampling import sampling_probs

    gen = torch.Generator().manual_seed(int(temperature * 100) + top_k)
    logits = (torch.randn((8, PADDED), generator=gen) * 4).half().cuda()
    rows = logits.shape[0]
    probs = sampling_probs(
        logits,
        torch.full((rows,), temperature, device="cuda"),
        torch.full((rows,), top_k, dtype=torch.long, device="cuda"),
        torch.full((rows,), min_p, device="cuda"),
        VOCAB,
        top_k if 1 < top_k < VOCAB else 0,
    ).cpu()
    assert torch.all(probs[:, VOCAB:] == 0)
    assert torch.allclose(probs.sum(-1), torch.ones(rows), atol=1e-5)
    for r in range(rows):
        ids, want = _exllamav2_distribution(logits[r], temperature, top_k, min_p)
        # fp16 logits tie often; among tied tokens either sampler may keep another one, so
        # compare the kept probabilities, most probable first, and then the tokens untied.
        got = probs[r].sort(descending=True).values[: len(want)]
        assert torch.allclose(got, want, atol=2e-6, rtol=1e-4), (got - want).abs().max()
        kept = int((probs[r] > 0).sum())
        if kept <= 256:  # exllamav2 returned its whole candidate set: ours must be as large
            assert kept == len(ids)
        row = logits[r].float().cpu()
        untied = torch.tensor([bool((row == row[i]).sum() == 1) for i in ids.tolist()])
        assert bool((probs[r][ids[untied]] > 0).all())


def test_draw_is_the_inverse_cdf_and_greedy_takes_the_first_largest_logit(cuda: None) -> None:
    import torch

    from exlq.worker.kernels.sampling import draw

    logits = torch.tensor([[0.0, 2.0, -1.0, 2.0, 1.0, -30.0, 0.5, 0.1]], device="cuda")
    probs = torch.softmax(logits, -1)
    n = 20000
    uniform = (torch.arange(n, device="cuda") + 0.5) / n
    tokens, chosen = draw(
        logits.expand(n, -1), probs.expand(n, -1), torch.zeros(n, dtype=torch.bool, device="cuda"),
        uniform,
    )  # fmt: skip
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert torch.allclose(freq, probs[0], atol=2 / n)
    assert torch.allclose(chosen, probs[0][tokens])
    tokens, chosen = draw(
        logits, probs, torch.ones(1, dtype=torch.bool, device="cuda"), uniform[:1]
    )
    assert tokens.tolist() == [1] and chosen.tolist() == [1.0]  # ties: the first index


def _run(generator: Any, settings: list[Any]) -> list[list[int]]:
    return seeded_tokens(generator, settings)[0]


def test_generator_output_is_unchanged_for_greedy_and_repeatable_when_seeded(
    make_generator: Any,
) -> None:
    from exllamav2.generator import ExLlamaV2Sampler

    greedy = [ExLlamaV2Sampler.Settings.greedy() for _ in range(4)]
    want = _run(make_generator(exlq=False), greedy)
    exlq = make_generator(exlq=True)
    assert _run(exlq, greedy) == want
    assert exlq.gpu_sampled > 0 and exlq.cpu_sampled == 0
    sampled = [
        ExLlamaV2Sampler.Settings(
            temperature=0.9, top_k=k, top_p=p, min_p=m, token_repetition_penalty=1.0
        )
        for k, p, m in [(0, 1.0, 0.0), (40, 1.0, 0.05), (0, 0.9, 0.0), (0, 1.0, 0.0)]
    ]
    first = _run(exlq, sampled)
    assert exlq.cpu_sampled > 0  # top_p 0.9 goes to exllamav2's own sampler, same batch
    assert _run(exlq, sampled) == first  # seeded jobs repeat themselves
    assert all(len(t) == 24 + 3 * i for i, t in enumerate(first))
    assert first[0] != want[0]  # temperature 0.9 does sample
    print(f"\nGPU-sampled steps {exlq.gpu_sampled}, CPU-sampled steps {exlq.cpu_sampled}")


def test_a_burst_of_new_jobs_starts_decoding_without_a_gpu_sync_per_job(
    make_generator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """exllamav2 stamps each job's first decode step after cuda_sync_active(): a GPU sync and
    a torch.cuda.memory_stats() read per job, all in the step after a burst's prefill. The
    decode step exlq runs stamps them all without either."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    generator = make_generator(exlq=True, max_batch=16)
    rng = torch.Generator().manual_seed(5)
    jobs = [
        ExLlamaV2DynamicJob(
            input_ids=torch.randint(3, 32000, (1, 40 + 9 * i), generator=rng),
            max_new_tokens=4,
            stop_conditions=[],
            gen_settings=ExLlamaV2Sampler.Settings.greedy(),
            identifier=i,
        )
        for i in range(12)
    ]
    # cuda_sync_active() reads torch.cuda.memory_allocated(), so memory_stats(), before it
    # syncs: a memory_stats() call per job is its mark. Plain synchronize() calls are not
    # counted: this unwarmed, unbatched prefill path makes some (51 for these 12 jobs).
    exllamav2_dynamic = importlib.import_module("exllamav2.generator.dynamic")
    calls: list[str] = []
    memory_stats = torch.cuda.memory.memory_stats

    def counted_stats(*args: Any, **kwargs: Any) -> Any:
        calls.append("memory_stats")
        return memory_stats(*args, **kwargs)

    monkeypatch.setattr(torch.cuda.memory, "memory_stats", counted_stats)
    monkeypatch.setattr(exllamav2_dynamic, "cuda_sync_active", lambda: calls.append("sync"))
    generator.enqueue(jobs)
    while any(job.time_first_token is None for job in jobs):
        generator.iterate()
    assert calls == []
    stamps = {job.time_first_token for job in jobs}
    while generator.num_remaining_jobs():
        generator.iterate()
    assert all(job.new_tokens == 4 for job in jobs)
    print(f"\n12 jobs entered decode in {len(stamps)} step(s), no cuda_sync_active()")


def test_exllamav2_still_has_what_the_generator_override_uses(cuda: None) -> None:
    from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob

    receive = inspect.signature(ExLlamaV2DynamicJob.receive_sample).parameters
    assert list(receive)[1:] == [
        "logits",
        "next_token",
        "next_k_tokens",
        "next_k_probs",
        "next_prob",
        "filter_eos",
        "results",
        "first_sample_in_sd_batch",
    ]
    source = inspect.getsource(ExLlamaV2DynamicGenerator.iterate_gen)
    for name in ("logits_pinned", "filter_queue", "defrag_cache", "deallocate_pages"):
        assert name in source, name
    fields = inspect.signature(ExLlamaV2DynamicJob.__init__).parameters
    assert {"seed", "min_new_tokens", "return_top_tokens", "return_logits"} <= fields.keys()
    iterate = inspect.getsource(ExLlamaV2DynamicGenerator.iterate)
    assert "self.iterate_gen(results)" in iterate
