"""bench.engine_layers: the figures it reports and the order it runs its layers in."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from bench import engine_layers
from bench.engine_layers import Layers, Result, _figures, _with_fresh_cache


def _args(tmp_path: Path, layers: str = "bare,thread,process", repeats: int = 3) -> Any:
    return argparse.Namespace(
        model=tmp_path,
        cache_tokens=4096,
        max_batch_size=8,
        jobs="1",
        layers=layers,
        repeats=repeats,
        prompt_tokens=16,
        max_new_tokens=8,
        py_spy=None,
        cpu=None,
        keep_cache=False,
    )


def test_period_is_the_time_from_one_steps_end_to_the_next_over_the_decode_steps() -> None:
    # 16 steps: the first two (a run's first eighth: its prefills) are left out.
    ends = [0.0, 0.050] + [0.050 + 0.002 * i for i in range(1, 15)]
    steps = [0.040, 0.045] + [0.0015] * 14
    row = _figures("thread", 8, Result(elapsed=1.0, tokens=64, steps=steps, ends=ends))
    assert row["period_ms_median"] == pytest.approx(2.0)
    assert row["step_ms_median"] == pytest.approx(1.5)
    assert row["tok_s"] == pytest.approx(64.0)


def test_each_repeat_starts_one_layer_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_layers, "_requests", lambda *a: [])
    layers = Layers(_args(tmp_path))
    order: list[str] = []

    def run_of(name: str) -> Any:
        def run(requests: list[Any]) -> Result:
            order.append(name)
            return Result(1.0, 1, [0.001] * 8, [0.002 * i for i in range(8)])

        return run

    layers._batches(1, {name: run_of(name) for name in ("bare", "thread", "process")})
    timed = order[3:]  # after one warm-up run per layer
    assert timed == [
        *("bare", "thread", "process"),
        *("thread", "process", "bare"),
        *("process", "bare", "thread"),
    ]
    assert [r["repeat"] for r in layers.rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_summary_sets_each_run_against_the_bare_run_of_its_repeat(tmp_path: Path) -> None:
    layers = Layers(_args(tmp_path))
    for repeat, (bare, process) in enumerate([(2.0, 2.2), (3.0, 3.0), (1.0, 1.05)]):
        for layer, period in (("bare", bare), ("process", process)):
            layers.rows.append(
                {
                    "layer": layer,
                    "jobs": 1,
                    "repeat": repeat,
                    "tok_s": 100.0,
                    "step_ms_median": period,
                    "period_ms_median": period,
                }
            )
    summary = layers.summary()
    assert summary["process@1"]["period_vs_bare_median"] == pytest.approx(1.05)
    assert summary["process@1"]["period_ms_min"] == pytest.approx(1.05)
    assert "period_vs_bare_median" not in summary["bare@1"]


def test_an_in_process_run_starts_on_an_emptied_page_table() -> None:
    calls: list[str] = []

    class Generator:
        def reset_page_table(self) -> None:
            calls.append("reset")

    class Engine:
        generator = Generator()

    def run(requests: list[Any]) -> Result:
        calls.append("run")
        return Result(1.0, 0, [], [])

    fresh = _with_fresh_cache(Engine(), run)
    fresh([])
    fresh([])
    assert calls == ["reset", "run", "reset", "run"]


def test_an_unknown_layer_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown layers \\['threads'\\]: choose from bare"):
        Layers(_args(tmp_path, layers="bare,threads"))
