"""Which prompt chunks share a batched prefill pass."""

from __future__ import annotations

from worker.engines.prefill_plan import Chunk, group_chunks


def _lengths(chunks: list[Chunk], groups: list[list[int]]) -> list[list[int]]:
    return [[chunks[i].length for i in group] for group in groups]


def test_equal_chunks_fill_passes_up_to_the_budget() -> None:
    chunks = [Chunk(0, 255)] * 20
    groups = group_chunks(chunks, budget_tokens=2048, max_seq_len=4096, padding=True)
    assert [len(g) for g in groups] == [8, 8, 4]
    assert sorted(i for g in groups for i in g) == list(range(20))


def test_padding_joins_chunks_at_least_half_the_longest() -> None:
    chunks = [Chunk(0, 100), Chunk(0, 400), Chunk(0, 199), Chunk(0, 200), Chunk(0, 390)]
    groups = group_chunks(chunks, budget_tokens=4096, max_seq_len=4096, padding=True)
    assert _lengths(chunks, groups) == [[400, 390, 200], [199, 100]]


def test_without_padding_only_equal_lengths_share() -> None:
    chunks = [Chunk(0, 300), Chunk(0, 290), Chunk(0, 300)]
    groups = group_chunks(chunks, budget_tokens=4096, max_seq_len=4096, padding=False)
    assert _lengths(chunks, groups) == [[300, 300], [290]]


def test_a_padded_row_must_end_inside_the_model_context() -> None:
    # The short chunk starts late: padded to 500 it would run past position 2048.
    chunks = [Chunk(0, 500), Chunk(1800, 300)]
    groups = group_chunks(chunks, budget_tokens=4096, max_seq_len=2048, padding=True)
    assert _lengths(chunks, groups) == [[500], [300]]


def test_a_chunk_over_the_budget_runs_alone() -> None:
    chunks = [Chunk(0, 3000), Chunk(0, 3000)]
    assert group_chunks(chunks, budget_tokens=2048, max_seq_len=8192, padding=True) == [[0], [1]]


def test_nothing_to_group() -> None:
    assert group_chunks([], budget_tokens=2048, max_seq_len=2048, padding=True) == []
