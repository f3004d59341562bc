"""What the gateway benchmarks share: percentiles, the closing table, the JSON summary and
its header (host, CPUs, date, the command line)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import resource
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.sdk_path import cpu_model


def percentile_ms(samples_s: list[float], pct: int) -> float:
    """The ``pct``-th percentile of ``samples_s`` (seconds), in milliseconds; interpolated
    between the nearest samples (statistics.quantiles' inclusive method)."""
    if len(samples_s) == 1:
        return samples_s[0] * 1000
    return statistics.quantiles(samples_s, n=100, method="inclusive")[pct - 1] * 1000


def latency_row(samples_s: list[float]) -> dict[str, float]:
    return {
        "n": len(samples_s),
        "p50_ms": percentile_ms(samples_s, 50),
        "p99_ms": percentile_ms(samples_s, 99),
        "mean_ms": statistics.fmean(samples_s) * 1000,
    }


def raise_open_files_limit() -> int:
    """Thousands of streams need as many sockets in the client and in the gateway (a
    child inherits the limit): the soft limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def meta() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": dt.date.today().isoformat(),
        "command": "python -m " + shlex.join([_module_name(), *sys.argv[1:]]),
    }


def _module_name() -> str:
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem


def write_summary(out: str, name: str, result: dict[str, Any]) -> Path | None:
    """``result`` and the header as JSON in the folder ``out`` ('' writes none)."""
    if not out:
        return None
    header = meta()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{header['date']}-{name}.json"
    path.write_text(json.dumps({"meta": header, **result}, indent=2))
    return path


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A markdown table: numbers with two decimals, the rest as text."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "" if value is None else str(value)
