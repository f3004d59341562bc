"""A job's held-output buffers allocated when first written, not when the job is queued.

exllamav2 0.3.2's ExLlamaV2DynamicJob.prepare_for_queue gives every job five SeqTensors for
the output it holds back between steps: its tokens, and their probabilities, top-k tokens,
top-k probabilities and logits, which only a job that asks for them ever fills. Each
allocates its buffer at once, 256 positions deep; the logits' is 256 x vocab float32, 33 MB
of address space a job at a vocab of 32,000. Building a job is on the way to a burst's first
token, and allocating five buffers that are mostly never written was a large part of it
(docs/PERFORMANCE.md, "On the GPU (exllamav2 engine options)").

OnDemandSeqTensor is exllamav2's SeqTensor with its buffer made on first use: a buffer that
is never written is never made, and one that is written behaves as before.
install_on_demand_buffers() puts it in place of SeqTensor in exllamav2.generator.dynamic,
whose only calls of that name's constructor are those five (from_tensor builds exllamav2's
own class). The name is looked up when a job is queued, so the change is process-wide:
every job queued after it, exlq's or not, gets buffers on demand. Pinned to exllamav2 0.3.2
like the other hooks: tests/gpu/test_job_buffers.py fails if the constructor calls move,
and checks that held output is the same either way.

The same class makes the job's two copies of its prompt's ids (exllamav2's job constructor
calls ``SeqTensor.from_tensor`` for its input ids and its sequence ids, through the name
the hook replaces) in one allocation: the ids padded with zeros to SeqTensor's capacity,
where SeqTensor's own allocates the buffer, slices it and copies into the slice: the two
copies were a sizeable part of a job's build, and one op each cuts most of that.
"""

from __future__ import annotations

from typing import Any

import exllamav2.generator.dynamic as exllamav2_dynamic
import torch
from exllamav2.util import SeqTensor

from exlq.worker.engines.exllamav2.attention import on_pinned_exllamav2


def _capacity(length: int) -> int:
    """SeqTensor's capacity for `length` positions: the next whole page past them."""
    page: int = SeqTensor.PAGE_SIZE
    return (length // page + 1) * page


class OnDemandSeqTensor(SeqTensor):  # type: ignore[misc]
    """exllamav2's SeqTensor whose buffer is allocated on its first use, not when it is made.
    Capacity, shape and growth are SeqTensor's."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        seq_dim: int,
        device: Any = "cpu",
        init_cap: int = -1,
    ) -> None:
        # SeqTensor.__init__ without its torch.empty().
        if seq_dim < 0:
            seq_dim += len(shape)
        self.seq_dim = seq_dim
        self.seq_len = 0
        self.seq_cap = self.PAGE_SIZE if init_cap == -1 else _capacity(init_cap)
        full = list(shape)
        full[seq_dim] = self.seq_cap
        self._shape = tuple(full)
        self._dtype = dtype
        self._device = device
        self._buffer: torch.Tensor | None = None

    @staticmethod
    def from_tensor(tensor: torch.Tensor, seq_dim: int) -> SeqTensor:
        """exllamav2's SeqTensor holding ``tensor``, as SeqTensor.from_tensor makes it (the
        same capacity and length; the positions past the data are zeros), in one step."""
        if seq_dim < 0:
            seq_dim += tensor.dim()
        length = tensor.shape[seq_dim]
        capacity = _capacity(length)
        made = SeqTensor.__new__(SeqTensor)
        made.seq_dim, made.seq_len, made.seq_cap = seq_dim, length, capacity
        # The pad's pairs run from the last dimension back to seq_dim. constant_pad_nd is
        # what F.pad calls for a constant pad, without its checks of mode and value, which
        # would be paid twice a job.
        pad = (0, 0) * (tensor.dim() - 1 - seq_dim) + (0, capacity - length)
        made.tensor = torch.constant_pad_nd(tensor, pad, 0)
        return made

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    @property
    def tensor(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.empty(self._shape, dtype=self._dtype, device=self._device)
        return self._buffer

    @tensor.setter
    def tensor(self, value: torch.Tensor) -> None:  # SeqTensor.append grows it by replacing
        self._buffer = value


def install_on_demand_buffers() -> bool:
    """Jobs queued from now on get their held-output buffers on first use; False (and
    exllamav2's own buffers) where another exllamav2 than the pinned one is installed."""
    if exllamav2_dynamic.SeqTensor is OnDemandSeqTensor:
        return True
    if not on_pinned_exllamav2("job buffers as exllamav2 makes them"):
        return False
    exllamav2_dynamic.SeqTensor = OnDemandSeqTensor
    return True
