"""The prefill's narrowed page search (worker/engines/exllamav2/page_search.py) takes what
exllamav2 0.3.2's search of every page takes. Pages and prompts here hold their tokens as
lists; the module's two tensor reads are swapped for list reads.
tests/gpu/test_page_search_on_gpu.py checks it on exllamav2's own generator and pins the
search it narrows."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from exlq.worker.engines.exllamav2 import page_search as exllamav2_page_search
from exlq.worker.engines.exllamav2.page_search import PageSearch, narrowed_page_search

PAGE = 4  # tokens a page


@dataclass(eq=False)
class _Page:
    index: int
    sequence: list[int]
    kv_position: int
    prev_hash: bytes | None
    phash: bytes


@dataclass(eq=False)
class _Seq:
    ids: list[int]
    allocated_pages: list[_Page]
    prefill_complete: bool = False


@dataclass(eq=False)
class _Job:
    sequences: list[_Seq] = field(default_factory=list)


@pytest.fixture(autouse=True)
def _list_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exllamav2_page_search, "boundary_tokens", lambda seq, size: seq.ids[::size])
    monkeypatch.setattr(
        exllamav2_page_search, "first_tokens", lambda pages: [p.sequence[0] for p in pages]
    )


def _best_match(pages: Any, own: _Page, prev_hash: bytes | None, ids: list[int]) -> Any:
    """exllamav2 0.3.2's search in ExLlamaV2DynamicJob.prefill (count_match in Python): the
    first page with the longest common prefix, taken only past one token."""
    best, best_page = 0, None
    for page in pages:
        if page.prev_hash != prev_hash or page is own:
            continue
        limit = min(page.kv_position, len(ids))
        match = 0
        while match < limit and page.sequence[match] == ids[match]:
            match += 1
        if match > best:
            best, best_page = match, page
    return (best_page.index, best) if best_page is not None and best > 1 else (None, 0)


def _loop(pages: list[_Page], jobs: list[_Job], narrowed: bool, rng: random.Random) -> list[Any]:
    """Each job's chunk searched from a page boundary, then its pages written as prefill()
    writes them (so that a later job of the loop may match them); what each search took."""
    searched: Any = PageSearch(pages, jobs, PAGE) if narrowed else pages
    taken = []
    for job in jobs:
        for seq in job.sequences:
            if seq.prefill_complete:
                continue
            p0 = rng.randrange(len(seq.allocated_pages))
            prev = None if p0 == 0 else seq.allocated_pages[p0 - 1].phash
            taken.append(_best_match(searched, seq.allocated_pages[p0], prev, seq.ids[p0 * PAGE :]))
            for i, own in enumerate(seq.allocated_pages):
                own.sequence = seq.ids[i * PAGE : (i + 1) * PAGE]
                own.kv_position = rng.choice([1, 2, PAGE])
                own.prev_hash = None if i == 0 else seq.allocated_pages[i - 1].phash
    return taken


def _random_cache(seed: int) -> tuple[list[_Page], list[_Job]]:
    """Pages and prompts cut from a few token sequences, each with a token changed here and
    there, so that prefixes of every length match; prev_hashes that chain pages to each
    other and to the jobs' own pages; some pages empty or holding one key; jobs of one or
    two sequences, some with their prefill complete."""
    rng = random.Random(seed)
    bases = [[rng.randrange(50) for _ in range(3 * PAGE)] for _ in range(4)]

    def cut(pages: int) -> list[int]:
        base = rng.choice(bases)
        at = rng.randrange(4 - pages) * PAGE
        tokens = base[at : at + pages * PAGE]
        if rng.random() < 0.7:
            tokens[rng.randrange(len(tokens))] = rng.randrange(50)
        return tokens

    count = 40
    pages = [
        _Page(
            i,
            cut(1),
            rng.choice([0, 1, 2, 3, PAGE]),
            rng.choice([None, None, bytes([100 + rng.randrange(count)])]),
            bytes([100 + i]),
        )
        for i in range(count)
    ]
    free = list(range(count))
    rng.shuffle(free)
    jobs = []
    for _ in range(6):
        job = _Job()
        for _ in range(rng.choice([1, 1, 2])):
            n = rng.randint(1, 3)
            owned = [pages[free.pop()] for _ in range(n)]
            job.sequences.append(_Seq(cut(n), owned, prefill_complete=rng.random() < 0.2))
        jobs.append(job)
    return pages, jobs


@pytest.mark.parametrize("seed", range(200))
def test_the_narrowed_search_takes_what_the_full_search_takes(seed: int) -> None:
    full = _loop(*_random_cache(seed), narrowed=False, rng=random.Random(seed))
    narrowed = _loop(*_random_cache(seed), narrowed=True, rng=random.Random(seed))
    assert narrowed == full


def test_pages_of_other_prompts_are_not_searched() -> None:
    pages, jobs = _random_cache(0)
    for page in pages:  # every page full, of prompts whose first tokens no job has
        page.sequence, page.kv_position = [99] * PAGE, PAGE
    held = {id(p) for job in jobs for seq in job.sequences for p in seq.allocated_pages}
    searched = list(PageSearch(pages, jobs, PAGE))
    assert searched and all(id(page) in held for page in searched)
    assert len(searched) < len(pages)


def test_the_view_is_in_place_only_for_the_loop_and_reads_like_all_pages() -> None:
    pages, jobs = _random_cache(1)

    @dataclass
    class _Generator:
        all_pages: Any
        active_jobs: list[_Job]
        page_size: int = PAGE

    generator = _Generator(pages, jobs)
    with pytest.raises(RuntimeError), narrowed_page_search(generator):
        view = generator.all_pages
        assert isinstance(view, PageSearch)
        assert len(view) == len(pages) and view[3] is pages[3] and pages[0] in view
        raise RuntimeError("a prefill failed")
    assert generator.all_pages is pages
