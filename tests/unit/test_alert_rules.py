"""The alert rules as Prometheus reads them: promtool checks the rules and the Prometheus
config, and runs the rules' unit tests (deploy/prometheus/tests/alerts_test.yml); and every
alert has a unit test in which it fires.

promtool comes with Debian's prometheus package (.ci/run installs it). Without it the
promtool tests skip, unless EXLQ_REQUIRE_PROMTOOL=1 (CI sets it) makes them fail."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.monitoring import promtool as find_promtool

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy/prometheus"
RULES = PROMETHEUS / "alerts.yml"
RULE_TESTS = PROMETHEUS / "tests/alerts_test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    return find_promtool()


def _run(args: list[str], cwd: Path) -> None:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout}{done.stderr}"


def test_promtool_accepts_the_alert_rules(promtool: str) -> None:
    _run([promtool, "check", "rules", str(RULES)], ROOT)


def test_the_alert_rules_pass_their_unit_tests(promtool: str) -> None:
    _run([promtool, "test", "rules", RULE_TESTS.name], RULE_TESTS.parent)


def test_promtool_accepts_the_prometheus_config(promtool: str, tmp_path: Path) -> None:
    """The config names the rules where the compose stack mounts them; checked here with
    the path pointed at the repository's file, as deploy/check.sh does."""
    config = (PROMETHEUS / "prometheus.yml").read_text()
    assert "/etc/prometheus/alerts.yml" in config
    (tmp_path / "alerts.yml").write_text(RULES.read_text())
    local = tmp_path / "prometheus.yml"
    local.write_text(config.replace("/etc/prometheus/alerts.yml", str(tmp_path / "alerts.yml")))
    _run([promtool, "check", "config", str(local)], tmp_path)


def test_every_alert_has_a_unit_test_in_which_it_fires() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts, "no alert rules found: the file's shape changed"
    assert not alerts - fired, f"alerts no unit test makes fire: {sorted(alerts - fired)}"
