"""A job's random generator seeded at its first draw, not when the job is made.

exllamav2 0.3.2's ExLlamaV2DynamicJob constructor gives every job ``random.Random(seed)``
(``random.Random()`` without a seed). Seeding a Mersenne Twister is a noticeable part of a
job's check and build, and the build is on the way to a burst's first token: the engine
builds a burst's jobs one after another before their first step. The job draws from its
generator once a step, to sample its next token; exlq's GPU sampling draws while the GPU
runs the step's forward pass, so a generator first drawn from there is seeded in the GPU's
shadow (docs/PERFORMANCE.md, "On the GPU (exllamav2 engine options)").

JobRandom holds the seed and makes the ``random.Random`` on the first draw: the same
stream of draws, seeded later. install_job_rng() puts it in the place of the module
``random`` that exllamav2.generator.dynamic reads ``Random`` from, whose only use there is
the job's generator. The change is process-wide, like the other hooks, and pinned to
exllamav2 0.3.2: tests/gpu/test_job_rng_on_gpu.py fails if the dynamic module uses ``random``
for anything else.
"""

from __future__ import annotations

import importlib
import random
from types import SimpleNamespace
from typing import Any

from exlq.worker.engines.exllamav2.attention import on_pinned_exllamav2


class JobRandom:
    """``random.Random(seed)``, made at the first draw: the same draws as it. Without a
    seed it is seeded from the system's randomness then, as ``random.Random()`` is. It has
    the one method exllamav2's job calls, ``random()``; ``generator`` is the seeded
    ``random.Random`` itself."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generator: random.Random | None = None

    @property
    def seeded(self) -> bool:
        return self._generator is not None

    @property
    def generator(self) -> random.Random:
        if self._generator is None:
            self._generator = random.Random(self._seed)
            # The job draws once a token: from now on ``random`` is the generator's own
            # bound method, found in the instance before the class's, so a draw on the
            # per-token path costs what one from exllamav2's own generator does.
            self.random = self._generator.random  # type: ignore[method-assign]
        return self._generator

    def random(self) -> float:
        """The first draw: seeds the generator, then draws from it."""
        return self.generator.random()


# What exllamav2.generator.dynamic finds under its name ``random`` once installed.
_RANDOM_FOR_JOBS = SimpleNamespace(Random=JobRandom)


def install_job_rng() -> bool:
    """Jobs made from now on seed their generator at its first draw; False (and exllamav2's
    own generators) where another exllamav2 than the pinned one is installed."""
    dynamic: Any = importlib.import_module("exllamav2.generator.dynamic")
    if dynamic.random is _RANDOM_FOR_JOBS:
        return True
    if not on_pinned_exllamav2("job generators seeded as exllamav2 seeds them"):
        return False
    dynamic.random = _RANDOM_FOR_JOBS
    return True
