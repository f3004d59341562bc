"""Time the Triton paged attention against torch SDPA on Llama 1B / 8B attention shapes."""

# Run on the GPU machine:  python bench/attention_bench.py --out results.json
# Per configuration it reports, for exllamav2's hot calls (decode: q_len=1 with append; prefill:
# a 256-token chunk from an empty cache and onto a cached context):
#   * device time, median ms of triton.testing.do_bench, ours and SDPA on dense (B, H, S, D) K/V;
#   * host time per call: perf_counter around many calls with no sync in between (then one),
#     which is what exllamav2 pays once per layer per step;
#   * max abs difference between our output and SDPA's on the same keys/values.

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAGE_SIZE = 256
SHAPES = {"llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128)}  # q heads, kv heads, head dim
BATCHES = (1, 8, 32, 64, 128)
CONTEXTS = (256 + 128, 2048)
PREFILL_CHUNK = 256
HOST_CALLS = 200


@dataclass
class Row:
    kind: str  # decode | prefill_empty | prefill_chunked
    shape: str
    batch: int
    context: int  # keys each query row attends to at the end of the call
    ours_ms: float
    sdpa_ms: float
    ratio: float  # ours / sdpa
    num_splits: int  # split-K count the heuristic picked (1 = a single launch)
    ours_nosplit_ms: float  # ours forced to num_splits=1, to tune the heuristic
    ours_host_us: float
    ours_wall_us: float
    sdpa_host_us: float
    max_abs_diff: float


@dataclass
class Setup:
    q: Any  # (B, q_len, H, D)
    k_new: Any  # (B, q_len, KV, D)
    v_new: Any
    k_pool: Any  # (pages, PAGE_SIZE, KV, D)
    v_pool: Any
    seqlens: Any  # (B,) int32, tokens cached before the call
    table: Any  # (B, pages per sequence) int32
    k_dense: Any  # (B, KV, context, D): what the cache holds after the append
    v_dense: Any


def _setup(torch: Any, shape: str, batch: int, context: int, q_len: int) -> Setup:
    n_heads, n_kv, head_dim = SHAPES[shape]
    dev, dt = "cuda", torch.float16
    gen = torch.Generator(device=dev).manual_seed(batch * 7919 + context)
    k_full = torch.randn((batch, context, n_kv, head_dim), device=dev, generator=gen).to(dt)
    v_full = torch.randn((batch, context, n_kv, head_dim), device=dev, generator=gen).to(dt)
    pages_per_seq = math.ceil(context / PAGE_SIZE)
    n_pages = batch * pages_per_seq + 1
    # Shuffled pages, as the generator's page pool ends up after a while.
    perm = torch.randperm(n_pages, device=dev, generator=gen)[: batch * pages_per_seq]
    table = perm.view(batch, pages_per_seq).to(torch.int32)
    k_pool = torch.zeros((n_pages, PAGE_SIZE, n_kv, head_dim), device=dev, dtype=dt)
    v_pool = torch.zeros_like(k_pool)
    cached = context - q_len
    pos = torch.arange(cached, device=dev)
    pages = table[:, pos // PAGE_SIZE].long()  # (B, cached)
    k_pool[pages, (pos % PAGE_SIZE)[None, :]] = k_full[:, :cached]
    v_pool[pages, (pos % PAGE_SIZE)[None, :]] = v_full[:, :cached]
    return Setup(
        q=torch.randn((batch, q_len, n_heads, head_dim), device=dev, generator=gen).to(dt),
        k_new=k_full[:, cached:].contiguous(),
        v_new=v_full[:, cached:].contiguous(),
        k_pool=k_pool,
        v_pool=v_pool,
        seqlens=torch.full((batch,), cached, device=dev, dtype=torch.int32),
        table=table,
        k_dense=k_full.transpose(1, 2).contiguous(),
        v_dense=v_full.transpose(1, 2).contiguous(),
    )


def _ours(s: Setup, num_splits: int = 0) -> Callable[[], Any]:
    from exlq.worker.kernels.paged_attention import flash_attn_with_kvcache

    scale = s.q.shape[-1] ** -0.5

    def call() -> Any:
        # Same keywords exllamav2's forward_paged passes (num_splits=0 is flash-attn's default).
        return flash_attn_with_kvcache(
            q=s.q, k=s.k_new, v=s.v_new, k_cache=s.k_pool, v_cache=s.v_pool,
            cache_seqlens=s.seqlens, block_table=s.table, causal=True, softmax_scale=scale,
            num_splits=num_splits,
        )  # fmt: skip

    return call


def _sdpa(torch: Any, s: Setup) -> Callable[[], Any]:
    func = torch.nn.functional.scaled_dot_product_attention
    q = s.q.transpose(1, 2).contiguous()  # (B, H, q_len, D)
    q_len, context = q.shape[2], s.k_dense.shape[2]
    if q_len == 1:
        kwargs: dict[str, Any] = {}
    elif q_len == context:
        kwargs = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        kwargs = {"attn_mask": causal_lower_right(q_len, context)}
    k, v = s.k_dense, s.v_dense
    try:
        func(q, k, v, enable_gqa=True, **kwargs)
        kwargs["enable_gqa"] = True
    except (RuntimeError, TypeError):
        # Older paths or bias objects without GQA support: expand kv heads once, outside timing.
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def call() -> Any:
        return func(q, k, v, **kwargs).transpose(1, 2)

    return call


def _host_us(torch: Any, fn: Callable[[], Any]) -> tuple[float, float]:
    """(host enqueue us per call, wall us per call incl. draining the GPU)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / HOST_CALLS * 1e6, (t2 - t0) / HOST_CALLS * 1e6


def _splits(s: Setup) -> int:
    from exlq.worker.kernels import paged_attention as pa

    batch, q_len, n_heads, head_dim = s.q.shape
    n_kv = s.k_pool.shape[2]
    dev = s.q.device
    plan = pa._plan(
        q_len, n_heads // n_kv, head_dim, batch, n_kv, s.table.shape[1] * PAGE_SIZE,
        pa._sm_count(dev.type, dev.index), 0,
    )  # fmt: skip
    return plan.num_splits


def _measure(torch: Any, kind: str, shape: str, batch: int, context: int, q_len: int) -> Row:
    from triton.testing import do_bench

    s = _setup(torch, shape, batch, context, q_len)
    ours, sdpa = _ours(s), _sdpa(torch, s)
    diff = float((ours().float() - sdpa().float()).abs().max())
    ours_ms = float(do_bench(ours, warmup=25, rep=200, return_mode="median"))
    sdpa_ms = float(do_bench(sdpa, warmup=25, rep=200, return_mode="median"))
    nosplit_ms = float(do_bench(_ours(s, 1), warmup=25, rep=200, return_mode="median"))
    ours_host, ours_wall = _host_us(torch, ours)
    sdpa_host, _ = _host_us(torch, sdpa)
    row = Row(
        kind, shape, batch, context, ours_ms, sdpa_ms, ours_ms / sdpa_ms, _splits(s),
        nosplit_ms, ours_host, ours_wall, sdpa_host, diff,
    )  # fmt: skip
    del s
    torch.cuda.empty_cache()
    return row


def _table(rows: list[Row]) -> str:
    head = (
        "| kind | shape | batch | ctx | ours ms | SDPA ms | ours/SDPA | splits | ours 1-split ms "
        "| ours host us | ours wall us | SDPA host us | max abs diff |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r.kind} | {r.shape} | {r.batch} | {r.context} | {r.ours_ms:.4f} "
            f"| {r.sdpa_ms:.4f} | {r.ratio:.2f} | {r.num_splits} | {r.ours_nosplit_ms:.4f} "
            f"| {r.ours_host_us:.1f} "
            f"| {r.ours_wall_us:.1f} | {r.sdpa_host_us:.1f} | {r.max_abs_diff:.2e} |"
        )
    return "\n".join(lines)


def _plan_runs(args: argparse.Namespace) -> list[tuple[str, str, int, int, int]]:
    runs = []
    for shape in args.shapes:
        for context in args.contexts:
            runs += [("decode", shape, b, context, 1) for b in args.batches]
            # exllamav2 prefills one sequence per forward, chunk by chunk.
            runs.append(("prefill_empty", shape, 1, PREFILL_CHUNK, PREFILL_CHUNK))
            if context > PREFILL_CHUNK:
                runs.append(("prefill_chunked", shape, 1, context, PREFILL_CHUNK))
    return list(dict.fromkeys(runs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    args = parser.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("attention_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for kind, shape, batch, context, q_len in _plan_runs(args):
        row = _measure(torch, kind, shape, batch, context, q_len)
        print(
            f"{kind} {shape} batch={batch} ctx={context}: ours {row.ours_ms:.4f} ms, "
            f"SDPA {row.sdpa_ms:.4f} ms, host {row.ours_host_us:.1f} us, "
            f"diff {row.max_abs_diff:.1e}",
            flush=True,
        )
        rows.append(row)
    print()
    print(_table(rows))
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "page_size": PAGE_SIZE,
        "host_calls": HOST_CALLS,
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
