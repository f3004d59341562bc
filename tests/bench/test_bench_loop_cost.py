"""bench.loop_cost: the engine loop against the bare engine, on the echo engine (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.loop_cost import main, markdown, summarize

pytestmark = pytest.mark.bench


def test_each_side_runs_every_job_to_its_end_and_the_loop_reports_its_shares(
    tmp_path: Path,
) -> None:
    out = tmp_path / "cost.json"
    argv = ["--engine", "echo", "--concurrency", "4", "--repeats", "2", "-p", "8", "-m", "6"]
    main([*argv, "--stepper-cpu", "-1", "--out", str(out)])
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert sorted((r["side"], r["repeat"]) for r in runs) == [
        ("bare", 0),
        ("bare", 1),
        ("loop", 0),
        ("loop", 1),
    ]
    for run in runs:  # 4 jobs of 6 tokens each, every one counted
        assert round(run["tok_s"] * run["wall_ms"] / 1000) == 24
    for run in (r for r in runs if r["side"] == "loop"):
        assert run["steps"] >= 6
        # Reports are written inside the wait or after a step: beyond step()'s own work.
        assert 0 < run["reports_pct"] <= run["loop_pct"] <= 100
        assert 0 <= run["wait_pct"] <= run["loop_pct"]
        assert "chunks_pct" not in run  # echo has no generator to set apart
    (summary,) = data["summary"]
    assert summary["concurrency"] == 4
    assert summary["loop_over_bare"] > 0


def test_the_summary_pairs_each_loop_run_with_the_same_repeat_of_each_other_side() -> None:
    runs = [
        {"side": "loop", "concurrency": 8, "repeat": 0, "tok_s": 90.0, "loop_pct": 3.0},
        {"side": "bare", "concurrency": 8, "repeat": 0, "tok_s": 100.0},
        {"side": "generator", "concurrency": 8, "repeat": 0, "tok_s": 120.0},
        {"side": "loop", "concurrency": 8, "repeat": 1, "tok_s": 200.0, "loop_pct": 5.0},
        {"side": "bare", "concurrency": 8, "repeat": 1, "tok_s": 200.0},
        {"side": "generator", "concurrency": 8, "repeat": 1, "tok_s": 160.0},
    ]
    (row,) = summarize(runs)
    assert row["loop_over_bare"] == pytest.approx((0.9 + 1.0) / 2)
    assert row["loop_over_generator"] == pytest.approx((0.75 + 1.25) / 2)
    assert row["loop_pct"] == pytest.approx(4.0)
    assert row["bare_tok_s"] == pytest.approx(150.0)
    table = markdown([row])
    assert "| 8 | 145 | 150 | 140 | 0.950 | 1.000 | 4.00 | - | - | - |" in table
