"""bench.sdk_path measures the SDK's real path: one write per burst, every event received."""

from __future__ import annotations

import pytest

from bench import sdk_path

pytestmark = pytest.mark.integration


async def test_the_sdk_bench_times_every_burst_and_receives_every_event() -> None:
    result = await sdk_path.measure([1, 3], repeats=2, steps=4)
    assert result["submit_in_one_write"]
    assert [row["concurrency"] for row in result["submit"]] == [1, 3]
    for row in result["submit"]:
        assert 0 < row["submit_ms_p50_min"] <= row["submit_ms_p50"] <= row["submit_ms_p50_max"]
        assert row["submit_ms_p50"] <= row["submit_ms_last"]
    # Each job's token events and its done event, through JobHandle.stream().
    assert [row["events"] for row in result["events"]] == [5, 15]
    assert all(row["cpu_us_per_event"] > 0 for row in result["events"])
