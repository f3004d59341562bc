"""Triton paged-KV attention with the semantics of flash-attn's flash_attn_with_kvcache."""

# Why this exists: exllamav2's dynamic generator only batches when flash-attn >= 2.5.7 provides
# flash_attn_with_kvcache for paged caches; flash-attn is not available on the target machines.
#
# Design, in the order the costs matter:
# * No host synchronisation: grids and the split heuristic come from tensor shapes only; each
#   program reads its own sequence length from cache_seqlens and masks or exits early.
# * One kernel launch does the append and the attention. New keys/values are read straight from
#   k/v (never from the rows they are being written to), so the in-place write of those rows
#   into the pages cannot race with any reader. A second, tiny launch merges split-K partials
#   only when the grid would otherwise leave SMs idle (decode at small batch, long contexts).
# * All q heads that share a kv head are packed into the rows of one tile (row = token * group +
#   head-in-group), so every K/V page is read once per kv head, not once per q head.
# * K/V come straight out of the pages through block_table; positions map to (page, slot).

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only CI images carry no triton; only calling the function needs it
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "flash_attn_with_kvcache",
    "paged_attention_with_kvcache",
]

_LOG2E = 1.4426950408889634
# Rows (q_len * group) up to which a call is treated as decode: small query tile, long key blocks.
_DECODE_ROWS = 64
# One row count (q_len * group) of each tile class _tiles() picks: what a warm-up runs so that
# every variant a workload can meet is compiled before it serves.
TILE_CLASS_ROWS = (16, 32, _DECODE_ROWS, 1024, 2048)
# Fewest keys worth a split-K program of their own. exllamav2 calls this once per layer per
# step and its steps are bound by host time: the merge's extra launch costs more host time
# than splitting saves on the GPU below several thousand keys (bench/attention_bench.py
# compares the two). So split only long contexts.
_MIN_SPLIT_KEYS_DECODE = 4096
_MIN_SPLIT_KEYS_PREFILL = 4096
_MAX_SPLITS = 64
# Split until about this many programs per SM are in flight.
_PROGRAMS_PER_SM = 2
# The interpreter has no SMs; a small number makes the split-K path run in CPU tests.
_INTERPRETER_SM_COUNT = 4


if HAS_TRITON:
    # Parameters are annotated tl.tensor for mypy only: Triton rejects typing.Any in a kernel
    # signature and does not specialise on this annotation.

    @triton.jit
    def _tanh(x: tl.tensor) -> tl.tensor:
        # exp2 of a non-positive argument cannot overflow, and needs no libdevice (the
        # interpreter has none).
        e = tl.exp2(-2.8853900817779268 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _attend(
        acc: tl.tensor,
        m_i: tl.tensor,
        l_i: tl.tensor,
        q: tl.tensor,
        k: tl.tensor,
        v: tl.tensor,
        offs_n: tl.tensor,
        row_lo: tl.tensor,
        row_hi: tl.tensor,
        score_mul: tl.tensor,
        cap_mul: tl.tensor,
        HAS_SOFTCAP: tl.constexpr,
    ) -> tl.tensor:
        # Scores live in the log2 domain (log2(e) is folded into score_mul / cap_mul) so the
        # online softmax can use exp2.
        s = tl.dot(q, tl.trans(k))
        s = _tanh(s * score_mul) * cap_mul if HAS_SOFTCAP else s * score_mul
        keep = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] <= row_hi[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has not seen a visible key keeps m = -inf; shifting by 0 instead avoids
        # inf - inf = nan.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    @triton.jit
    def _cache_phase(
        acc: tl.tensor,
        m_i: tl.tensor,
        l_i: tl.tensor,
        q: tl.tensor,
        K_CACHE: tl.tensor,
        V_CACHE: tl.tensor,
        bt_row: tl.tensor,
        kvh: tl.tensor,
        start_pos: tl.tensor,
        end_pos: tl.tensor,
        row_lo: tl.tensor,
        row_hi: tl.tensor,
        kc_page: tl.tensor,
        kc_row: tl.tensor,
        kc_head: tl.tensor,
        vc_page: tl.tensor,
        vc_row: tl.tensor,
        vc_head: tl.tensor,
        score_mul: tl.tensor,
        cap_mul: tl.tensor,
        offs_d: tl.tensor,
        d_ok: tl.tensor,
        PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ) -> tl.tensor:
        hi = tl.minimum(row_hi, end_pos - 1)
        offs_n0 = tl.arange(0, BLOCK_N)
        for start in range(start_pos, end_pos, BLOCK_N):
            offs_n = start + offs_n0
            n_ok = offs_n < end_pos
            # Per-key page lookup: a block may straddle a page boundary, and page_size need not
            # be a multiple of BLOCK_N.
            page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = offs_n % PAGE_SIZE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k_off = page * kc_page + slot * kc_row + kvh * kc_head
            v_off = page * vc_page + slot * vc_row + kvh * vc_head
            k = tl.load(K_CACHE + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V_CACHE + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, k, v, offs_n, row_lo, hi, score_mul, cap_mul, HAS_SOFTCAP
            )
        return acc, m_i, l_i

    @triton.jit
    def _new_phase(
        acc: tl.tensor,
        m_i: tl.tensor,
        l_i: tl.tensor,
        q: tl.tensor,
        K_NEW: tl.tensor,
        V_NEW: tl.tensor,
        b: tl.tensor,
        kvh: tl.tensor,
        q_len: tl.tensor,
        n_cached: tl.tensor,
        start_pos: tl.tensor,
        end_pos: tl.tensor,
        row_lo: tl.tensor,
        row_hi: tl.tensor,
        score_mul: tl.tensor,
        cap_mul: tl.tensor,
        offs_d: tl.tensor,
        d_ok: tl.tensor,
        N_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ) -> tl.tensor:
        hi = tl.minimum(row_hi, end_pos - 1)
        offs_n0 = tl.arange(0, BLOCK_N)
        for start in range(start_pos, end_pos, BLOCK_N):
            offs_n = start + offs_n0
            n_ok = offs_n < end_pos
            src = (b.to(tl.int64) * q_len + (offs_n - n_cached)) * N_KV + kvh
            src_off = src[:, None] * HEAD_DIM + offs_d[None, :]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K_NEW + src_off, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(V_NEW + src_off, mask=kv_mask, other=0.0).to(q.dtype)
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, k, v, offs_n, row_lo, hi, score_mul, cap_mul, HAS_SOFTCAP
            )
        return acc, m_i, l_i

    @triton.jit
    def _append(
        K_NEW: tl.tensor,
        V_NEW: tl.tensor,
        K_CACHE: tl.tensor,
        V_CACHE: tl.tensor,
        bt_row: tl.tensor,
        b: tl.tensor,
        kvh: tl.tensor,
        mb: tl.tensor,
        q_len: tl.tensor,
        n_write: tl.tensor,
        n_cached: tl.tensor,
        kc_page: tl.tensor,
        kc_row: tl.tensor,
        kc_head: tl.tensor,
        vc_page: tl.tensor,
        vc_row: tl.tensor,
        vc_head: tl.tensor,
        offs_d: tl.tensor,
        d_ok: tl.tensor,
        N_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        WRITE_T: tl.constexpr,
    ) -> None:
        # Each token is written by the tile that holds its first row (token * GROUP), so every
        # new row lands exactly once even when GROUP does not divide BLOCK_M. Only the first
        # n_write tokens are written: the rest of a right-padded row is padding.
        t_lo = tl.cdiv(mb * BLOCK_M, GROUP)
        t_hi = tl.minimum(tl.cdiv((mb + 1) * BLOCK_M, GROUP), n_write)
        offs_t = t_lo + tl.arange(0, WRITE_T)
        t_ok = offs_t < t_hi
        pos = n_cached + offs_t
        page = tl.load(bt_row + pos // PAGE_SIZE, mask=t_ok, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        mask = t_ok[:, None] & d_ok[None, :]
        src = (b.to(tl.int64) * q_len + offs_t) * N_KV + kvh
        src_off = src[:, None] * HEAD_DIM + offs_d[None, :]
        k_dst = (
            K_CACHE + (page * kc_page + slot * kc_row + kvh * kc_head)[:, None] + offs_d[None, :]
        )
        v_dst = (
            V_CACHE + (page * vc_page + slot * vc_row + kvh * vc_head)[:, None] + offs_d[None, :]
        )
        k = tl.load(K_NEW + src_off, mask=mask, other=0.0)
        v = tl.load(V_NEW + src_off, mask=mask, other=0.0)
        tl.store(k_dst, k.to(K_CACHE.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(V_CACHE.dtype.element_ty), mask=mask)

    @triton.jit
    def _row_bounds(
        tok: tl.tensor,
        row_ok: tl.tensor,
        q_pos0: tl.tensor,
        n_total: tl.tensor,
        window_left: tl.tensor,
        window_right: tl.tensor,
        HAS_LEFT: tl.constexpr,
        HAS_RIGHT: tl.constexpr,
    ) -> tl.tensor:
        # Inclusive range of key positions each row may see; causal is window_right == 0.
        pos = q_pos0 + tok
        hi = tl.zeros_like(pos) + (n_total - 1)
        if HAS_RIGHT:
            hi = tl.minimum(pos + window_right, hi)
        hi = tl.where(row_ok, hi, -1)
        lo = tl.zeros_like(pos)
        if HAS_LEFT:
            lo = tl.maximum(pos - window_left, 0)
        return lo, hi

    @triton.jit
    def _store_partial(
        PART: tl.tensor,
        acc: tl.tensor,
        m_i: tl.tensor,
        l_i: tl.tensor,
        b: tl.tensor,
        kvh: tl.tensor,
        split: tl.tensor,
        num_splits: tl.tensor,
        offs_m: tl.tensor,
        row_ok: tl.tensor,
        rows_total: tl.tensor,
        offs_d: tl.tensor,
        N_KV: tl.constexpr,
        D_POW2: tl.constexpr,
    ) -> None:
        # PART holds [acc rows | m | l] for all (batch, kv head, split, row), one allocation.
        n_all = tl.num_programs(2).to(tl.int64) * N_KV * num_splits * rows_total
        prow = ((b * N_KV + kvh) * num_splits + split).to(tl.int64) * rows_total + offs_m
        tl.store(PART + prow[:, None] * D_POW2 + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(PART + n_all * D_POW2 + prow, m_i, mask=row_ok)
        tl.store(PART + n_all * (D_POW2 + 1) + prow, l_i, mask=row_ok)

    # exllamav2 hands in views whose base addresses and sizes vary from step to step (q, k, v
    # slices, cache_seqlens, block tables that widen as sequences grow). Triton would compile a
    # new variant for each alignment and each "== 1" / "% 16" class of those values, each
    # compile a stall mid-generation. One variant per shape instead.
    @triton.jit(
        do_not_specialize=["q_len", "bt_stride", "window_left", "window_right", "num_splits"],
        do_not_specialize_on_alignment=[
            "Q",
            "K_NEW",
            "V_NEW",
            "SEQLENS",
            "BLOCK_TABLE",
            "NEW_LENS",
        ],
    )
    def _paged_attn_fwd(
        Q: tl.tensor,
        K_NEW: tl.tensor,
        V_NEW: tl.tensor,
        K_CACHE: tl.tensor,
        V_CACHE: tl.tensor,
        SEQLENS: tl.tensor,
        BLOCK_TABLE: tl.tensor,
        NEW_LENS: tl.tensor,
        OUT: tl.tensor,
        PART: tl.tensor,
        q_len: tl.tensor,
        bt_stride: tl.tensor,
        kc_page: tl.tensor,
        kc_row: tl.tensor,
        kc_head: tl.tensor,
        vc_page: tl.tensor,
        vc_row: tl.tensor,
        vc_head: tl.tensor,
        score_mul: tl.tensor,
        cap_mul: tl.tensor,
        window_left: tl.tensor,
        window_right: tl.tensor,
        num_splits: tl.tensor,
        N_HEADS: tl.constexpr,
        N_KV: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_POW2: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        WRITE_T: tl.constexpr,
        HAS_NEW: tl.constexpr,
        HAS_NEW_LENS: tl.constexpr,
        HAS_LEFT: tl.constexpr,
        HAS_RIGHT: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        SPLIT: tl.constexpr,
    ) -> None:
        pid0 = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        rows_total = q_len * GROUP
        split = pid0 % num_splits
        # Last (longest, under causal masking) query tiles are scheduled first to shorten the tail.
        mb = tl.cdiv(rows_total, BLOCK_M) - 1 - pid0 // num_splits

        n_cached = tl.load(SEQLENS + b)
        n_total = n_cached
        if HAS_NEW:
            n_total = n_cached + q_len

        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < rows_total
        tok = offs_m // GROUP
        q_row = (b.to(tl.int64) * q_len + tok) * N_HEADS + kvh * GROUP + offs_m % GROUP
        offs_d = tl.arange(0, D_POW2)
        d_ok = offs_d < HEAD_DIM
        q_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + q_row[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)

        row_lo, row_hi = _row_bounds(
            tok, row_ok, n_total - q_len, n_total, window_left, window_right, HAS_LEFT, HAS_RIGHT
        )
        lo = tl.min(tl.where(row_ok, row_lo, n_total), 0)
        hi = tl.max(row_hi, 0) + 1
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
        k_lo = lo + split * chunk
        k_hi = tl.minimum(k_lo + chunk, hi)

        acc = tl.zeros([BLOCK_M, D_POW2], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        bt_row = BLOCK_TABLE + b.to(tl.int64) * bt_stride

        acc, m_i, l_i = _cache_phase(
            acc, m_i, l_i, q, K_CACHE, V_CACHE, bt_row, kvh, k_lo, tl.minimum(k_hi, n_cached),
            row_lo, row_hi, kc_page, kc_row, kc_head, vc_page, vc_row, vc_head,
            score_mul, cap_mul, offs_d, d_ok, PAGE_SIZE, BLOCK_N, HAS_SOFTCAP,
        )  # fmt: skip
        if HAS_NEW:
            acc, m_i, l_i = _new_phase(
                acc, m_i, l_i, q, K_NEW, V_NEW, b, kvh, q_len, n_cached,
                tl.maximum(k_lo, n_cached), k_hi, row_lo, row_hi, score_mul, cap_mul,
                offs_d, d_ok, N_KV, HEAD_DIM, BLOCK_N, HAS_SOFTCAP,
            )  # fmt: skip
            if split == 0:
                n_write = q_len
                if HAS_NEW_LENS:
                    n_write = tl.minimum(tl.load(NEW_LENS + b), q_len)
                _append(
                    K_NEW, V_NEW, K_CACHE, V_CACHE, bt_row, b, kvh, mb, q_len, n_write, n_cached,
                    kc_page, kc_row, kc_head, vc_page, vc_row, vc_head, offs_d, d_ok,
                    N_KV, HEAD_DIM, PAGE_SIZE, GROUP, BLOCK_M, WRITE_T,
                )  # fmt: skip

        if SPLIT:
            _store_partial(
                PART, acc, m_i, l_i, b, kvh, split, num_splits, offs_m, row_ok, rows_total,
                offs_d, N_KV, D_POW2,
            )  # fmt: skip
        else:
            # A row with no visible key has l = 0 and acc = 0: flash-attn returns 0 there too.
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(
                OUT + q_row[:, None] * HEAD_DIM + offs_d[None, :],
                o.to(OUT.dtype.element_ty),
                mask=q_mask,
            )

    @triton.jit
    def _merge_splits(
        PART: tl.tensor,
        OUT: tl.tensor,
        q_len: tl.tensor,
        num_splits: tl.tensor,
        N_HEADS: tl.constexpr,
        N_KV: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_POW2: tl.constexpr,
        SPLITS_POW2: tl.constexpr,
    ) -> None:
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        rows_total = q_len * GROUP
        n_all = tl.num_programs(2).to(tl.int64) * N_KV * num_splits * rows_total
        offs_s = tl.arange(0, SPLITS_POW2)
        s_ok = offs_s < num_splits
        prow = ((b * N_KV + kvh) * num_splits + offs_s).to(tl.int64) * rows_total + row
        m = tl.load(PART + n_all * D_POW2 + prow, mask=s_ok, other=float("-inf"))
        l_s = tl.load(PART + n_all * (D_POW2 + 1) + prow, mask=s_ok, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
        l_sum = tl.sum(w * l_s, 0)
        offs_d = tl.arange(0, D_POW2)
        acc = tl.load(
            PART + prow[:, None] * D_POW2 + offs_d[None, :], mask=s_ok[:, None], other=0.0
        )
        o = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0.0, l_sum, 1.0)
        out_row = (b.to(tl.int64) * q_len + row // GROUP) * N_HEADS + kvh * GROUP + row % GROUP
        tl.store(
            OUT + out_row * HEAD_DIM + offs_d,
            o.to(OUT.dtype.element_ty),
            mask=offs_d < HEAD_DIM,
        )


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class _Plan:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    m_blocks: int
    write_t: int
    d_pow2: int


def _tiles(rows: int, d_pow2: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for rows = q_len * group."""
    num_stages = 3 if d_pow2 <= 128 else 2
    if rows <= _DECODE_ROWS:
        # Memory-bound: tl.dot needs >= 16 rows; long key blocks keep many bytes in flight.
        return max(16, _next_pow2(rows)), (128 if d_pow2 <= 64 else 64), 4, num_stages
    if rows >= 2048 and d_pow2 <= 128:
        return 128, 64, 8, num_stages
    return 64, 64, (8 if d_pow2 >= 256 else 4), num_stages


@functools.lru_cache(maxsize=4096)
def _plan(
    q_len: int,
    group: int,
    head_dim: int,
    batch: int,
    n_kv: int,
    max_keys: int,
    sm_count: int,
    num_splits: int,
) -> _Plan:
    """Tile sizes and split-K count, from shapes only (never from tensor contents)."""
    d_pow2 = max(16, _next_pow2(head_dim))
    rows = q_len * group
    block_m, block_n, num_warps, num_stages = _tiles(rows, d_pow2)
    m_blocks = _cdiv(rows, block_m)
    if num_splits <= 0:
        # max_keys is the block table's capacity: an upper bound on every sequence's length.
        target = _PROGRAMS_PER_SM * sm_count
        base = m_blocks * n_kv * batch
        min_keys = _MIN_SPLIT_KEYS_DECODE if rows <= _DECODE_ROWS else _MIN_SPLIT_KEYS_PREFILL
        by_len = max(1, max_keys // min_keys)
        num_splits = max(1, min(_cdiv(target, base), by_len, _MAX_SPLITS))
    write_t = _next_pow2(_cdiv(block_m, group))
    return _Plan(block_m, block_n, num_warps, num_stages, num_splits, m_blocks, write_t, d_pow2)


@functools.lru_cache(maxsize=16)
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return _INTERPRETER_SM_COUNT
    import torch

    idx = torch.cuda.current_device() if index is None else index
    return int(torch.cuda.get_device_properties(idx).multi_processor_count)


def _check_supported(
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    return_softmax_lse: bool,
) -> None:
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError("rotary embedding inside attention is not supported")
    if cache_batch_idx is not None or cache_leftpad is not None:
        raise NotImplementedError("cache_batch_idx / cache_leftpad are not supported")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes are not supported")
    if return_softmax_lse:
        raise NotImplementedError("return_softmax_lse is not supported")
    if not HAS_TRITON:
        raise RuntimeError("paged attention needs triton, which is not installed")


def _check_tensors(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    n_heads, n_kv = q.shape[2], k_cache.shape[2]
    if n_heads % n_kv != 0:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv})")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("q, k_cache and v_cache must share one dtype")


def _seqlens_tensor(
    cache_seqlens: int | torch.Tensor | None,
    batch: int,
    capacity: int,
    appending: bool,
    device: torch.device,
) -> torch.Tensor:
    import torch

    if cache_seqlens is None:
        if appending:
            raise ValueError("cache_seqlens is required when k/v are appended")
        # flash-attn: no cache_seqlens means the whole cache is valid.
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if cache_seqlens.dtype != torch.int32:
        return cache_seqlens.to(torch.int32)
    return cache_seqlens


def _page_table(
    block_table: torch.Tensor | None, k_cache: torch.Tensor, batch: int
) -> torch.Tensor:
    import torch

    if block_table is None:
        # Unpaged cache (batch_cache, seqlen_cache, ...): row b is one page as long as the cache.
        return torch.arange(batch, dtype=torch.int32, device=k_cache.device).unsqueeze(1)
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    return block_table


def _new_kv(
    k: torch.Tensor | None, v: torch.Tensor | None, q: torch.Tensor, n_kv: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if k is None and v is None:
        return None
    if k is None or v is None:
        raise ValueError("k and v must be given together")
    expected = (q.shape[0], q.shape[1], n_kv, q.shape[3])
    if k.shape != expected or v.shape != expected:
        raise ValueError(f"k/v must have shape {expected}, got {tuple(k.shape)}")
    return k.contiguous(), v.contiguous()


def _score_muls(head_dim: int, softmax_scale: float | None, softcap: float) -> tuple[float, float]:
    """(multiplier on q.k, multiplier after tanh), both landing scores in the log2 domain."""
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    if softcap > 0.0:
        # flash-attn: softcap * tanh(q.k * scale / softcap).
        return scale / softcap, softcap * _LOG2E
    return scale * _LOG2E, 1.0


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    seqlens: torch.Tensor,
    table: torch.Tensor,
    new_lens: torch.Tensor | None,
    muls: tuple[float, float],
    window: tuple[int, int],
    softcap: bool,
    num_splits: int,
    dev: torch.device,
) -> torch.Tensor:
    import torch

    batch, q_len, n_heads, head_dim = q.shape
    n_kv, page_size = k_cache.shape[2], k_cache.shape[1]
    kcs, vcs = k_cache.stride(), v_cache.stride()
    if kcs[3] != 1 or vcs[3] != 1:
        raise ValueError("k_cache/v_cache need a contiguous last dimension")
    group = n_heads // n_kv
    plan = _plan(
        q_len, group, head_dim, batch, n_kv, table.shape[1] * page_size,
        _sm_count(dev.type, dev.index), num_splits,
    )  # fmt: skip
    out = torch.empty((batch, q_len, n_heads, head_dim), dtype=q.dtype, device=dev)
    split = plan.num_splits > 1
    part = out
    if split:
        rows_all = batch * n_kv * plan.num_splits * q_len * group
        part = torch.empty(rows_all * (plan.d_pow2 + 2), dtype=torch.float32, device=dev)
    # Without k/v the kernel never touches K_NEW / V_NEW (HAS_NEW is a compile-time False).
    k_new, v_new = (q, q) if new_kv is None else new_kv
    _paged_attn_fwd[(plan.m_blocks * plan.num_splits, n_kv, batch)](
        q, k_new, v_new, k_cache, v_cache, seqlens, table,
        seqlens if new_lens is None else new_lens, out, part,
        q_len, table.stride(0), kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2],
        muls[0], muls[1], window[0], window[1], plan.num_splits,
        N_HEADS=n_heads, N_KV=n_kv, GROUP=group, HEAD_DIM=head_dim, D_POW2=plan.d_pow2,
        PAGE_SIZE=page_size, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        WRITE_T=plan.write_t, HAS_NEW=new_kv is not None,
        HAS_NEW_LENS=new_kv is not None and new_lens is not None, HAS_LEFT=window[0] >= 0,
        HAS_RIGHT=window[1] >= 0, HAS_SOFTCAP=softcap, SPLIT=split,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    if split:
        _merge_splits[(q_len * group, n_kv, batch)](
            part, out, q_len, plan.num_splits,
            N_HEADS=n_heads, N_KV=n_kv, GROUP=group, HEAD_DIM=head_dim, D_POW2=plan.d_pow2,
            SPLITS_POW2=_next_pow2(plan.num_splits), num_warps=4,
        )  # fmt: skip
    return out


def paged_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    new_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for flash_attn.flash_attn_with_kvcache (paged or unpaged cache, no rotary/alibi).

    q: (batch, q_len, n_heads, head_dim); k_cache/v_cache: (num_pages, page_size, n_kv_heads,
    head_dim) with block_table (batch, max_pages) int32, or (batch, seqlen, n_kv_heads, head_dim)
    without. If k/v (batch, q_len, n_kv_heads, head_dim) are given they are written in place at
    positions cache_seqlens[b] .. cache_seqlens[b] + q_len - 1 and attended to. Query i sits at
    absolute position seqlen_k - q_len + i (seqlen_k = keys after the append); causal and
    window_size=(left, right) restrict keys to [pos - left, pos + right]; softcap > 0 applies
    softcap * tanh(score / softcap) to scaled scores. Rows with no visible key return 0.
    Never synchronises with the host. num_splits=0 picks the split-K count from shapes.

    exlq's addition, for right-padded batches of prompts: with new_lens (batch,) int32 on q's
    device, only the first new_lens[b] of row b's new keys/values are written to the cache;
    the padding behind them is attended to by padding queries only (causal), never stored.
    """
    _check_supported(
        rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi_slopes, return_softmax_lse
    )
    import torch

    batch, q_len = q.shape[0], q.shape[1]
    if batch == 0 or q_len == 0:
        return torch.empty_like(q)
    _check_tensors(q, k_cache, v_cache)
    new_kv = _new_kv(k, v, q, k_cache.shape[2])
    table = _page_table(block_table, k_cache, batch)
    capacity = table.shape[1] * k_cache.shape[1]
    dev = q.device
    seqlens = _seqlens_tensor(cache_seqlens, batch, capacity, new_kv is not None, dev)
    # flash-attn: causal means window right edge 0 (bottom-right aligned); -1 means unbounded.
    window = (int(window_size[0]), 0 if causal else int(window_size[1]))
    muls = _score_muls(q.shape[3], softmax_scale, softcap)
    q = q.contiguous()
    if new_lens is not None and not causal:
        raise ValueError("new_lens (right padding) needs causal attention")
    args = (
        q, k_cache, v_cache, new_kv, seqlens, table, new_lens, muls, window, softcap > 0.0,
        num_splits,
    )  # fmt: skip
    if dev.type == "cuda" and dev.index != torch.cuda.current_device():
        # Triton launches on the current device; flash-attn guards to q's device the same way.
        with torch.cuda.device(dev):
            return _launch(*args, dev)
    return _launch(*args, dev)


# exllamav2 looks the function up under flash-attn's name.
flash_attn_with_kvcache = paged_attention_with_kvcache
