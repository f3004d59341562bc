"""Which jobs start in a step, and which prompt chunks share a batched prefill pass."""

from __future__ import annotations

from collections.abc import Iterator

from exlq.worker.engines.exllamav2.prefill_plan import Chunk, group_chunks, jobs_to_start


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


def test_a_burst_starts_in_slices_of_the_prompt_token_budget() -> None:
    assert jobs_to_start([256] * 128, budget_tokens=8192) == 32
    assert jobs_to_start([256] * 128, budget_tokens=8191) == 31
    assert jobs_to_start([1000, 3000, 5000, 10], budget_tokens=4096) == 2


def test_without_a_budget_every_waiting_job_starts() -> None:
    assert jobs_to_start([256] * 128, budget_tokens=0) == 128
    assert jobs_to_start([], budget_tokens=0) == 0


def test_a_prompt_over_the_budget_starts_alone_and_never_waits_forever() -> None:
    assert jobs_to_start([20_000, 10], budget_tokens=4096) == 1


def test_the_queue_is_read_only_as_far_as_the_slice() -> None:
    read: list[int] = []

    def lengths() -> Iterator[int]:
        for i in range(1000):
            read.append(i)
            yield 100

    assert jobs_to_start(lengths(), budget_tokens=500) == 5
    assert len(read) == 6  # the sixth is the one that did not fit
