"""PaddedBatch: the running jobs' KV cache as one batch, so that a step decodes every job in
one forward pass.

Each row holds one job's tokens right-aligned, padding on the left, so that every row's next
token goes into the same column: transformers' DynamicCache appends one column a step for
the whole batch. A row's padding is masked out of attention, and each row's positions are
its own (position_ids), so a job sees exactly the tokens it would see alone. Jobs join
between steps (their prompts prefilled together, then padded to the batch's width or the
batch to theirs) and leave (their rows dropped, and the columns that are padding in every
row left trimmed). The price of one shared width: every row attends over the longest
running job's columns, its own padding masked, until that job leaves.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache


class ModelCall:
    """One forward pass of a causal LM, with the keyword names the installed transformers
    takes: 5.x renames ``past_key_values`` to ``cache`` part way through the series."""

    def __init__(self, model: Any) -> None:
        self.model = model
        parameters = inspect.signature(model.forward).parameters
        self.cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        self.keeps_last_logits = "logits_to_keep" in parameters

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """The logits of each row's last position, (rows, vocabulary)."""
        options: dict[str, Any] = {self.cache_keyword: cache, "use_cache": True}
        if self.keeps_last_logits:  # a prefill's other positions' logits are never read
            options["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **options)
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits


class PaddedBatch:
    def __init__(self, call: ModelCall, device: torch.device) -> None:
        self._call = call
        self._device = device
        self.rows: list[str] = []  # job ids, in row order
        # Kept from step to step: the model appends each step's column to it in place. Built
        # anew only when rows join or leave (DynamicCache copies the tensors it is built from).
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=device)

    @property
    def tokens_held(self) -> int:
        """Cache positions held, padding included: rows times columns."""
        return int(self._mask.numel())

    def decode(self, next_ids: Sequence[int]) -> torch.Tensor:
        """Feed each row its next token (in row order); returns the rows' logits."""
        rows = len(self.rows)
        ids = torch.tensor(next_ids, dtype=torch.long, device=self._device).view(rows, 1)
        positions = self._mask.sum(dim=1, keepdim=True)  # each row's real tokens so far
        self._mask = F.pad(self._mask, (0, 1), value=1)
        return self._call(ids, self._mask, positions, self._cache)

    def prefill(self, job_ids: Sequence[str], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Add jobs as new rows (after the others), their prompts run in one pass; returns
        their logits, in the order given."""
        width = max(len(prompt) for prompt in prompts)
        # Built on the host and moved in one copy each.
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            start = width - len(prompt)
            ids[row, start:] = torch.tensor(prompt, dtype=torch.long)
            mask[row, start:] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
        cache = DynamicCache()
        logits = self._call(ids, mask, positions, cache)
        self._join(list(job_ids), cache, mask)
        return logits

    def drop(self, job_ids: set[str]) -> None:
        """Remove these jobs' rows."""
        keep = [row for row, job_id in enumerate(self.rows) if job_id not in job_ids]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.clear()
            return
        index = torch.tensor(keep, dtype=torch.long, device=self._device)
        mask = self._mask.index_select(0, index)
        # Columns that are padding in every row left: the longest job may have gone.
        start = int(mask.any(dim=0).int().argmax())
        self._mask = mask[:, start:]
        self._cache = DynamicCache(
            ddp_cache_data=[
                (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                for k, v in _layers_of(self._cache)
            ]
        )
        self.rows = [self.rows[row] for row in keep]

    def clear(self) -> None:
        self.rows = []
        self._cache = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self._device)

    def _join(
        self,
        job_ids: list[str],
        cache: Any,
        mask: torch.Tensor,
    ) -> None:
        if not self.rows:
            self.rows, self._cache, self._mask = job_ids, cache, mask
            return
        width = max(self._mask.shape[1], mask.shape[1])
        self._cache = DynamicCache(
            ddp_cache_data=[
                (
                    torch.cat([_pad_left(k, width), _pad_left(k_new, width)]),
                    torch.cat([_pad_left(v, width), _pad_left(v_new, width)]),
                )
                for (k, v), (k_new, v_new) in zip(
                    _layers_of(self._cache), _layers_of(cache), strict=True
                )
            ]
        )
        self._mask = torch.cat([_pad_mask_left(self._mask, width), _pad_mask_left(mask, width)])
        self.rows = self.rows + job_ids


def _layers_of(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A DynamicCache's tensors, (keys, values) of (rows, heads, columns, head size) per
    layer."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(states: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(states, (0, 0, width - states.shape[2], 0))


def _pad_mask_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(mask, (width - mask.shape[1], 0))
