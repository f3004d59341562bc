"""Batch: the writes of one or more engine steps (token events, and how entries end), in
the form the commit script takes (broker_scripts.COMMIT_LUA)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic_core import to_json

from exlq.protocol.keys import QueueKeys

# The most bytes of batch one script call carries. A larger batch goes as several calls,
# in order: Redis runs nothing else while a script runs, and a server that bounds one
# argument's size (proto-max-bulk-len, docs/SECURITY.md) refuses a larger one.
MAX_CALL_BYTES = 512 * 1024


@dataclass(frozen=True, slots=True)
class Final:
    """How one entry ends: its result, its last event, perhaps a dead-letter entry, the ack."""

    entry_id: str
    job_id: str | None = None
    state: str | None = None
    result_json: str | None = None
    channel: str | None = None
    event_json: str | None = None
    dead: dict[str, str] | None = None
    # Write the result and event only if the job's hash names this entry or no entry: a
    # malformed entry must not overwrite another entry's job of the same id.
    guard: bool = False
    # False for all but the last of several finals of one entry (a rejected entry that
    # names two ids answers both): the entry is acked once, and only while it is still
    # owned, so the others go before the one that acks it.
    ack: bool = True


@dataclass
class Batch:
    """Writes gathered from one or more engine steps, sent in one atomic script call.

    Token events go out first, in order. Each final is written only if this worker still
    owns the entry (a worker that lost its claim during an outage must not write a second
    result), and its result, final event and ack are written together. ``lease_until_ms``
    is the Redis time until which no other worker can have taken the batch's entries; past
    it, each event's entry is checked too (0: always checked)."""

    publishes: list[tuple[str, str, str]] = field(default_factory=list)
    finals: list[Final] = field(default_factory=list)
    lease_until_ms: int = 0
    # Names the batch in the commit marker, so that the batch sent again after a lost reply
    # is known there; the broker names it at its first send.
    name: str | None = None
    # What each call of the batch reported, by the call's name, once Redis answered it: a
    # batch written in several calls and sent again sends only the calls not answered.
    answered: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    # A partitioned queue's batch, as one batch per partition (partitions.PartitionedBroker),
    # kept so that the batch sent again sends each partition's own again.
    parts: dict[int, Batch] | None = None

    def publish(self, channel: str, event_json: str, entry_id: str) -> None:
        self.publishes.append((channel, event_json, entry_id))

    def finish(self, final: Final) -> None:
        self.finals.append(final)

    def __len__(self) -> int:
        return len(self.publishes) + len(self.finals)

    def halves(self) -> tuple[Batch, Batch]:
        """Two batches that, written in order, write what this one does: the events, then
        the finals; or each list cut in two."""
        lease, name = self.lease_until_ms, self.name
        if self.publishes and self.finals:
            cut_p, cut_f = len(self.publishes), 0
        else:
            cut_p, cut_f = len(self.publishes) // 2, len(self.finals) // 2
        return (
            Batch(self.publishes[:cut_p], self.finals[:cut_f], lease, f"{name}/0"),
            Batch(self.publishes[cut_p:], self.finals[cut_f:], lease, f"{name}/1"),
        )

    def encode(self, keys: QueueKeys) -> tuple[list[str], bytes]:
        """The script's KEYS after the jobs stream, dead stream, marker and batch lane's
        stream, and its batch argument (JSON, by pydantic's writer: faster than json.dumps
        for a step's token events)."""
        script_keys: list[str] = []
        finals = []
        for f in self.finals:
            # Absent, never null: cjson decodes null to a value Lua treats as true.
            final: dict[str, Any] = {"entry": f.entry_id}
            if f.job_id is not None:
                final["k"] = len(script_keys) + 5  # after the four fixed keys; Lua counts from 1
                script_keys += [keys.result(f.job_id), keys.job(f.job_id)]
            for name, value in (
                ("state", f.state),
                ("result", f.result_json),
                ("channel", f.channel),
                ("event", f.event_json),
                ("dead", _flat(f.dead)),
                ("guard", f.guard or None),
                ("noack", None if f.ack else True),
            ):
                if value is not None:
                    final[name] = value
            finals.append(final)
        body: dict[str, Any] = {}
        if self.publishes:
            body["publish"] = self.publishes
        if finals:
            body["finals"] = finals
        return script_keys, to_json(body)


def _flat(fields: dict[str, str] | None) -> list[str] | None:
    return None if fields is None else [x for pair in fields.items() for x in pair]
