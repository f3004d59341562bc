"""JobRandom (worker/engines/exllamav2/job_rng.py): a job's generator seeded at its first
draw gives the draws random.Random(seed) gives, and is not seeded before."""

from __future__ import annotations

import random

import pytest

from exlq.worker.engines.exllamav2.job_rng import JobRandom


@pytest.mark.parametrize("seed", [0, 7, 2**63 - 1, 2**64 + 5])
def test_a_seeded_job_random_draws_what_random_random_draws(seed: int) -> None:
    lazy, stock = JobRandom(seed), random.Random(seed)
    assert not lazy.seeded
    assert [lazy.random() for _ in range(5)] == [stock.random() for _ in range(5)]
    assert lazy.seeded
    # Any other method of random.Random continues the same stream.
    assert lazy.generator.getrandbits(64) == stock.getrandbits(64)
    assert lazy.generator.randint(0, 10**9) == stock.randint(0, 10**9)


def test_unseeded_job_randoms_draw_apart_and_unknown_names_fail() -> None:
    first, second = JobRandom(), JobRandom()
    assert [first.random() for _ in range(4)] != [second.random() for _ in range(4)]
    with pytest.raises(AttributeError):
        first.no_such_method  # noqa: B018
    with pytest.raises(AttributeError):
        JobRandom(1)._private  # noqa: B018


def test_after_the_first_draw_the_draws_are_the_generators_own() -> None:
    # The per-token path: later draws call random.Random's method, with nothing between.
    lazy = JobRandom(3)
    lazy.random()
    assert lazy.random == lazy.generator.random
