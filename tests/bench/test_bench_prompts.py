"""The bench's prompts: fixed per (seed, n), and never shared between concurrency points."""

from __future__ import annotations

import json
from pathlib import Path

from bench.baselines import FIRST_ORDINARY_ID, random_prompt_ids


def _model(tmp_path: Path, vocab: int = 5000) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return tmp_path


def test_prompts_repeat_for_the_same_seed_and_count(tmp_path: Path) -> None:
    model = _model(tmp_path)
    first = random_prompt_ids(model, 8, 64, seed=0)
    assert random_prompt_ids(model, 8, 64, seed=0) == first
    assert random_prompt_ids(model, 8, 64, seed=1) != first
    assert all(len(p) == 64 for p in first)
    assert all(FIRST_ORDINARY_ID <= t < 5000 for p in first for t in p)


def test_no_prompt_opens_like_another_within_or_across_points(tmp_path: Path) -> None:
    """A server that keeps its prefix cache between points (exlq's worker) must find no
    page of the next point's prompts cached: every prompt differs from its first token."""
    model = _model(tmp_path)
    prompts = [p for n in (1, 8, 32, 64) for p in random_prompt_ids(model, n, 32, seed=0)]
    openings = {tuple(p[:4]) for p in prompts}
    assert len(openings) == len(prompts) == 1 + 8 + 32 + 64
