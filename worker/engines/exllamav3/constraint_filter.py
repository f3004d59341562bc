"""A job's output constraint as an exllamav3 filter: the grammar exlq compiles for every
engine (structured_output.TokenConstraint, llguidance) masks the job's tokens through
exllamav3's filter hooks, so a schema or regex is compiled, refused and enforced alike on
every engine. Imported only when the engine is loaded (it subclasses exllamav3's Filter)."""

from __future__ import annotations

from typing import Any

import torch
from exllamav3 import Filter

from exlq.worker.engines.structured_output import TokenConstraint, allocate_bitmask


class ConstraintFilter(Filter):  # type: ignore[misc]
    """exllamav3 asks it for each step's mask (on its filter threads, while the forward pass
    runs) and feeds it each token the job takes. Completing the grammar ends the job
    ("end_filter"), as the end-of-text token its mask allows there does."""

    def __init__(self, tokenizer: Any, constraint: TokenConstraint, vocab_size: int) -> None:
        super().__init__(tokenizer, None, None, True)
        self.constraint = constraint
        self._accepted = 0  # tokens the grammar took, so many can be rolled back
        # One job's mask: int32 words, one bit a token (exllamav3 reads its bitmask form).
        self._bitmask: torch.Tensor = allocate_bitmask(1, vocab_size)

    def reset(self) -> None:
        # exllamav3 resets a filter as its job starts: the grammar goes back to its start.
        if self._accepted:
            self.rollback_tokens(self._accepted)

    def accept_token(self, token: int) -> None:
        if self.constraint.finished:
            return
        if self.constraint.accept(token):
            self._accepted += 1

    def rollback_tokens(self, num_tokens: int) -> bool:
        # A banned string rewinds the job's output; the grammar state goes back with it.
        if num_tokens > self._accepted or not self.constraint.rollback(num_tokens):
            raise RuntimeError(
                f"the job's grammar cannot take back {num_tokens} tokens (a banned string "
                "rewound past what it holds)"
            )
        self._accepted -= num_tokens
        return True

    def get_next_logit_mask(self) -> torch.Tensor:
        self.constraint.fill_mask(self._bitmask, 0)
        return self._bitmask

    def is_completed(self) -> bool:
        return self.constraint.finished
