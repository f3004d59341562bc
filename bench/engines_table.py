"""exllamav3's own generator, exlq on exllamav3 and exlq on exllamav2, on one GPU in one run,
each burst against its physical floor.

    python -m bench.engines_table --shapes 8b,1b --jobs 1,8,64,128 [--exl3 DIR]
        [--exl3-shape 8b --exl3-devices 0,1,2,3] [--out F]

For each model (a preset shape of bench.make_checkpoint, or a directory; --exl3 adds an
EXL3 directory, which exllamav2 cannot load; --exl3-shape converts a shape first, with
exllamav3's converter, and reports its time) and each count of jobs: one burst of that many
jobs at once (random prompts of --prompt tokens, --new tokens each, greedy, no stop), after a
warm-up burst of other prompts. exlq's systems run the full path (SDK -> Redis -> `exlq
worker` -> pub/sub -> SDK); exllamav3 alone runs its Generator in this process.

The floor of a burst is what the GPU cannot go below: the prompts' FLOPs at the GPU's bf16
matmul rate, plus --new decode steps, each reading every weight byte and the KV cache the
jobs hold, at the GPU's copy bandwidth; both rates are measured at the start of the run
(a large bf16 matmul; a device-to-device copy, bytes read plus written). A row's
``floor_ratio`` is floor / wall: 1.0 is the GPU's limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.baselines import random_prompt_ids, weight_bytes
from bench.exlq_path import ExlqPath
from bench.make_checkpoint import model_for
from bench.run import measure_bandwidth

SYSTEMS = {
    "own3": "exllamav3 alone",
    "exlq3": "exlq on exllamav3",
    "exlq2": "exlq on exllamav2",
}
CACHE_TOKENS = 65_536


def measure_matmul_flops() -> float:
    """bf16 matmul FLOP/s: an 8192^3 product, the median of 20 after 3 warm-ups."""
    import torch

    size = 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(23):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del a, b
    torch.cuda.empty_cache()
    return float(2 * size**3 / statistics.median(times[3:]))


def model_shape(model_dir: Path) -> dict[str, int]:
    config = json.loads((model_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {
        "hidden": hidden,
        "layers": int(config["num_hidden_layers"]),
        "kv_dim": int(config.get("num_key_value_heads", heads)) * head_dim,
        "mlp": int(config["intermediate_size"]),
        "vocab": int(config["vocab_size"]),
    }


def floor_s(
    model_dir: Path, jobs: int, prompt: int, new: int, flops: float, bandwidth: float
) -> float:
    """The burst's physical floor (module docstring). Matmul parameters: the attention and
    MLP projections and the output layer (the embedding is a lookup)."""
    s = model_shape(model_dir)
    h = s["hidden"]
    per_layer = 2 * h * h + 2 * h * s["kv_dim"] + 3 * h * s["mlp"]
    params = s["layers"] * per_layer + h * s["vocab"]
    prefill = 2 * params * jobs * prompt / flops
    kv_bytes_per_token = s["layers"] * 2 * s["kv_dim"] * 2  # K and V, fp16
    weights = weight_bytes(model_dir)
    decode = 0.0
    for step in range(new):
        held = jobs * (prompt + step) * kv_bytes_per_token
        decode += (weights + held) / bandwidth
    return prefill + decode


def own_exllamav3(
    model_dir: Path, counts: list[int], prompt: int, new: int
) -> Iterator[dict[str, Any]]:
    import torch
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer

    started = time.perf_counter()
    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=CACHE_TOKENS)
    model.load()
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model, cache, tokenizer, max_batch_size=max(counts))
    print(f"exllamav3 alone loaded in {time.perf_counter() - started:.1f} s", flush=True)

    def burst(prompts: list[list[int]]) -> dict[str, Any]:
        started = time.perf_counter()
        first: dict[int, float] = {}
        made = 0
        for n, ids in enumerate(prompts):
            job = Job(
                input_ids=torch.tensor([ids], dtype=torch.long),
                max_new_tokens=new,
                sampler=ArgmaxSampler(),
                identifier=n,
            )
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
            "wall_s": wall,
            "output_tokens_per_s": made / wall,
            "ttft_ms_p50": statistics.median(first.values()) * 1000,
        }

    try:
        for n in counts:
            burst(random_prompt_ids(model_dir, n, prompt, seed=1000))
            yield {"concurrency": n, **burst(random_prompt_ids(model_dir, n, prompt))}
    finally:
        generator.close()
        model.unload()
        torch.cuda.empty_cache()


def exlq(
    model_dir: Path, engine: str, counts: list[int], prompt: int, new: int
) -> Iterator[dict[str, Any]]:
    # Each engine at its defaults, with the same cache.
    options = {"cache_tokens": CACHE_TOKENS}
    with ExlqPath(model_dir, max_batch_size=max(counts), options=options, engine=engine) as path:
        print(f"exlq on {engine} loaded in {path.load_s:.1f} s", flush=True)
        for n in counts:
            row = path.run(
                random_prompt_ids(model_dir, n, prompt),
                random_prompt_ids(model_dir, n, prompt, seed=1000),
                new,
            )
            yield {
                "concurrency": n,
                "wall_s": row["wall_s"],
                "output_tokens_per_s": row["output_tokens_per_s"],
                "ttft_ms_p50": row["ttft_ms_p50"],
            }


def is_exl3(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method", "")
    return str(method).lower() == "exl3"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="8b,1b", help="preset shapes or model directories")
    ap.add_argument("--exl3", action="append", default=[], help="an EXL3 model directory")
    ap.add_argument(
        "--exl3-shape",
        default="",
        help="a preset shape to convert to EXL3 (bench.exl3, once) and measure too",
    )
    ap.add_argument("--exl3-bits", type=float, default=4.0)
    ap.add_argument("--exl3-devices", default="0", help="GPUs the conversion uses, e.g. 0,1,2,3")
    ap.add_argument("--models", default="/tmp/exlq-models")
    ap.add_argument("--jobs", default="1,8,64,128")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--systems", default="own3,exlq3,exlq2")
    ap.add_argument("--out", type=Path, default=None, help="rows as JSON lines")
    args = ap.parse_args(argv)

    import torch

    counts = [int(n) for n in args.jobs.split(",")]
    flops = measure_matmul_flops()
    bandwidth = measure_bandwidth()
    header = {
        "gpu": torch.cuda.get_device_name(),
        "matmul_tflops": round(flops / 1e12, 1),
        "copy_gb_s": round(bandwidth / 1e9, 1),
    }
    print(json.dumps(header), flush=True)
    out = args.out.open("a") if args.out else None
    if out:
        out.write(json.dumps(header) + "\n")
    models = [model_for(shape, Path(args.models)) for shape in args.shapes.split(",") if shape]
    models += [(Path(d), Path(d).name) for d in args.exl3]
    if args.exl3_shape:
        from bench.exl3 import exl3_checkpoint

        converted, seconds = exl3_checkpoint(
            Path(args.models), args.exl3_shape, args.exl3_bits, args.exl3_devices
        )
        note = {"exl3": str(converted), "conversion_s": round(seconds, 1)}
        note["devices"] = args.exl3_devices
        print(json.dumps(note), flush=True)
        if out:
            out.write(json.dumps(note) + "\n")
        models.append((converted, converted.name))
    for model_dir, shape in models:
        for system in args.systems.split(","):
            if system == "exlq2" and is_exl3(model_dir):
                continue  # exllamav2 cannot load EXL3
            runs = (
                own_exllamav3(model_dir, counts, args.prompt, args.new)
                if system == "own3"
                else exlq(
                    model_dir,
                    "exllamav3" if system == "exlq3" else "exllamav2",
                    counts,
                    args.prompt,
                    args.new,
                )
            )
            try:
                for row in runs:
                    floor = floor_s(
                        model_dir, row["concurrency"], args.prompt, args.new, flops, bandwidth
                    )
                    row = {
                        "shape": shape,
                        "system": SYSTEMS[system],
                        **{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                        "floor_s": round(floor, 4),
                        "floor_ratio": round(floor / row["wall_s"], 3),
                    }
                    print(json.dumps(row), flush=True)
                    if out:
                        out.write(json.dumps(row) + "\n")
                        out.flush()
            except Exception as exc:  # one system failing must not lose the others' rows
                print(json.dumps({"shape": shape, "system": system, "error": repr(exc)}))


if __name__ == "__main__":
    main()
