"""A job's held-back buffers, allocated when first used rather than when it is queued.

exllamav2 0.3.2 holds back a job's output while it may still end in a stop string, and
`ExLlamaV2DynamicJob.prepare_for_queue` allocates five buffers for it: tokens, top-k tokens,
top-k probabilities, probabilities and logits, the last of 256 x vocab floats (32.8 MB for a
vocabulary of 32,000). A job fills the tokens' buffer only, plus the probabilities and
top-k ones when it asks for logprobs; exlq never asks for logits. The five allocations were
most of prepare_for_queue, which runs for every job before the step that starts it
(bench.job_build).

install_lazy_held_buffers() points the job module's SeqTensor, which it uses for these five
buffers and nothing else, at LazySeqTensor: the same sequence buffer, whose tensor is made
on first use. A buffer never filled is never allocated. tests/gpu/test_held_buffers.py
checks that exllamav2 still makes them so, that LazySeqTensor behaves as SeqTensor, and
that jobs run the same.
"""

from __future__ import annotations

from typing import Any

import torch
from exllamav2.generator import dynamic
from exllamav2.util import SeqTensor


class LazySeqTensor(SeqTensor):  # type: ignore[misc]
    """exllamav2's SeqTensor, its tensor allocated on first use (exllamav2 0.3.2's
    SeqTensor.__init__, less the torch.empty)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        seq_dim: int,
        device: torch.device | str = "cpu",
        init_cap: int = -1,
    ) -> None:
        if seq_dim < 0:
            seq_dim = len(shape) + seq_dim
        self.seq_dim = seq_dim
        self.seq_len = 0
        if init_cap == -1:
            init_cap = self.PAGE_SIZE
        else:
            init_cap = (init_cap // self.PAGE_SIZE + 1) * self.PAGE_SIZE
        full = list(shape)
        full[seq_dim] = self.seq_cap = init_cap
        self._spec = (tuple(full), dtype, device)
        self._buffer: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._buffer is None:
            shape, dtype, device = self._spec
            self._buffer = torch.empty(shape, dtype=dtype, device=device)
        return self._buffer

    @tensor.setter
    def tensor(self, value: torch.Tensor) -> None:
        self._buffer = value

    @property
    def allocated(self) -> bool:
        return self._buffer is not None


def install_lazy_held_buffers() -> None:
    """Make exllamav2's jobs allocate their held-back buffers on first use (idempotent)."""
    module: Any = dynamic
    module.SeqTensor = LazySeqTensor
