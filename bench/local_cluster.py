"""A real Redis Cluster on loopback, for the tests and the capacity bench: masters and
their replicas, each a redis-server >= 7 on a free port (Debian's, which CI installs;
EXLQ_CLUSTER_REDIS_SERVER names another), joined with CLUSTER MEET, the slots shared out
with CLUSTER ADDSLOTSRANGE and each replica attached with CLUSTER REPLICATE. A master can
be killed, and its replica takes over after the node timeout, as in production."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import redis

from exlq.worker.embedded_redis import free_port, server_version

HOST = "127.0.0.1"
SLOTS = 16384
MIN_VERSION = (7, 0)  # CLUSTER ADDSLOTSRANGE, CLUSTER SHARDS, sharded pub/sub
# How long a master may be unreachable before its replica takes over: short, so that a
# failover test waits about two seconds, as a production cluster of 15 s would wait more.
NODE_TIMEOUT_MS = 1000


def find_cluster_server() -> str | None:
    """EXLQ_CLUSTER_REDIS_SERVER, else a redis-server >= 7: the TLS tests' (Debian's, in
    CI), or one on PATH or in /usr/bin."""
    configured = os.environ.get("EXLQ_CLUSTER_REDIS_SERVER")
    tls = os.environ.get("EXLQ_TLS_REDIS_SERVER")
    on_path = shutil.which("redis-server")
    candidates = [configured] if configured else [tls, on_path, "/usr/bin/redis-server"]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            version = server_version(candidate)
            if version is not None and version >= MIN_VERSION:
                return candidate
    return None


def distinct_free_ports(count: int, take: Callable[[], int] = free_port) -> list[int]:
    """``count`` ports free now and all different: the system may hand the same free port
    out twice while no server has bound it yet, and two nodes on one port cannot both start."""
    ports: list[int] = []
    for _ in range(100 * count):
        if len(ports) == count:
            break
        port = take()
        if port not in ports:
            ports.append(port)
    if len(ports) < count:
        raise RuntimeError(f"found {len(ports)} different free ports of the {count} asked for")
    return ports


@dataclass
class Node:
    port: int
    bus_port: int
    process: subprocess.Popen[bytes]
    node_id: str = ""

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        return redis.Redis(
            host=HOST, port=self.port, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class LocalCluster:
    """``masters`` masters, each with ``replicas`` replicas; started by ``start()``."""

    binary: str
    masters: int = 3
    replicas: int = 1
    nodes: list[Node] = field(default_factory=list)
    _dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """An ordinary URL of one live node, as a user would give it."""
        node = next(node for node in self.nodes if node.alive)
        return f"redis://{HOST}:{node.port}/0"

    def masters_now(self) -> list[Node]:
        """The live nodes that are masters now (a failover changes which)."""
        return [
            node
            for node in self.nodes
            if node.alive and node.client().info("replication").get("role") == "master"
        ]

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        self._dir = tempfile.TemporaryDirectory(prefix="exlq-cluster-")
        count = self.masters * (1 + self.replicas)
        ports = distinct_free_ports(2 * count)
        for port, bus_port in zip(ports[:count], ports[count:], strict=True):
            self.nodes.append(self._start_node(Path(self._dir.name), port, bus_port))
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            node.node_id = _wait_for(partial(_my_id, node), deadline).decode()
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER", "MEET", HOST, node.port, node.bus_port
            )
        per_master = SLOTS // self.masters
        for i, node in enumerate(self.nodes[: self.masters]):
            low = i * per_master
            high = SLOTS - 1 if i == self.masters - 1 else low + per_master - 1
            node.client().execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER", "ADDSLOTSRANGE", low, high
            )
        for i, replica in enumerate(self.nodes[self.masters :]):
            master = self.nodes[i % self.masters]
            # A replica must know its master before it can follow it.
            _wait_for(partial(_knows, replica, master.node_id), deadline)
            replica.client().cluster("replicate", master.node_id)
        self.wait_healthy(deadline - time.monotonic())
        return self

    def _start_node(self, root: Path, port: int, bus_port: int) -> Node:
        folder = root / str(port)
        folder.mkdir()
        return Node(port, bus_port, self._run(folder, port, bus_port))

    def restart(self, node: Node) -> None:
        """Start a killed node again on its port and its nodes.conf: it rejoins the cluster
        (a killed master comes back as its successor's replica)."""
        assert self._dir is not None and not node.alive
        node.process = self._run(Path(self._dir.name) / str(node.port), node.port, node.bus_port)
        _wait_for(lambda: node.client().ping(), time.monotonic() + 30)

    def _run(self, folder: Path, port: int, bus_port: int) -> subprocess.Popen[bytes]:
        command = [
            self.binary,
            "--port", str(port),
            "--bind", HOST,
            "--dir", str(folder),
            "--cluster-enabled", "yes",
            # The bus on a free port of its own, not port + 10000 (which may be past 65535).
            "--cluster-port", str(bus_port),
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
            "--save", "",
            "--appendonly", "no",
        ]  # fmt: skip
        log = (folder / "log").open("ab")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return process

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and every slot is served, and
        every live replica's link to its master is up and in sync."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            if node.alive:
                _wait_for(partial(_healthy, node), deadline)

    def master_of(self, slot: int) -> Node:
        """The node that serves ``slot`` now, as the live nodes see it."""
        for node in self.nodes:
            if not node.alive:
                continue
            slots = node.client().execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
            for low, high, master, *_ in slots:
                if low <= slot <= high:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no live node serves slot {slot}")

    def flush(self) -> None:
        """Empty every live master (their replicas follow)."""
        for node in self.masters_now():
            node.client().flushall()

    def kill(self, node: Node) -> None:
        """Kill ``node`` at once (SIGKILL: no goodbye to the cluster)."""
        node.process.kill()
        node.process.wait()

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive:
                node.process.terminate()
        for node in self.nodes:
            try:
                node.process.wait(10)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()
        if self._dir is not None:
            self._dir.cleanup()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()  # the nodes that did start, and their folder
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _my_id(node: Node) -> Any:
    return node.client().cluster("myid")


def _knows(node: Node, node_id: str) -> bool:
    nodes = node.client().cluster("nodes")
    return node_id in (nodes.decode() if isinstance(nodes, bytes) else str(nodes))


def _healthy(node: Node) -> bool:
    info = node.client().cluster("info")
    if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != SLOTS:
        return False
    replication = node.client().info("replication")
    if replication.get("role") == "master":  # each replica it has is in sync (WAIT counts it)
        links = [v for k, v in replication.items() if k.startswith("slave") and k[5:].isdigit()]
        return all(link.get("state") == "online" for link in links)
    return replication.get("master_link_status") == "up"


def _wait_for(check: Callable[[], Any], deadline: float) -> Any:
    """``check()``'s first truthy value, retried (connection refused included) until
    ``deadline``."""
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"the local Redis Cluster did not get ready: {last}")
