"""The prefill's search for a partially matching page, narrowed (exllamav2_page_search.py),
takes what exllamav2's search of every page takes, in exlq's generator; and the search it
narrows is still exllamav2's. tests/unit/test_page_search.py checks the narrowing itself
on random caches."""

from __future__ import annotations

import inspect
import random
from typing import Any

from tests.gpu.greedy import run_greedy


def _run_jobs(generator: Any, prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
    """The prompts as one burst, greedy, 6 new tokens each: each job's cached prompt tokens
    and its new tokens."""
    import torch

    jobs, tokens, _ = run_greedy(
        generator, [torch.tensor([ids]) for ids in prompts], [6] * len(prompts)
    )
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
