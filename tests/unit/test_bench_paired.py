"""bench.paired: each pair of runs gives one ratio; the table reports their median and range."""

from __future__ import annotations

from typing import Any

import pytest

from bench.paired import markdown, summarize


def _run(
    system: str,
    n: int,
    repeat: int,
    tok_s: float,
    ttft: float,
    build_ms: float = 0.0,
    step_ms: float = 2.0,
) -> dict[str, Any]:
    run = {
        "system": system,
        "concurrency": n,
        "repeat": repeat,
        "output_tokens_per_s": tok_s,
        "ttft_ms_p50": ttft,
        "step_ms_mean": step_ms,
    }
    if system == "exlq-engine":
        run["build_ms"] = build_ms
    return run


def test_ratios_are_taken_within_pairs_not_between_medians() -> None:
    runs = [
        # The machine drifts: pair 1 runs at half the speed of pair 0, in both systems.
        _run("exlq-engine", 8, 0, 1000.0, 20.0, build_ms=1.0),
        _run("exlq", 8, 0, 990.0, 23.0, step_ms=2.2),
        _run("exlq", 8, 1, 480.0, 30.0, step_ms=4.2),
        _run("exlq-engine", 8, 1, 500.0, 25.0, build_ms=3.0, step_ms=4.0),
        _run("exlq-engine", 8, 2, 800.0, 21.0, build_ms=2.0),
        _run("exlq", 8, 2, 800.0, 22.0),
        _run("exlq-engine", 1, 0, 400.0, 10.0),  # a pair left unfinished does not count
    ]
    [eight] = summarize(runs)
    assert eight["pairs"] == 3
    assert eight["ratios"] == pytest.approx([0.99, 0.96, 1.0])
    assert eight["ratio_median"] == 0.99
    assert (eight["ratio_min"], eight["ratio_max"]) == (0.96, 1.0)
    assert eight["pairs_at_or_above_0_97"] == 2
    assert eight["added_ttft_ms"] == [3.0, 5.0, 1.0]
    assert eight["added_ttft_ms_median"] == 3.0
    assert eight["engine_build_ms_median"] == 2.0  # inside the engine's TTFT
    assert eight["step_ratio_median"] == pytest.approx(1.05)  # 1.10, 1.05 and 1.00
    meta = {
        "gpu": "GPU",
        "date": "2026-11-23",
        "shape": "1b",
        "prompt_tokens": 256,
        "max_new_tokens": 128,
        "cache_tokens": 65536,
        "cpus": "all",
        "command": "python -m bench.paired",
    }
    table = markdown([eight], meta)
    assert "| 8 | 3 | 800 | 800 | 0.990 (0.96-1.00) | 2 of 3 | 21.0 | 2.0 | 3.0 | 1.050 |" in table
