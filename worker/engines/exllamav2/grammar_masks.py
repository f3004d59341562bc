"""GrammarMasks: a decode step's token masks for its constrained jobs, computed on the host
while the GPU runs the step's forward pass and applied to the logits on the GPU.

A job's grammar (structured_output.TokenConstraint) says which tokens may come next given
those it has taken; the mask is filled by llguidance's thread pool (the GIL released), one
bit a token, into one pinned buffer for the step, copied to the device with the step's
other work queued, and applied before either sampler reads the logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from exlq.worker.engines.structured_output import (
    MASK_BITS,
    TokenConstraint,
    allocate_bitmask,
    apply_bitmask,
    fill_masks,
)

log = logging.getLogger(__name__)


class GrammarMasks:
    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._bitmask: torch.Tensor | None = None  # (max_rows, words), pinned, made at first use

    def apply(self, constrained: Sequence[tuple[TokenConstraint, int]], logits: Any) -> None:
        """Mask the rows of ``logits`` (rows, width; on the device) that belong to
        constrained jobs: (constraint, row) pairs."""
        bitmask = self._buffer(constrained[0][0].words)[: len(constrained)]
        fill_masks([(constraint, n) for n, (constraint, _) in enumerate(constrained)], bitmask)
        index = torch.tensor([row for _, row in constrained], dtype=torch.long)
        index = index.to(logits.device, non_blocking=True)
        masked = logits.index_select(0, index)
        apply_bitmask(masked, bitmask)
        logits.index_copy_(0, index, masked)

    def _buffer(self, words: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[1] != words:
            self._bitmask = allocate_bitmask(self.max_rows, words * MASK_BITS, pin=True)
        return self._bitmask


def grammar_ended(constraint: TokenConstraint, token: int) -> bool:
    """Feed a job's new token to its grammar; True when the job must end there: the grammar
    is complete, or (never with a mask applied) the token broke it."""
    if not constraint.accept(token):
        log.warning("token %d broke a job's grammar; the job ends there", token)
        return True
    return constraint.finished
