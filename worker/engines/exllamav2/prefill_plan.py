"""Which jobs start in one step, and which prompt chunks share one batched prefill pass.
Plain Python: no torch, no exllamav2.

exllamav2 starts every waiting job that fits the batch and the cache, and prefills each
one's prompt (up to max_chunk_size) in the step that starts it: a burst of 128 jobs of 256
tokens is 32,768 prompt tokens in one step, and every job's first token, and the next token
of every job already running, waits for all of it. jobs_to_start holds a step to a budget
of prompt tokens, so a burst starts in slices: the first slice decodes while the next ones
prefill.

A batched pass runs its rows right-padded to the longest, so it costs rows x longest tokens of
GPU work and one pass of host time. Small models are bound by host time (one eager pass is
several ms of Python whatever its length) and gain from few passes; large models are bound
by the GPU and lose what padding adds. group_chunks batches while the padding stays small.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# A chunk joins a group only when at least this share of its padded row is real tokens.
MIN_FILL = 0.5


def jobs_to_start(prompt_tokens: Iterable[int], budget_tokens: int) -> int:
    """How many of the waiting jobs, in order, this step may start: as many as hold at most
    budget_tokens prompt tokens together, and always the first (a prompt longer than the
    budget starts alone). budget_tokens 0: no budget, every job. Reads no further than it
    needs, so a long queue costs nothing past the slice."""
    count = 0
    total = 0
    for tokens in prompt_tokens:
        total += tokens
        if budget_tokens and count and total > budget_tokens:
            break
        count += 1
    return count


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
