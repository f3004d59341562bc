"""What building one exllamav2 job costs in exlq's engine: ``add()`` (checks and encoding)
and ``_build()`` (exllamav2's job and its enqueue), per job, then a profile of the builds.

    python -m bench.job_build --shape 1b --jobs 128 --rounds 5

A job is built on the engine thread, before the step that starts it or inside the GPU wait
of the step before (--admit-in-wait), so its cost bounds how fast a burst's first slice
can start. Needs the GPU machine (the engine loads the model).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
from pathlib import Path
from time import perf_counter
from typing import Any

from bench.make_checkpoint import model_for


def _requests(rng: random.Random, jobs: int, prompt_tokens: int, vocab: int) -> list[Any]:
    from exlq.protocol.models import GenerationRequest, Sampling

    return [
        GenerationRequest(
            input_ids=[rng.randrange(1, vocab) for _ in range(prompt_tokens)],
            max_new_tokens=128,
            ignore_eos=True,
            sampling=Sampling(temperature=0.0),
        )
        for _ in range(jobs)
    ]


def _round(
    engine: Any, requests: list[Any], profile: cProfile.Profile | None
) -> tuple[float, float]:
    """µs a job in add() and in _build(); the engine is emptied after."""
    begin = perf_counter()
    for n, request in enumerate(requests):
        engine.add(f"job-{n}", request)
    added = perf_counter()
    accepted = list(engine._unbuilt.take(0, 0))  # every job, whatever the budget
    if profile is not None:
        profile.enable()
    start = perf_counter()
    for item in accepted:
        engine._build(item)
    built = perf_counter()
    if profile is not None:
        profile.disable()
    engine.abort_all()
    jobs = len(requests)
    return (added - begin) / jobs * 1e6, (built - start) / jobs * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--jobs", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("--cache-tokens", type=int, default=65536)
    ap.add_argument("--models", default="/tmp/exlq-models")
    args = ap.parse_args()

    from exlq.worker.engines.exllamav2.engine import load_exllamav2_engine
    from exlq.worker.settings import WorkerSettings

    model, _ = model_for(args.shape, Path(args.models))
    engine = load_exllamav2_engine(
        WorkerSettings(
            model=model,
            max_batch_size=args.jobs,
            cache_tokens=args.cache_tokens,
            attention="exlq",
        )
    )
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    for n in range(args.rounds):
        requests = _requests(rng, args.jobs, args.prompt_tokens, vocab)
        add_us, build_us = _round(engine, requests, None)
        print(f"round {n}: add {add_us:.1f} µs a job, build {build_us:.1f} µs a job")
    profile = cProfile.Profile()
    _round(engine, _requests(rng, args.jobs, args.prompt_tokens, vocab), profile)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(20)
    print(out.getvalue())
    engine.close()


if __name__ == "__main__":
    main()
