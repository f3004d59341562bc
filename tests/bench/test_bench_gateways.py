"""The gateway benchmarks at tiny sizes (--quick), so that the scripts keep working: every
client's timed requests come back whole, every stream of every step completes, the batch
completes while interactive requests are timed, and the JSON summary is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gateway_bench, lanes_bench
from bench.figures import write_summary

pytestmark = pytest.mark.integration


def test_the_gateway_bench_times_every_client_and_holds_every_stream(tmp_path: Path) -> None:
    args = gateway_bench.parse_args(["--quick", "--out", str(tmp_path)])
    result = gateway_bench.run(args)
    clients = result["overhead"]["clients"]
    assert list(clients) == list(gateway_bench.CLIENTS)
    for row in clients.values():
        assert row["n"] == args.requests
        assert 0 < row["p50_ms"] <= row["p99_ms"]
    assert clients["sdk"]["added_p50_ms"] == 0
    for name in gateway_bench.GATEWAYS:
        found = result["streams"]["gateways"][name]
        assert [run["streams"] for run in found["runs"]] == args.steps
        for run in found["runs"]:
            assert (run["completed"], run["errors"]) == (run["streams"], 0), run["error_samples"]
            assert run["peak_open"] == run["streams"]
            assert run["gateway"]["rss_mib_peak"] > 0
        assert found["largest_without_errors"]["streams"] == max(args.steps)
    path = write_summary(str(tmp_path), "gateway-bench", result)
    assert path is not None
    assert json.loads(path.read_text())["meta"]["cpus"] > 0


def test_the_lanes_bench_times_interactive_requests_during_a_whole_batch() -> None:
    args = lanes_bench.parse_args(["--quick", "--out", ""])
    result = lanes_bench.run(args)
    assert list(result["reserves"]) == ["default", "0"]
    for found in result["reserves"].values():
        for client in lanes_bench.Interactive.CLIENTS:
            assert found["idle"][client]["n"] == args.interactive
            assert found["during_batch"][client]["n"] >= 1
        batch = found["batch"]
        assert batch["status"] == "completed"
        assert batch["completed"] == batch["total"] == args.batch_requests
        assert batch["failed"] == 0 and batch["requests_per_s"] > 0
