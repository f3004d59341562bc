"""Which prompt chunks share one batched prefill pass. Plain Python: no torch, no exllamav2.

A batched pass runs its rows right-padded to the longest, so it costs rows x longest tokens of
GPU work and one pass of host time. Small models are bound by host time (one eager pass is
several ms of Python whatever its length) and gain from few passes; large models are bound
by the GPU and lose what padding adds. group_chunks batches while the padding stays small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A chunk joins a group only when at least this share of its padded row is real tokens.
MIN_FILL = 0.5


@dataclass(frozen=True, slots=True)
class Chunk:
    """One prompt chunk to prefill: `length` new tokens after `start` cached ones."""

    start: int
    length: int


def group_chunks(
    chunks: Sequence[Chunk], budget_tokens: int, max_seq_len: int, padding: bool
) -> list[list[int]]:
    """Indices of `chunks`, in groups that each run as one pass.

    A group's padded size (rows x longest) stays within budget_tokens; a chunk's padded row
    must end inside max_seq_len (its positions index the rotary tables); with padding False
    (the attention cannot keep padding out of the cache) only equal lengths share a pass, and
    with it True a chunk joins only when MIN_FILL of its padded row is real. A chunk longer
    than the budget runs alone. Longest first, so each group is padded to its first chunk.
    """
    order = sorted(range(len(chunks)), key=lambda i: -chunks[i].length)
    groups: list[list[int]] = []
    for i in order:
        chunk = chunks[i]
        group = groups[-1] if groups else None
        if group is not None and _fits(chunks, group, chunk, budget_tokens, max_seq_len, padding):
            group.append(i)
        else:
            groups.append([i])
    return groups


def _fits(
    chunks: Sequence[Chunk],
    group: list[int],
    chunk: Chunk,
    budget_tokens: int,
    max_seq_len: int,
    padding: bool,
) -> bool:
    longest = chunks[group[0]].length
    if (len(group) + 1) * longest > budget_tokens:
        return False
    if chunk.start + longest > max_seq_len:
        return False
    if chunk.length == longest:
        return True
    return padding and chunk.length >= MIN_FILL * longest
