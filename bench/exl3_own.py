"""exllamav3's own generator alone, on a model directory: the baseline an exllamav3 engine
is measured against (GPU; the random checkpoints of bench/make_checkpoint.py).

    python -m bench.exl3_own --shape 1b --jobs 1,8,64 [--out exl3.json]

For each count of jobs it enqueues that many jobs at once (random prompts of --prompt
tokens, --new tokens each, greedy, no stop condition), iterates the generator until all
end, and prints tokens/s (new tokens of every job over the burst's wall time) and the
median time to first token. Each count runs twice; the first warms the kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.make_checkpoint import model_for


def burst(generator: Any, tokenizer_vocab: int, jobs: int, prompt: int, new: int) -> dict[str, Any]:
    import torch
    from exllamav3 import ArgmaxSampler, Job

    started = time.perf_counter()
    first: dict[int, float] = {}
    made = 0
    for n in range(jobs):
        ids = torch.randint(10, tokenizer_vocab - 10, (1, prompt))
        job = Job(input_ids=ids, max_new_tokens=new, sampler=ArgmaxSampler(), identifier=n)
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            ident = result.get("identifier")
            if "token_ids" in result and ident not in first:
                first[ident] = time.perf_counter() - started
            if result.get("eos"):
                made += int(result.get("new_tokens", 0))
    wall = time.perf_counter() - started
    return {
        "jobs": jobs,
        "tokens_per_s": round(made / wall, 1),
        "new_tokens": made,
        "wall_s": round(wall, 3),
        "ttft_p50_ms": round(statistics.median(first.values()) * 1000, 1) if first else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--models", type=Path, default=Path("/tmp/models"))
    parser.add_argument("--jobs", default="1,8,64")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--cache-tokens", type=int, default=65_536)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from exllamav3 import Cache, Config, Generator, Model, Tokenizer

    directory, _ = model_for(args.shape, args.models)
    loaded = time.perf_counter()
    config = Config.from_directory(str(directory))
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=args.cache_tokens)
    model.load()
    tokenizer = Tokenizer.from_config(config)
    counts = [int(n) for n in args.jobs.split(",")]
    generator = Generator(model, cache, tokenizer, max_batch_size=max(counts))
    rows: list[dict[str, Any]] = [{"loaded_s": round(time.perf_counter() - loaded, 1)}]
    print(json.dumps(rows[0]), flush=True)
    vocab = int(config.vocab_size)
    for jobs in counts:
        for run in (1, 2):
            row = {
                "shape": args.shape,
                "run": run,
                **burst(generator, vocab, jobs, args.prompt, args.new),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
