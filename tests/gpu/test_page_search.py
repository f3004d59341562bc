"""The prefill's search for a partially matching page, narrowed (exllamav2_page_search.py),
takes what exllamav2's search of every page takes."""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

PAGE = 4  # tokens a page in the model of the search below


@dataclass(eq=False)
class _Page:
    index: int
    sequence: Any  # (1, PAGE) token ids
    kv_position: int
    prev_hash: bytes | None
    phash: bytes


@dataclass(eq=False)
class _Ids:
    ids: Any  # (1, n)

    def torch(self) -> Any:
        return self.ids


@dataclass(eq=False)
class _Seq:
    sequence_ids: _Ids
    allocated_pages: list[_Page]
    prefill_complete: bool = False


@dataclass(eq=False)
class _Job:
    sequences: list[_Seq] = field(default_factory=list)


def _best_match(pages: Any, own: _Page, prev_hash: bytes | None, ids: Any) -> tuple[Any, int]:
    """exllamav2 0.3.2's search in ExLlamaV2DynamicJob.prefill, ext_c.count_match in Python."""
    best, best_page = 0, None
    for page in pages:
        if page.prev_hash != prev_hash or page is own:
            continue
        limit = min(page.kv_position, ids.shape[1])
        match = 0
        while match < limit and int(page.sequence[0, match]) == int(ids[0, match]):
            match += 1
        if match > best:
            best, best_page = match, page
    return (best_page, best) if best_page is not None and best > 1 else (None, 0)


def _loop(pages: list[_Page], jobs: list[_Job], narrowed: bool, rng: random.Random) -> list[Any]:
    """Each job's chunk searched, then its pages written as prefill() writes them (so a later
    job of the loop may match them); what each search took."""
    from worker.engines.exllamav2_page_search import PageSearch

    searched: Any = PageSearch(pages, jobs, PAGE) if narrowed else pages
    taken = []
    for job in jobs:
        for seq in job.sequences:
            if seq.prefill_complete:
                continue
            ids = seq.sequence_ids.torch()
            p0 = rng.randrange(len(seq.allocated_pages))
            prev = None if p0 == 0 else seq.allocated_pages[p0 - 1].phash
            chunk = ids[:, p0 * PAGE :]
            page, match = _best_match(searched, seq.allocated_pages[p0], prev, chunk)
            taken.append((None if page is None else page.index, match))
            for i, own in enumerate(seq.allocated_pages):
                own.sequence[0, :] = ids[0, i * PAGE : (i + 1) * PAGE]
                own.kv_position = rng.choice([1, 2, PAGE])
                own.prev_hash = None if i == 0 else seq.allocated_pages[i - 1].phash
    return taken


def _random_cache(seed: int) -> tuple[list[_Page], list[_Job]]:
    """Pages and prompts cut from a few token sequences, each with a token changed here and
    there, so that prefixes of every length match; prev_hashes that chain pages to each
    other and to the jobs' own pages; some pages empty or holding one key; jobs of one or
    two sequences, some with their prefill complete."""
    import torch

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
            torch.tensor([cut(1)]),
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
            ids = torch.tensor([cut(n)])
            job.sequences.append(_Seq(_Ids(ids), owned, prefill_complete=rng.random() < 0.2))
        jobs.append(job)
    return pages, jobs


@pytest.mark.parametrize("seed", range(200))
def test_the_narrowed_search_takes_what_the_full_search_takes(seed: int) -> None:
    pytest.importorskip("torch")
    full = _loop(*_random_cache(seed), narrowed=False, rng=random.Random(seed))
    narrowed = _loop(*_random_cache(seed), narrowed=True, rng=random.Random(seed))
    assert narrowed == full


def _run_jobs(generator: Any, prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
    """The prompts as one burst, greedy, 6 new tokens each: each job's cached prompt tokens
    and its new tokens."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    jobs = [
        ExLlamaV2DynamicJob(
            input_ids=torch.tensor([ids]),
            max_new_tokens=6,
            stop_conditions=[],
            gen_settings=ExLlamaV2Sampler.Settings.greedy(),
            identifier=i,
        )
        for i, ids in enumerate(prompts)
    ]
    generator.enqueue(jobs)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            new = result.get("token_ids") if result.get("stage") == "streaming" else None
            if new is not None:
                tokens[result["identifier"]] += new[0].tolist()
    return [(job.cached_tokens, tokens[i]) for i, job in enumerate(jobs)]


def _history(vocab: int) -> list[list[list[int]]]:
    """Bursts whose prompts share part of a page with earlier bursts' and with each other's,
    then new prompts over a cache full of first pages."""
    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    a, b, c = tokens(300), tokens(40), tokens(600)
    d = a[:100] + tokens(200)
    return [
        [a, b, c],
        [
            d,  # 100 tokens of a's first page
            a[:290] + tokens(25),  # a's first page whole, 34 tokens of its second
            b[:30] + tokens(200),  # 30 of b's
            d[:150] + tokens(120),  # 150 of d's, a page written in this same loop
            a[:1] + tokens(300),  # one token: nothing taken
        ],
        [tokens(256) for _ in range(12)],
    ]


def test_exlq_generator_caches_and_generates_as_with_the_full_search(make_generator: Any) -> None:
    narrowed = make_generator(exlq=True, max_batch=16, prefill_batch_tokens=4096)
    history = _history(narrowed.tokenizer.get_vocab_size())
    got = [_run_jobs(narrowed, burst) for burst in history]
    full = make_generator(exlq=True, max_batch=16, prefill_batch_tokens=4096)
    full.narrow_page_search = False
    want = [_run_jobs(full, burst) for burst in history]
    print(f"\ncached prompt tokens per job: {[[c for c, _ in burst] for burst in want]}")
    assert got == want
    # The second burst took partial pages (a whole page found by its hash is not counted
    # here): 100 tokens of a's first page, 34 of its second, 30 of b's, 150 of a page the
    # same loop wrote, and none for a match of one token.
    assert [cached for cached, _ in want[1]] == [100, 34, 30, 150, 0]


def test_exllamav2_still_searches_pages_the_way_page_search_relies_on(cuda: None) -> None:
    from exllamav2.generator.dynamic import CachePage, ExLlamaV2DynamicJob

    source = inspect.getsource(ExLlamaV2DynamicJob.prefill)
    for line in (
        "if prefill_start == p0 * page_size:",
        "for page in self.generator.all_pages:",
        "if page.prev_hash != prev_hash or page == seq.allocated_pages[p0]:",
        "match = ext_c.count_match(page.sequence, prefill_ids, page.kv_position)",
        "if match > best_match:",
        "if best_match_page and best_match > 1:",
    ):
        assert line in source, f"exllamav2's page search changed: {line!r} is gone"
    # all_pages is read twice: by the search, and for unpaged mode's one page.
    assert source.count("all_pages") == 2
    assert {"sequence", "kv_position", "prev_hash", "phash"} <= set(CachePage.__dataclass_fields__)
