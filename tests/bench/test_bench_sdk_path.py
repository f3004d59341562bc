"""bench.sdk_path measures the SDK's real path: one write per burst, every event received."""

from __future__ import annotations

import pytest

from bench import sdk_path
from exlq.producer import submit_batch

pytestmark = pytest.mark.integration


async def test_the_sdk_bench_times_every_burst_and_receives_every_event() -> None:
    result = await sdk_path.measure([1, 3], repeats=2, steps=4)
    assert result["submit_in_one_write"]
    rows = result["submit"]
    modes = 2 if submit_batch.EAGER_SEND else 1  # with and without full pieces written at once
    assert [row["concurrency"] for row in rows] == [1] * modes + [3] * modes
    for row in rows:
        assert 0 < row["submit_ms_p50_min"] <= row["submit_ms_p50"] <= row["submit_ms_p50_max"]
        assert row["submit_ms_p50"] <= row["submit_ms_last"]
        # Entries land before submit() returns (their ids count whole milliseconds).
        assert row["first_entry_landed_ms"] <= row["last_entry_landed_ms"]
        assert row["last_entry_landed_ms"] <= row["submit_ms_last"] + 1
    # Each job's token events and its done event, through JobHandle.stream().
    assert [row["events"] for row in result["events"]] == [5, 15]
    assert all(row["cpu_us_per_event"] > 0 for row in result["events"])
