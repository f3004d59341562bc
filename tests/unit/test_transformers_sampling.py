"""The transformers engine's sampler on small, known distributions (needs torch)."""

from __future__ import annotations

import math

import pytest

from exlq.protocol.models import Sampling

torch = pytest.importorskip("torch")

from exlq.worker.engines.transformers.sampling import (  # noqa: E402 - torch first
    JobSampler,
    filtered,
    top_logprobs,
)

# Probabilities 0.4, 0.3, 0.2, 0.1 (and two tokens of nearly none).
PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])


def kept(**sampling: float) -> list[int]:
    """The tokens a filter leaves possible."""
    out = filtered(PROBS, Sampling(**sampling))  # type: ignore[arg-type]
    return [i for i, p in enumerate(out.tolist()) if p > 0]


def sampler(prompt: tuple[int, ...] = (), **sampling: float | int | None) -> JobSampler:
    return JobSampler(Sampling(**sampling), 1234, prompt, 6, "cpu")  # type: ignore[arg-type]


def test_top_k_keeps_the_k_likeliest() -> None:
    assert kept(top_k=2) == [0, 1]


def test_top_p_keeps_the_fewest_that_hold_the_mass() -> None:
    assert kept(top_p=0.7) == [0, 1]
    assert kept(top_p=0.71) == [0, 1, 2]
    assert kept(top_p=0.1) == [0]


def test_min_p_drops_tokens_below_a_share_of_the_likeliest() -> None:
    assert kept(min_p=0.5) == [0, 1, 2]


def test_typical_keeps_the_tokens_nearest_the_entropy() -> None:
    # Entropy 1.28 nats; surprises 0.92, 1.20, 1.61, 2.30: nearest it come 0.3, then 0.2.
    assert kept(typical=0.5) == [1, 2]
    assert kept(typical=0.2) == [1]


def test_filters_read_what_the_one_before_left() -> None:
    # After top_k=3 the mass is 0.44/0.33/0.22: the first two hold 0.78, enough for 0.75.
    assert kept(top_k=3, top_p=0.75) == [0, 1]
    assert kept(top_p=0.75) == [0, 1, 2]


def test_greedy_takes_the_argmax() -> None:
    logits = torch.log(PROBS + 1e-9)
    job = sampler(temperature=0.0)
    assert job.plain_greedy
    assert job.choose(logits) == 0


def test_a_seeded_sampler_repeats_its_draws_and_another_seed_differs() -> None:
    logits = torch.zeros(6)

    def draws(seed: int) -> list[int]:
        job = JobSampler(Sampling(seed=seed), seed, (), 6, "cpu")
        return [job.choose(logits) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert set(draws(7)) == set(range(6))  # every token possible at temperature 1


def test_repetition_penalty_turns_greedy_from_a_seen_token() -> None:
    logits = torch.tensor([2.0, 1.9, 0.0, 0.0, 0.0, 0.0])
    assert sampler(temperature=0.0).choose(logits) == 0
    job = sampler((0,), temperature=0.0, repetition_penalty=1.2)
    assert not job.plain_greedy
    assert job.choose(logits) == 1  # 2.0 / 1.2 < 1.9


def test_frequency_and_presence_penalties_count_completion_tokens() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    job = sampler((1,), temperature=0.0, frequency_penalty=0.4)
    job.chose(0)
    job.chose(0)
    assert job.choose(logits) == 0  # 2.0 - 2 * 0.4 = 1.2, still above 1.0
    job.chose(0)
    assert job.choose(logits) == 1  # 0.8: the prompt's token 1 is not counted
    present = sampler(temperature=0.0, presence_penalty=1.5)
    present.chose(0)
    assert present.choose(logits) == 1


def test_top_logprobs_are_the_models_own_and_name_the_chosen_token() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125, 1e-6, 1e-6]))
    pairs = top_logprobs(logits, chosen=4, count=2)
    assert [token for token, _ in pairs] == [0, 1, 4]
    assert pairs[0][1] == pytest.approx(math.log(0.5), abs=1e-4)
    assert top_logprobs(logits, chosen=1, count=2)[1][0] == 1
