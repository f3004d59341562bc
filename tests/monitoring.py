"""What the shipped monitoring asks of the exporters: the metric names the Grafana dashboard
and the alert rules use, and an alert's expression evaluated by promtool on series scraped
from running processes (a promtool rule test whose input is the scrape, held constant)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ALERT_RULES = ROOT / "deploy/prometheus/alerts.yml"
DASHBOARD = ROOT / "grafana/dashboards/exlq-overview.json"
_METRIC = re.compile(r"\bexlq_[a-z_]+")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_info")

# A scrape: each sample's name, labels and value.
Sample = tuple[str, Mapping[str, str], float]


def family(name: str) -> str:
    """A sample's or a query's metric name without the suffixes the exposition adds."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def alert_expressions() -> dict[str, str]:
    rules = yaml.safe_load(ALERT_RULES.read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "alert" in r}


def names_used() -> set[str]:
    """The exlq metric families a dashboard panel, its template variables or an alert
    rule asks for."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    exprs += alert_expressions().values()
    return {family(m) for e in exprs for m in _METRIC.findall(e)}


def promtool() -> str:
    """promtool's path; a skip without it, unless EXLQ_REQUIRE_PROMTOOL=1 (CI) fails."""
    found = shutil.which("promtool")
    if found is not None:
        return found
    if os.environ.get("EXLQ_REQUIRE_PROMTOOL") == "1":
        pytest.fail("EXLQ_REQUIRE_PROMTOOL=1 and no promtool on PATH (apt-get install prometheus)")
    pytest.skip("promtool not installed (apt-get install prometheus)")


def _series(name: str, labels: Mapping[str, str]) -> str:
    inner = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def assert_alert_fires_for(
    alert: str, samples: Iterable[Sample], queues: set[str], tmp_path: Path
) -> None:
    """Assert that ``alert``'s expression (alerts.yml) is true on ``samples`` for exactly
    ``queues``, as Prometheus computes it: promtool evaluates ``count by (queue) (expr)``
    with the samples held for 15 minutes (so a ``for:`` has passed) and compares."""
    test: dict[str, Any] = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": _series(name, {**labels, "instance": "scraped"}),
                        "values": f"{v}x15",
                    }
                    for name, labels, v in samples
                ],
                "promql_expr_test": [
                    {
                        "expr": f"count by (queue) ({alert_expressions()[alert]})",
                        "eval_time": "10m",
                        "exp_samples": [
                            {"labels": f'{{queue="{q}"}}', "value": 1} for q in sorted(queues)
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "live_test.yml").write_text(yaml.safe_dump(test))
    done = subprocess.run(
        [promtool(), "test", "rules", "live_test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"{alert} on the scrape:\n{done.stdout}{done.stderr}"
