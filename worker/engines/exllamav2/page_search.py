"""The pages exllamav2's prefill searches for a partial match, narrowed to those that can match.

When a job's prompt chunk starts on a page boundary, exllamav2 0.3.2's
ExLlamaV2DynamicJob.prefill() looks for the cached page whose tokens share the longest prefix
with the chunk, to copy that many keys/values instead of computing them. It walks every page
of generator.all_pages and, for each one whose prev_hash is the chunk's, compares it with the
job's own page (a dataclass __eq__ over its sixteen fields) and calls ext_c.count_match. Every
page of a fresh cache, and the first page of every sequence since, has prev_hash None: a
new job's first chunk paid both calls for nearly every page of the cache, one job after
another, before the step's first prefill pass reached the GPU (docs/PERFORMANCE.md, "On the
GPU (exllamav2 engine options)").

While exlq's generator runs its jobs' prefill(), generator.all_pages is a PageSearch. Iterated,
it yields, in all_pages' order, only the pages whose match could be taken. Its length and
items are all_pages', for any other reader. The search keeps exactly what it found before:
- A page is taken only for a match of two tokens or more (``best_match > 1``), so only a page
  holding two keys or more (``kv_position >= 2``) can be taken, and its first token must be
  the chunk's first, which lies on a page boundary of a job whose prefill is not complete.
- Its prev_hash must be the chunk's: None, or the phash of a page that job holds.
- Pages held by those jobs are written while the loop runs (their own prefill), so they are
  always yielded, their keys counted when the search reaches them. No other page changes
  in the loop.
- Pages are yielded in all_pages' order, so ties go to the same page as before.
A page left out could only have matched fewer than two tokens: it could not have been
taken, nor kept another page from being taken.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MIN_TAKEN_MATCH = 2  # prefill() copies a partial match only when best_match > 1


class PageSearch:
    """generator.all_pages as a prefill loop's page search sees it (module docstring): its
    iteration narrowed, its length, items and membership all_pages'. The candidates are
    found at the first search of the loop, once for all its jobs."""

    def __init__(self, pages: list[Any], jobs: list[Any], page_size: int) -> None:
        self.pages = pages
        self.jobs = jobs
        self.page_size = page_size
        self._candidates: list[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._candidates is None:
            self._candidates = self._find_candidates()
        return (page for page in self._candidates if page.kv_position >= MIN_TAKEN_MATCH)

    def __len__(self) -> int:
        return len(self.pages)

    def __getitem__(self, index: Any) -> Any:
        return self.pages[index]

    def __contains__(self, page: object) -> bool:
        return page in self.pages

    def _find_candidates(self) -> list[Any]:
        held: set[int] = set()  # id() of the pages of the jobs whose prefill runs in the loop
        hashes: set[bytes | None] = {None}  # the prev_hash their chunks can have
        starts: set[int] = set()  # their tokens on page boundaries
        for job in self.jobs:
            for seq in job.sequences:
                if seq.prefill_complete:
                    continue
                held.update(id(page) for page in seq.allocated_pages)
                hashes.update(page.phash for page in seq.allocated_pages)
                starts.update(boundary_tokens(seq, self.page_size))
        others = [
            page
            for page in self.pages
            if page.kv_position >= MIN_TAKEN_MATCH
            and page.prev_hash in hashes
            and id(page) not in held
        ]
        keep = set(held)
        if others:
            firsts = first_tokens(others)
            keep.update(
                id(page) for page, first in zip(others, firsts, strict=True) if first in starts
            )
        return [page for page in self.pages if id(page) in keep]


def boundary_tokens(seq: Any, page_size: int) -> list[int]:
    """A sequence's prompt tokens on page boundaries (its ids: a SeqTensor of (1, n))."""
    tokens: list[int] = seq.sequence_ids.torch()[0, ::page_size].tolist()
    return tokens


def first_tokens(pages: list[Any]) -> list[int]:
    """Each page's first token. A page's tokens are a (1, page_size) tensor on the CPU: one
    copy reads them all."""
    import torch

    tokens: list[int] = torch.cat([page.sequence for page in pages])[:, 0].tolist()
    return tokens


@contextmanager
def narrowed_page_search(generator: Any) -> Iterator[None]:
    """Around a loop that runs the generator's active jobs' prefill()."""
    pages = generator.all_pages
    generator.all_pages = PageSearch(pages, generator.active_jobs, generator.page_size)
    try:
        yield
    finally:
        generator.all_pages = pages
