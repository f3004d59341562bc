"""A worker's heartbeat, as it lies in the queue's workers hash: JSON with ``last_seen``
(Unix seconds) among its fields. Read by the worker (dropping stale ones), the SDK (is the
queue served?) and the OpenAI gateway (/v1/models, 503 for a queue nobody serves)."""

from __future__ import annotations

import json
from collections.abc import Iterable


def last_seen(raw: bytes | str) -> float:
    """When the heartbeat was written; 0 for one that is not a heartbeat's JSON."""
    try:
        return float(json.loads(raw).get("last_seen", 0.0))
    except (ValueError, TypeError, AttributeError):
        return 0.0


def live_times(beats: Iterable[bytes | str], stale_after_s: float, now: float) -> list[float]:
    """The ``last_seen`` of each heartbeat no older than ``stale_after_s`` at ``now``."""
    oldest = now - stale_after_s
    return [seen for seen in map(last_seen, beats) if seen >= oldest]
