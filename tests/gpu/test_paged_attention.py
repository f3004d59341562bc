"""Triton paged attention (exlq.worker.kernels) against the float32 dense reference."""

# On the GPU machine:   pytest -s -m gpu tests/gpu/test_paged_attention.py
# On a CPU, tiny sizes: TRITON_INTERPRET=1 pytest -s -m gpu tests/gpu/test_paged_attention.py
# (TRITON_INTERPRET=1 switches these tests to CPU tensors under Triton's interpreter; it must be
# set before triton is imported, hence an environment variable rather than a pytest option.)

from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

torch: Any = pytest.importorskip("torch", reason="paged attention tests need torch")
pytest.importorskip("triton", reason="paged attention tests need triton")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip(
        "CUDA is not available (TRITON_INTERPRET=1 runs these at tiny sizes on the CPU)",
        allow_module_level=True,
    )


DEVICE = "cpu" if INTERPRET else "cuda"
TOLERANCE = 2e-2
# Everything the kernel must never read or write holds these: large enough that one stray read
# moves the output far past the tolerance, finite in fp16 and bf16.
SENTINEL_K = 2.0
SENTINEL_V = 50.0


@dataclass(frozen=True)
class Case:
    name: str
    seqlens: tuple[int, ...]  # tokens in the cache before the call (after it, when append=False)
    q_len: int
    n_heads: int
    n_kv: int
    head_dim: int
    dtype: str = "float16"
    append: bool = True
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    scale: float | None = None
    page_size: int = 256
    num_splits: int = 0
    paged: bool = True


_RAGGED_130 = tuple(random.Random(1234).randint(1, 1200) for _ in range(130))

CASES = [
    Case("decode_mha_d64_fp16", (0, 1, 255, 256, 700, 1500), 1, 8, 8, 64),
    Case("decode_gqa4_d128_bf16", (5, 300, 511, 512, 1800, 2047, 33), 1, 32, 8, 128, "bfloat16"),
    Case("decode_gqa8_d64_fp16", (1000, 17, 768, 4000), 1, 16, 2, 64),
    Case("decode_batch130_gqa4_d128_fp16", _RAGGED_130, 1, 32, 8, 128),
    Case("decode_batch130_gqa8_d64_bf16", _RAGGED_130, 1, 32, 4, 64, "bfloat16"),
    Case("decode_forced_splits7_gqa4_d128", (700, 64, 2000), 1, 8, 2, 128, num_splits=7),
    Case("decode_forced_nosplit_gqa4_d64", (700, 2000), 1, 32, 8, 64, num_splits=1),
    Case("decode_head_dim96_gqa4_fp16", (90, 1300), 1, 32, 8, 96),
    Case("decode_head_dim256_gqa2_bf16", (90, 1300), 1, 16, 8, 256, "bfloat16"),
    Case("spec_decode_q5_gqa4_d128", (10, 400, 1023), 5, 32, 8, 128),
    Case("chunked_prefill_q128_gqa4_d128_fp16", (300,), 128, 32, 8, 128),
    Case("chunked_prefill_q512_gqa8_d64_bf16", (1000,), 512, 32, 4, 64, "bfloat16"),
    Case("chunked_prefill_q256_batch3_mha_d128", (0, 256, 777), 256, 8, 8, 128),
    Case("chunked_prefill_q1024_gqa4_d128_bf16", (1024,), 1024, 32, 8, 128, "bfloat16"),
    Case("prefill_empty_q300_gqa4_d64_fp16", (0,), 300, 32, 8, 64),
    Case("prefill_empty_q256_gqa8_d128_bf16", (0,), 256, 32, 4, 128, "bfloat16"),
    Case("prefill_empty_q200_head_dim256", (0,), 200, 8, 4, 256),
    Case("prefill_forced_splits3_gqa4_d64", (500,), 200, 16, 4, 64, num_splits=3),
    Case("window_decode_gqa4_d128", (50, 600, 1500), 1, 32, 8, 128, window=(255, 255)),
    Case("window_prefill_gqa4_d64_bf16", (400,), 300, 16, 4, 64, "bfloat16", window=(128, 128)),
    Case("window_decode_split4", (2000,), 1, 8, 2, 64, window=(300, 300), num_splits=4),
    Case("softcap_decode_gqa2_d128_bf16", (100, 900), 1, 16, 8, 128, "bfloat16",
         softcap=5.0, scale=0.3),
    Case("softcap_window_prefill_gqa2_d64", (200,), 128, 8, 4, 64, softcap=5.0, scale=0.3,
         window=(100, 100)),
    Case("kv_none_sequential_q200_gqa4_d64", (700,), 200, 32, 8, 64, append=False),
    Case("kv_none_decode_gqa4_d128", (1, 300, 2000), 1, 32, 8, 128, append=False),
    Case("kv_none_short_cache_rows_see_nothing", (3,), 8, 8, 2, 64, append=False),
    Case("non_causal_q64_gqa4_d64", (100, 300), 64, 8, 2, 64, causal=False),
    Case("small_pages16_decode_gqa4_d64", (40, 100, 7), 1, 8, 2, 64, page_size=16),
    Case("small_pages16_prefill_gqa4_d64", (40,), 50, 8, 2, 64, page_size=16),
    Case("unpaged_decode_gqa4_d64", (10, 300), 1, 8, 2, 64, paged=False),
    Case("unpaged_prefill_q16_gqa4_d64", (10, 300), 16, 8, 2, 64, paged=False),
]  # fmt: skip


def _shrink(case: Case) -> Case:
    """Interpreter-sized copy of a case: pages of 16 stand in for pages of 256.

    bf16 becomes fp16: Triton's interpreter (3.6 to 3.9) computes tl.dot on bf16 operands wrongly,
    so bf16 is only checked on the GPU.
    """

    def tokens(n: int) -> int:
        return n if n <= 32 else n // 16

    window = tuple(w if w < 0 else max(1, w // 16) for w in case.window)
    return replace(
        case,
        seqlens=tuple(tokens(n) for n in case.seqlens[:9]),
        q_len=case.q_len if case.q_len <= 8 else max(8, case.q_len // 16),
        window=(window[0], window[1]),
        page_size=max(4, case.page_size // 16),
        dtype="float16",
    )


@dataclass
class Inputs:
    q: Any
    k: Any
    v: Any
    k_pool: Any
    v_pool: Any
    seqlens: Any
    block_table: Any


def _pages_needed(case: Case) -> list[int]:
    n_new = case.q_len if case.append else 0
    return [max(1, math.ceil((n + n_new) / case.page_size)) for n in case.seqlens]


def _block_table(case: Case, gen: Any) -> tuple[Any, int]:
    """Shuffled, non-contiguous pages per sequence, zero padded like exllamav2's block_index."""
    needed = _pages_needed(case)
    n_pool = sum(needed) + 3  # spare pages nobody owns must stay untouched
    perm = torch.randperm(n_pool, generator=gen)
    table = torch.zeros((len(needed), max(needed) + 1), dtype=torch.int32)
    at = 0
    for b, n in enumerate(needed):
        table[b, :n] = perm[at : at + n]
        at += n
    return table, n_pool


def _make_inputs(case: Case, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    batch, n_new = len(case.seqlens), case.q_len if case.append else 0
    if case.paged:
        table, n_pool = _block_table(case, gen)
        pool_shape = (n_pool, case.page_size, case.n_kv, case.head_dim)
    else:
        table = None
        max_len = max(case.seqlens) + n_new + 5
        pool_shape = (batch + 1, max_len, case.n_kv, case.head_dim)
    k_pool = torch.full(pool_shape, SENTINEL_K, dtype=dtype)
    v_pool = torch.full(pool_shape, SENTINEL_V, dtype=dtype)
    page_size = pool_shape[1]
    for b, n in enumerate(case.seqlens):
        pos = torch.arange(n)
        pages = pos * 0 + b if table is None else table[b].long()[pos // page_size]
        shape = (n, case.n_kv, case.head_dim)
        k_pool[pages, pos % page_size] = torch.randn(shape, generator=gen).to(dtype)
        v_pool[pages, pos % page_size] = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn((batch, case.q_len, case.n_heads, case.head_dim), generator=gen)
    kv_shape = (batch, case.q_len, case.n_kv, case.head_dim)
    k = torch.randn(kv_shape, generator=gen) if case.append else None
    v = torch.randn(kv_shape, generator=gen) if case.append else None

    def dev(t: Any) -> Any:
        return None if t is None else t.to(DEVICE)

    return Inputs(
        q=dev(q.to(dtype)),
        k=dev(None if k is None else k.to(dtype)),
        v=dev(None if v is None else v.to(dtype)),
        k_pool=dev(k_pool),
        v_pool=dev(v_pool),
        seqlens=dev(torch.tensor(case.seqlens, dtype=torch.int32)),
        block_table=dev(table),
    )


def _expected_pools(case: Case, inp: Inputs) -> tuple[Any, Any]:
    """The pools as they must look after the call: only the appended rows differ."""
    k_exp, v_exp = inp.k_pool.clone(), inp.v_pool.clone()
    if not case.append:
        return k_exp, v_exp
    page_size = k_exp.shape[1]
    for b, n in enumerate(case.seqlens):
        for t in range(case.q_len):
            pos = n + t
            page = b if inp.block_table is None else int(inp.block_table[b, pos // page_size])
            k_exp[page, pos % page_size] = inp.k[b, t]
            v_exp[page, pos % page_size] = inp.v[b, t]
    return k_exp, v_exp


def _kwargs(case: Case, inp: Inputs, k_pool: Any, v_pool: Any) -> dict[str, Any]:
    return {
        "q": inp.q,
        "k": inp.k,
        "v": inp.v,
        "k_cache": k_pool,
        "v_cache": v_pool,
        "cache_seqlens": inp.seqlens,
        "block_table": inp.block_table,
        "causal": case.causal,
        "softmax_scale": case.scale,
        "window_size": case.window,
        "softcap": case.softcap,
    }


def _run_case(case: Case, seed: int) -> float:
    from exlq.worker.kernels.paged_attention import paged_attention_with_kvcache
    from exlq.worker.kernels.reference import reference_attention_with_kvcache

    inp = _make_inputs(case, seed)
    k_exp, v_exp = _expected_pools(case, inp)
    k_ours, v_ours = inp.k_pool.clone(), inp.v_pool.clone()
    k_ref, v_ref = inp.k_pool.clone(), inp.v_pool.clone()
    out = paged_attention_with_kvcache(
        **_kwargs(case, inp, k_ours, v_ours), num_splits=case.num_splits
    )
    ref = reference_attention_with_kvcache(**_kwargs(case, inp, k_ref, v_ref))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert out.shape == inp.q.shape and out.dtype == inp.q.dtype
    assert torch.equal(k_ref, k_exp) and torch.equal(v_ref, v_exp), "reference append is wrong"
    assert torch.equal(k_ours, k_exp), "k pool differs from the expected append"
    assert torch.equal(v_ours, v_exp), "v pool differs from the expected append"
    assert bool(torch.isfinite(out).all())
    return float((out.float() - ref.float()).abs().max())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_reference(case: Case) -> None:
    if INTERPRET:
        case = _shrink(case)
    seed = sum(ord(c) for c in case.name)
    err = _run_case(case, seed)
    print(f"paged_attention case={case.name} max_abs_err={err:.3e}")
    assert err < TOLERANCE


def test_rows_without_visible_keys_are_zero() -> None:
    from exlq.worker.kernels.paged_attention import paged_attention_with_kvcache

    case = Case("no_keys", (3,), 8, 8, 2, 64, append=False, page_size=16)
    inp = _make_inputs(case, seed=5)
    out = paged_attention_with_kvcache(**_kwargs(case, inp, inp.k_pool, inp.v_pool))
    # Query i sits at position 3 - 8 + i: rows 0..4 see no key at all.
    assert bool((out[:, :5] == 0).all())
    assert bool((out[:, 5:].abs().sum(dim=-1) > 0).all())


def test_flash_attn_name_and_integer_seqlens() -> None:
    from exlq.worker.kernels import paged_attention as pa
    from exlq.worker.kernels.reference import reference_attention_with_kvcache

    assert pa.flash_attn_with_kvcache is pa.paged_attention_with_kvcache
    case = Case("int_seqlens", (37, 37), 1, 8, 2, 64, page_size=16)
    inp = _make_inputs(case, seed=11)
    k_ref, v_ref = inp.k_pool.clone(), inp.v_pool.clone()
    out = pa.flash_attn_with_kvcache(
        q=inp.q, k=inp.k, v=inp.v, k_cache=inp.k_pool, v_cache=inp.v_pool,
        cache_seqlens=37, block_table=inp.block_table, causal=True, softmax_scale=0.125,
    )  # fmt: skip
    ref = reference_attention_with_kvcache(
        q=inp.q, k=inp.k, v=inp.v, k_cache=k_ref, v_cache=v_ref,
        cache_seqlens=37, block_table=inp.block_table, causal=True, softmax_scale=0.125,
    )  # fmt: skip
    err = float((out.float() - ref.float()).abs().max())
    print(f"paged_attention case=int_seqlens max_abs_err={err:.3e}")
    assert err < TOLERANCE
    assert torch.equal(inp.k_pool, k_ref) and torch.equal(inp.v_pool, v_ref)


def test_right_padded_rows_store_only_their_own_tokens() -> None:
    """Batched prefill pads rows to the longest: with new_lens, each row's real tokens are
    attended to as if the row ran alone, and no padding token reaches the cache, even where
    the block table maps the padding onto a page another row owns."""
    from exlq.worker.kernels.paged_attention import paged_attention_with_kvcache
    from exlq.worker.kernels.reference import reference_attention_with_kvcache

    page_size = 4 if INTERPRET else 16
    case = Case(
        "padded", (0, 300 // (4 if INTERPRET else 1), 17), 40, 8, 2, 64, page_size=page_size
    )
    new_lens = (40, 13, 1)
    inp = _make_inputs(case, seed=21)
    table = inp.block_table.clone()
    owned = table[0, 0].item()
    for b, (n, real) in enumerate(zip(case.seqlens, new_lens, strict=True)):
        first_pad_page = math.ceil((n + real) / page_size)
        table[b, first_pad_page:] = owned  # exllamav2 pads block tables with page indices too
    k_pool, v_pool = inp.k_pool.clone(), inp.v_pool.clone()
    out = paged_attention_with_kvcache(
        q=inp.q, k=inp.k, v=inp.v, k_cache=k_pool, v_cache=v_pool, cache_seqlens=inp.seqlens,
        block_table=table, causal=True,
        new_lens=torch.tensor(new_lens, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    k_exp, v_exp = inp.k_pool.clone(), inp.v_pool.clone()
    worst = 0.0
    for b, real in enumerate(new_lens):
        row = slice(b, b + 1)
        ref = reference_attention_with_kvcache(
            q=inp.q[row, :real], k=inp.k[row, :real], v=inp.v[row, :real], k_cache=k_exp,
            v_cache=v_exp, cache_seqlens=inp.seqlens[row], block_table=table[row], causal=True,
        )  # fmt: skip
        worst = max(worst, float((out[row, :real].float() - ref.float()).abs().max()))
    print(f"paged_attention case=right_padded max_abs_err={worst:.3e}")
    assert worst < TOLERANCE
    assert torch.equal(k_pool, k_exp), "padding reached the k cache"
    assert torch.equal(v_pool, v_exp), "padding reached the v cache"


def test_rejects_unsupported_arguments() -> None:
    from exlq.worker.kernels.paged_attention import paged_attention_with_kvcache

    case = Case("reject", (5,), 1, 8, 2, 64, page_size=16)
    inp = _make_inputs(case, seed=3)
    with pytest.raises(NotImplementedError):
        paged_attention_with_kvcache(
            **_kwargs(case, inp, inp.k_pool, inp.v_pool), alibi_slopes=inp.seqlens
        )
    with pytest.raises(ValueError):
        paged_attention_with_kvcache(**{**_kwargs(case, inp, inp.k_pool, inp.v_pool), "v": None})


@pytest.mark.skipif(INTERPRET, reason="host-sync detection needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode:UserWarning")
@pytest.mark.parametrize(
    ("q_len", "seqlens", "num_splits"),
    [(1, (100, 2000), 0), (1, (100, 2000), 1), (256, (300,), 0), (64, (3000,), 4)],
)
def test_never_synchronises_with_host(
    q_len: int, seqlens: tuple[int, ...], num_splits: int
) -> None:
    from exlq.worker.kernels.paged_attention import paged_attention_with_kvcache

    case = Case("sync", seqlens, q_len, 32, 8, 128)
    inp = _make_inputs(case, seed=9)
    kwargs = _kwargs(case, inp, inp.k_pool.clone(), inp.v_pool.clone())
    paged_attention_with_kvcache(**kwargs, num_splits=num_splits)  # compiles outside the check
    torch.cuda.synchronize()
    kwargs = _kwargs(case, inp, inp.k_pool.clone(), inp.v_pool.clone())
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_attention_with_kvcache(**kwargs, num_splits=num_splits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
