"""A job's generator seeded at its first draw (worker/engines/exllamav2/job_rng.py):
exllamav2 0.3.2 reads ``random`` where the hook replaces it and for nothing else, a job
made after the hook holds an unseeded JobRandom, and seeded sampled jobs make the same
tokens with it as with exllamav2's own generators."""

from __future__ import annotations

import inspect
import random
import re
from typing import Any

import pytest

from tests.gpu.greedy import seeded_tokens


def test_exllamav2_uses_random_only_for_the_jobs_generator(cuda: None) -> None:
    """Fails loudly if exllamav2 0.3.2's dynamic module reads anything but ``Random`` from
    the module ``random``, or its job constructor makes its generator otherwise."""
    import exllamav2.generator.dynamic as dynamic
    from exllamav2.generator import ExLlamaV2DynamicJob

    module = inspect.getsource(dynamic)
    assert set(re.findall(r"(?<![\w.])random\.(\w+)", module)) == {"Random"}
    assert len(re.findall(r"(?<![\w.])random\.Random\(", module)) == 2
    constructor = inspect.getsource(ExLlamaV2DynamicJob.__init__)
    assert "self.rng = random.Random() if seed is None else random.Random(seed)" in constructor
    assert constructor.count("random.Random(") == 2


def _sampled_tokens(generator: Any) -> tuple[list[list[int]], list[Any]]:
    """Seeded jobs that sample (on the GPU, and one on exllamav2's CPU path: top_p), and
    a greedy one; their tokens and jobs."""
    from exllamav2.generator import ExLlamaV2Sampler

    settings = [
        ExLlamaV2Sampler.Settings(temperature=0.9, top_k=0, token_repetition_penalty=1.0),
        ExLlamaV2Sampler.Settings(temperature=1.0, top_k=40, token_repetition_penalty=1.0),
        ExLlamaV2Sampler.Settings(temperature=0.9, top_p=0.9, token_repetition_penalty=1.0),
        ExLlamaV2Sampler.Settings.greedy(),
    ]
    return seeded_tokens(generator, settings)


def test_seeded_jobs_make_the_same_tokens_with_generators_seeded_at_the_first_draw(
    make_generator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import exllamav2.generator.dynamic as dynamic
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob

    from exlq.worker.engines.exllamav2.job_rng import JobRandom

    generator = make_generator(exlq=True)
    made = ExLlamaV2DynamicJob(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=1, seed=3)
    assert isinstance(made.rng, JobRandom), "exlq's generator installs the hook"
    assert not made.rng.seeded  # a job's build seeds nothing
    lazy, jobs = _sampled_tokens(generator)
    assert all(isinstance(job.rng, JobRandom) and job.rng.seeded for job in jobs)
    assert generator.gpu_sampled > 0 and generator.cpu_sampled > 0
    monkeypatch.setattr(dynamic, "random", random)
    generator.reset_page_table()
    stock, jobs = _sampled_tokens(generator)
    assert all(type(job.rng) is random.Random for job in jobs)
    assert all(len(t) == 24 + 3 * i for i, t in enumerate(stock))
    assert lazy == stock
    print(f"\n{len(stock)} jobs' tokens identical with generators seeded at the first draw")
