"""Plain-torch float32 reference for flash_attn_with_kvcache semantics on a paged KV cache."""

# Deliberately simple and slow: one sequence at a time, pages gathered into dense tensors,
# masks built explicitly. It reads tensor values on the host; it exists for tests and benches.

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["reference_attention_with_kvcache"]


def _page_rows(
    block_table: torch.Tensor | None, b: int, n_pos: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page index, row in page) of positions 0 .. n_pos - 1 of sequence b."""
    import torch

    pos = torch.arange(n_pos)
    if block_table is None:
        return torch.full((n_pos,), b, dtype=torch.long), pos
    pages = block_table[b].to("cpu", torch.long)[pos // page_size]
    return pages, pos % page_size


def _visible(n_keys: int, q_len: int, causal: bool, window_size: tuple[int, int]) -> torch.Tensor:
    """(q_len, n_keys) bool: query i sits at absolute position n_keys - q_len + i."""
    import torch

    left, right = window_size
    if causal:
        right = 0
    qpos = torch.arange(q_len)[:, None] + (n_keys - q_len)
    kpos = torch.arange(n_keys)[None, :]
    mask = torch.ones((q_len, n_keys), dtype=torch.bool)
    if right >= 0:
        mask &= kpos <= qpos + right
    if left >= 0:
        mask &= kpos >= qpos - left
    return mask


def _seqlen_list(cache_seqlens: int | torch.Tensor | None, batch: int, capacity: int) -> list[int]:
    if cache_seqlens is None:
        return [capacity] * batch
    if isinstance(cache_seqlens, int):
        return [cache_seqlens] * batch
    return [int(x) for x in cache_seqlens.tolist()]


def reference_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as paged_attention_with_kvcache (subset of flash-attn's arguments).

    Writes k/v into k_cache/v_cache in place, then attends in float32 and returns q's dtype.
    """
    import torch

    batch, q_len, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    page_size = k_cache.shape[1]
    capacity = page_size if block_table is None else block_table.shape[1] * page_size
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    seqlens = _seqlen_list(cache_seqlens, batch, capacity)
    n_new = 0 if k is None else q_len
    out = torch.empty_like(q)
    for b in range(batch):
        n_keys = seqlens[b] + n_new
        pages, rows = _page_rows(block_table, b, n_keys, page_size)
        pages, rows = pages.to(k_cache.device), rows.to(k_cache.device)
        if k is not None and v is not None:
            new_pages, new_rows = pages[seqlens[b] :], rows[seqlens[b] :]
            k_cache[new_pages, new_rows] = k[b].to(k_cache.dtype)
            v_cache[new_pages, new_rows] = v[b].to(v_cache.dtype)
        keys = k_cache[pages, rows].float().repeat_interleave(group, dim=1)  # (n, heads, d)
        values = v_cache[pages, rows].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), keys) * scale
        if softcap > 0.0:
            scores = softcap * torch.tanh(scores / softcap)
        mask = _visible(n_keys, q_len, causal, window_size).to(q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # flash-attn returns 0 for a query that sees no key; softmax over all -inf gives nan.
        probs = torch.nan_to_num(probs, nan=0.0)
        out[b] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
