"""Batched prefill for exllamav2's dynamic generator: the prompt chunks of one iteration run
as a few batched forward passes instead of one eager pass per job.

exllamav2 0.3.2's ExLlamaV2DynamicJob.prefill() does three things per chunk: finds what the
cache already holds (whole pages by hash; a partial page, whose keys/values it copies with
cache.copy_states), runs the model over the rest (model.forward_chunk with
preprocess_only=True, whose result it ignores), and books the pages. Only the middle needs
the GPU, and the bookkeeping never reads its result. While the generator runs its jobs'
prefill(), PrefillBatcher stands in for model.forward_chunk and cache.copy_states: each
prefill pass is recorded, not run, and the recorded passes run at the end of the loop in
groups (prefill_plan.group_chunks), right-padded to the group's longest row.

Two things must see the keys/values of a recorded pass, so they run the recorded passes
first: a copy_states (the partial-page match reads another page), and a pass that reads or
writes a page a recorded pass writes or reads (pages shared through the prefix cache).
Padding never reaches the cache: exlq's attention kernel stores only each row's real tokens
(attention.right_padded). Under flash-attn, which cannot, only chunks of equal
length share a pass. tests/gpu/test_batched_prefill.py checks the calls this relies on and
that batched and one-by-one prefill give the same logits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from exllamav2.attn import ExLlamaV2Attention

from exlq.worker.engines.exllamav2.attention import right_padded
from exlq.worker.engines.exllamav2.prefill_plan import Chunk, group_chunks

# The keyword arguments ExLlamaV2DynamicJob.prefill passes to forward_chunk.
PREFILL_KWARGS = frozenset(
    {"input_ids", "preprocess_only", "attn_params", "cache", "loras", "indexed_embeddings"}
)


@dataclass(frozen=True, slots=True)
class _Pass:
    """One recorded prefill pass: a single row, as exllamav2 asked for it."""

    kwargs: dict[str, Any]
    ids: Any  # (1, length) token ids, on the CPU
    start: int  # tokens already in the cache before the chunk
    pages: list[int]  # the row's block table up to the chunk's end
    length: int


class PrefillBatcher:
    """Batches the prefill passes of one generator's iterations (see the module docstring).

    budget_tokens bounds a batched pass's padded size (rows x longest); the model's scratch
    must hold that many rows (config.max_input_len x config.max_batch_size). padding says
    whether rows of different lengths may share a pass."""

    def __init__(self, generator: Any, budget_tokens: int, padding: bool) -> None:
        self.generator = generator
        self.budget_tokens = budget_tokens
        self.padding = padding
        self.page_size: int = generator.page_size
        self.max_seq_len: int = generator.model.config.max_seq_len
        self.passes = 0  # forward passes run for prefill
        self.chunks = 0  # prompt chunks they prefilled
        self._pending: list[_Pass] = []
        self._writes: set[int] = set()
        self._reads: set[int] = set()
        self._forward: Any = None
        self._copy_states: Any = None

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """Around the loop that calls every active job's prefill(); the recorded passes run
        before it closes."""
        model, cache = self.generator.model, self.generator.cache
        own_forward = "forward_chunk" in vars(model)  # CUDA graphs put one on the instance
        own_copy = "copy_states" in vars(cache)
        self._forward, self._copy_states = model.forward_chunk, cache.copy_states
        model.forward_chunk = self._record
        cache.copy_states = self._copy_after_flush
        try:
            yield
            self.flush()
        finally:
            self._clear()
            if own_forward:
                model.forward_chunk = self._forward
            else:
                del model.forward_chunk
            if own_copy:
                cache.copy_states = self._copy_states
            else:
                del cache.copy_states

    def flush(self) -> None:
        """Run the recorded passes, batched."""
        pending = self._pending
        self._clear()
        if not pending:
            return
        chunks = [Chunk(p.start, p.length) for p in pending]
        for group in group_chunks(chunks, self.budget_tokens, self.max_seq_len, self.padding):
            self._run([pending[i] for i in group])

    def _clear(self) -> None:
        self._pending = []
        self._writes = set()
        self._reads = set()

    def _record(self, *args: Any, **kwargs: Any) -> Any:
        if args or not self._deferrable(kwargs):
            self.flush()
            return self._forward(*args, **kwargs)
        params = kwargs["attn_params"]
        ids = kwargs["input_ids"]
        start, length = int(params.cache_seqlens[0]), int(ids.shape[-1])
        last_page = (start + length - 1) // self.page_size
        pages: list[int] = params.block_index[0, : last_page + 1].tolist()
        writes = set(pages[start // self.page_size :])
        if self._writes.intersection(pages) or self._reads.intersection(writes):
            self.flush()
        self._pending.append(_Pass(kwargs, ids, start, pages, length))
        self._writes.update(writes)
        self._reads.update(pages)
        return None  # prefill() ignores what forward_chunk returns

    def _deferrable(self, kwargs: dict[str, Any]) -> bool:
        params = kwargs.get("attn_params")
        return (
            set(kwargs) <= PREFILL_KWARGS
            and kwargs.get("preprocess_only") is True
            and kwargs.get("cache") is self.generator.cache
            and isinstance(params, ExLlamaV2Attention.PagedParams)
            and params.block_index.shape[0] == 1
            and not params.alt_rope_embed
            and params.rope_offsets is None
            and not kwargs.get("loras")
            and not kwargs.get("indexed_embeddings")
        )

    def _copy_after_flush(self, *args: Any, **kwargs: Any) -> Any:
        self.flush()
        return self._copy_states(*args, **kwargs)

    def _run(self, group: list[_Pass]) -> None:
        self.passes += 1
        self.chunks += len(group)
        if len(group) == 1:
            self._forward(**group[0].kwargs)
            return
        rows, longest = len(group), max(p.length for p in group)
        width = max(math.ceil((p.start + longest) / self.page_size) for p in group)
        ids = torch.zeros((rows, longest), dtype=torch.long)
        # Pages past a row's own end stay 0: only padding maps there, and padding is never
        # stored (equal lengths have none).
        block_index = torch.zeros((rows, width), dtype=torch.int32)
        for row, p in enumerate(group):
            ids[row, : p.length] = p.ids[0]
            block_index[row, : len(p.pages)] = torch.tensor(p.pages, dtype=torch.int32)
        seqlens = torch.tensor([p.start for p in group], dtype=torch.int32)
        params = self.generator.get_paged_params(rows, block_index, seqlens, longest)
        first = group[0].kwargs
        kwargs = {**first, "input_ids": ids, "attn_params": params}
        if all(p.length == longest for p in group):
            self._forward(**kwargs)
            return
        device = self.generator.cache.key_states[0].device
        lengths = torch.tensor([p.length for p in group], dtype=torch.int32).to(device)
        with right_padded(lengths):
            self._forward(**kwargs)
