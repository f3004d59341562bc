"""bench.idle_start: its summary per kind of gap, and its refusal of unknown kinds."""

from __future__ import annotations

import sys

import pytest

from bench import idle_start


def test_summary_is_per_kind_in_the_order_measured() -> None:
    rows = [
        {"kind": "sleep", "repeat": 0, "ttft_ms_p50": 14.0, "output_tokens_per_s": 400.0},
        {"kind": "none", "repeat": 0, "ttft_ms_p50": 12.0, "output_tokens_per_s": 450.0},
        {"kind": "sleep", "repeat": 1, "ttft_ms_p50": 16.0, "output_tokens_per_s": 420.0},
        {"kind": "none", "repeat": 1, "ttft_ms_p50": 11.0, "output_tokens_per_s": 470.0},
        {"kind": "sleep", "repeat": 2, "ttft_ms_p50": 30.0, "output_tokens_per_s": 300.0},
    ]
    summary = idle_start.summarize(rows)
    assert list(summary) == ["sleep", "none"]
    assert summary["sleep"] == {
        "runs": 3,
        "ttft_ms_median": 16.0,
        "ttft_ms_min": 14.0,
        "ttft_ms_max": 30.0,
        "tokens_per_s_median": 400.0,
    }
    assert summary["none"]["ttft_ms_median"] == 11.5


def test_an_unknown_kind_is_refused_before_anything_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["idle_start", "--kinds", "none,nap"])
    monkeypatch.setattr(idle_start, "measure", lambda args: pytest.fail("measured anyway"))
    with pytest.raises(SystemExit):
        idle_start.main()
    assert "unknown nap" in capsys.readouterr().err
