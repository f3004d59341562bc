"""The shipped dashboard and alert rules ask only for metrics the worker really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest

from exlq.worker.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
_METRIC = re.compile(r"\bexlq_[a-z_]+")
_SUFFIXES = ("_bucket", "_sum", "_count")


def exported_names() -> set[str]:
    metrics = Metrics("q")
    metrics.info("v", "echo", "m", {})
    metrics.job_completed("stop")
    metrics.job_failed("engine_error")
    text = generate_latest(metrics.registry).decode()
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_dashboard_and_alerts_use_exported_metrics() -> None:
    exported = {_base(n) for n in exported_names()}
    dashboard = json.loads((ROOT / "grafana/dashboards/exlq-overview.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    asked = {_base(m) for e in exprs for m in _METRIC.findall(e)}
    assert asked, "no exlq metrics found in the dashboard or rules"
    assert asked <= exported, f"not exported: {sorted(asked - exported)}"


def test_counters_end_in_total_and_carry_no_job_ids() -> None:
    names = exported_names()
    assert "exlq_jobs_received_total" in names
    assert "exlq_time_to_first_token_seconds_bucket" in names
    text = generate_latest(Metrics("q").registry).decode()
    assert "job_id" not in text and 'id="' not in text
