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


def _known_variables() -> set[str]:
    """Every EXLQ_* variable a worker reads: its settings' groups and each engine's."""
    from exlq.worker.engines.base import EngineUnavailable
    from exlq.worker.engines.registry import BUILTIN, find
    from exlq.worker.limits import RequestLimits
    from exlq.worker.settings import BrokerSettings, ServingSettings

    groups: list[type] = [BrokerSettings, ServingSettings, RequestLimits]
    for name in BUILTIN:
        try:
            groups.append(find(name).settings)
        except EngineUnavailable:  # an engine whose package is not installed here
            continue
    return {
        f"{group.model_config['env_prefix']}{field}".upper()  # type: ignore[attr-defined]
        for group in groups
        for field in group.model_fields  # type: ignore[attr-defined]
    }


def test_deploy_files_set_only_variables_a_worker_reads() -> None:
    known = _known_variables()
    configmap = yaml.safe_load((ROOT / "deploy/kubernetes/configmap.yaml").read_text())
    compose = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text())
    given = {name for name in configmap["data"] if name.startswith("EXLQ_")}
    for service in compose["services"].values():
        environment = service.get("environment") or {}
        given |= {name for name in environment if name.startswith("EXLQ_")}
    assert given, "no EXLQ_ variable found: the files' shape changed"
    assert given <= known, f"set but read by no worker: {sorted(given - known)}"
