"""book_token writes a job's one waiting token where exllamav2's booking would, and hands
anything else to exllamav2's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from exlq.worker.engines.exllamav2.page_booking import book_token  # noqa: E402

PAGE = 4


@dataclass
class _Page:
    sequence: Any = field(default_factory=lambda: torch.full((1, PAGE), -1, dtype=torch.long))
    kv_position: int = 0
    ref_count: int = 1
    can_revert: bool = True


@dataclass
class _Seq:
    sequence_ids: list[int]
    kv_position: int
    allocated_pages: list[_Page]


class _Job:
    def __init__(self, ids: list[int], kv_position: int, pages: list[_Page]) -> None:
        self.sequences = [_Seq(ids, kv_position, pages)]
        self.own_bookings = 0

    def get_input_ids_list(self, add_to_cache: bool = False) -> None:
        assert add_to_cache
        self.own_bookings += 1


def test_the_waiting_token_goes_to_the_next_position_of_its_page() -> None:
    pages = [_Page(kv_position=PAGE), _Page(kv_position=2)]
    # Six tokens cached (a full page and two), the seventh accepted and waiting.
    job = _Job(ids=[1, 2, 3, 4, 5, 6, 7], kv_position=6, pages=pages)
    book_token(job, 7, PAGE)
    assert pages[1].sequence[0].tolist() == [-1, -1, 7, -1]
    assert pages[1].kv_position == 3
    assert pages[1].can_revert is False
    assert pages[0].kv_position == PAGE and pages[0].can_revert is True
    assert job.own_bookings == 0


def test_a_token_that_opens_a_page_goes_to_its_first_position() -> None:
    pages = [_Page(kv_position=PAGE), _Page()]
    job = _Job(ids=[1, 2, 3, 4, 5], kv_position=4, pages=pages)
    book_token(job, 5, PAGE)
    assert pages[1].sequence[0, 0].item() == 5
    assert pages[1].kv_position == 1


def test_more_than_one_waiting_token_goes_through_exllamav2s_own_booking() -> None:
    page = _Page(kv_position=1)
    before = page.sequence.clone()
    job = _Job(ids=[1, 2, 3], kv_position=1, pages=[page])
    book_token(job, 9, PAGE)
    assert job.own_bookings == 1
    assert torch.equal(page.sequence, before)


@pytest.mark.parametrize(
    ("page", "error"),
    [
        (_Page(kv_position=1, ref_count=2), "share"),
        (_Page(kv_position=PAGE), "full page"),
    ],
)
def test_a_broken_page_table_fails_with_an_error_not_a_write(page: _Page, error: str) -> None:
    before = page.sequence.clone()
    # One token cached, one waiting: it goes to the first page, the one under test.
    job = _Job(ids=[1, 2], kv_position=1, pages=[page])
    with pytest.raises(RuntimeError, match=error):
        book_token(job, 9, PAGE)
    assert torch.equal(page.sequence, before)
    assert job.own_bookings == 0
