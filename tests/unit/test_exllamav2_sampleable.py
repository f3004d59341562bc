"""Which exllamav2 jobs a decode step samples on the GPU, and which of those it feeds to the
next step before the host reads their token (engines/exllamav2/sampleable.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from exlq.worker.engines.exllamav2.sampleable import gpu_sampleable, overlappable, row_settings
from exlq.worker.kernels.sampling import RowSettings


def _settings(**changes: Any) -> SimpleNamespace:
    """exllamav2 0.3.2's sampler settings with its defaults, greedy-ready."""
    fields: dict[str, Any] = {
        "temperature": 0.8,
        "top_k": 40,
        "min_p": 0.05,
        "cfg_scale": None,
        "token_repetition_penalty": 1.0,
        "token_frequency_penalty": 0.0,
        "token_presence_penalty": 0.0,
        "token_bias": None,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "mirostat": False,
        "post_sampling_hooks": [],
        "temperature_last": False,
        "smoothing_factor": 0.0,
        "skew": 0.0,
        "max_temp": 0.0,
        "min_temp": 0.0,
        "top_a": 0.0,
        "top_p": 1.0,
        "tfs": 0.0,
        "typical": 0.0,
    }
    return SimpleNamespace(**{**fields, **changes})


def _job(settings: SimpleNamespace | None = None, **changes: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {
        "gen_settings": settings or _settings(),
        "checkpoint": None,
        "new_tokens": 5,
        "min_new_tokens": 0,
        "filters": [],
        "sequences": [object()],
        "return_logits": False,
        "exlq_constraint": None,
        "banned_strings_utf32_offsets": None,
        "return_top_tokens": 0,
    }
    return SimpleNamespace(**{**fields, **changes})


def test_a_plain_sampled_job_samples_on_the_gpu_and_overlaps() -> None:
    job = _job()
    assert gpu_sampleable(job) and overlappable(job)


@pytest.mark.parametrize(
    "changes",
    [
        {"exlq_constraint": object()},  # its next mask depends on this token
        {"banned_strings_utf32_offsets": object()},  # a match takes tokens back
        {"return_top_tokens": 3},  # logprobs come from the step's logits, on the host
        {"min_new_tokens": 8},  # the stop tokens' block counts the tokens accepted
    ],
    ids=["grammar", "banned-strings", "logprobs", "min-new-tokens"],
)
def test_jobs_that_need_the_hosts_view_of_each_token_sample_on_the_gpu_but_do_not_overlap(
    changes: dict[str, Any],
) -> None:
    job = _job(**changes)
    assert not overlappable(job)
    if "min_new_tokens" not in changes:
        assert gpu_sampleable(job)


@pytest.mark.parametrize(
    "job",
    [
        _job(_settings(top_p=0.9)),
        _job(_settings(token_repetition_penalty=1.1)),
        _job(sequences=[object(), object()]),  # CFG
        _job(new_tokens=-1),  # token healing
        _job(checkpoint={"offset": 0}),  # a banned string's rewind blocks a token
        _job(filters=[object()]),
    ],
    ids=["top-p", "penalty", "cfg", "healing", "rewound", "filter"],
)
def test_jobs_exllamav2_samples_on_the_cpu_neither_sample_on_the_gpu_nor_overlap(job: Any) -> None:
    assert not gpu_sampleable(job) and not overlappable(job)


def test_a_steps_row_settings_are_its_jobs_in_order_each_drawing_once_from_its_own_generator() -> (
    None
):
    seeded = [random.Random(7), random.Random(8)]
    jobs = [
        _job(_settings(temperature=0.0, top_k=1, min_p=0.0), rng=random.Random(7)),
        _job(_settings(temperature=0.7, top_k=40, min_p=0.05), rng=random.Random(8)),
    ]
    rows = row_settings(jobs)
    assert rows == RowSettings(
        temperature=[0.0, 0.7],
        top_k=[1, 40],
        min_p=[0.0, 0.05],
        uniform=[seeded[0].random(), seeded[1].random()],
    )
    # One draw each: the next step draws each job's second number.
    assert row_settings(jobs).uniform == [seeded[0].random(), seeded[1].random()]


def test_the_device_sampler_takes_greedy_rows_to_their_argmax_and_draws_the_others() -> None:
    torch = pytest.importorskip("torch")
    from exlq.worker.kernels.sampling import sample_on_device

    # Two real tokens and a padding column the output layer adds, never drawn.
    logits = torch.tensor([[0.0, 3.0, 9.0], [5.0, 0.0, 9.0]])
    greedy = RowSettings(temperature=[0.0, 0.0], top_k=[0, 0], min_p=[0.0, 0.0], uniform=[0.5] * 2)
    tokens, probs = sample_on_device(logits, greedy, vocab_size=2)
    assert tokens.tolist() == [1, 0] and probs is None
    # Row 0 greedy; row 1 at temperature 1 with u near 1 draws its last real token, never
    # the padding, with that token's probability.
    mixed = RowSettings(
        temperature=[0.0, 1.0], top_k=[0, 0], min_p=[0.0, 0.0], uniform=[0.5, 0.999]
    )
    tokens, probs = sample_on_device(logits, mixed, vocab_size=2)
    assert tokens.tolist() == [1, 1]
    assert probs is not None
    assert probs[0].item() == 1.0
    assert probs[1].item() == pytest.approx(torch.softmax(torch.tensor([5.0, 0.0]), 0)[1].item())
