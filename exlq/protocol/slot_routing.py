"""Connections that reach the Redis node serving a queue, on one Redis or a Redis Cluster.

Every key of a queue shares the hash tag ``{queue}``, so on a cluster one slot, and so one
master, holds them all: every command exlq sends for a queue can go to that node, scripts
and pipelines included, as to a single Redis. ``follow_slot(pool, key)`` makes the pool's
connections connect there. The first connection asks the URL's node whether it is part of
a cluster (``INFO cluster``); a plain Redis is used as the URL says, with nothing more
asked. On a cluster the master of ``key``'s slot comes from ``CLUSTER SLOTS``, and is asked
again whenever a connection to it fails or a node answers MOVED: after a failover, once
the replica has taken over, the next connection goes to it. Any node the cluster named
last time can answer that question, so the URL's own node may be the one that died.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from redis import ConnectionPool as SyncPool
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, BlockingConnectionPool, ConnectionPool
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

Address = tuple[str, int]
# How long one node may take to say where a slot is before the next node is asked.
PROBE_TIMEOUT_S = 5.0


class SlotMoved(RedisConnectionError):
    """The node answered that the queue's slot is served elsewhere (MOVED, ASK), or not at
    the moment (CLUSTERDOWN, TRYAGAIN). To every caller it is a connection to the wrong
    node: redis-py's retries and exlq's treat it as a lost connection, and the next one
    goes where the cluster says the slot is now."""


def masters_by_slot(reply: list[Any]) -> list[tuple[int, int, Address]]:
    """``CLUSTER SLOTS``' ranges and their masters: (first slot, last slot, address)."""
    ranges = []
    for first, last, master, *_ in reply:
        host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
        ranges.append((int(first), int(last), (host, int(master[1]))))
    return ranges


class SlotLocator:
    """Where the node serving one key's slot is now: the URL's own address on a plain
    Redis, the slot's master on a cluster. Shared by every connection of a pool."""

    def __init__(self, key: str, pool: ConnectionPool) -> None:
        self.slot = key_slot(key.encode())
        kwargs = pool.connection_kwargs
        self._seed: Address = (str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379)))
        self.base_class = _base_class(pool)
        self._pool = pool  # its connection_kwargs as they are at each probe (credentials)
        self.cluster: bool | None = None  # None: not asked yet
        self._address: Address | None = None
        self._known: list[Address] = [self._seed]
        self._masters: list[Address] = []
        self._lock = asyncio.Lock()

    async def address(self) -> Address:
        """Where a new connection should go."""
        if self._address is None:
            async with self._lock:
                if self._address is None:
                    self._address = await self._locate()
        return self._address

    def masters(self) -> list[Address]:
        """The cluster's masters, as its last answer named them."""
        return list(self._masters)

    def moved(self, address: Address) -> None:
        """A node answered MOVED: the slot is served at ``address`` now."""
        self.cluster = True
        if self._address != address:
            log.info("Redis Cluster: slot %d moved to %s:%d", self.slot, *address)
            self._address = address

    def lost(self) -> None:
        """A connection to the node failed: on a cluster, ask again where the slot is."""
        if self.cluster:
            self._address = None

    async def _locate(self) -> Address:
        errors: list[str] = []
        for node in dict.fromkeys([*self._known, self._seed]):
            try:
                return await self._ask_within(node)
            except (RedisError, OSError) as exc:
                if self.cluster is None:
                    raise  # the URL's node, asked first: its own error (refused, bad password)
                errors.append(f"{node[0]}:{node[1]}: {exc}")
        raise RedisConnectionError(
            f"no node of the Redis Cluster says where slot {self.slot} is: " + "; ".join(errors)
        )

    async def _ask_within(self, node: Address) -> Address:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):  # a dead host may never answer
                return await self._ask(node)
        except TimeoutError:
            raise RedisTimeoutError(
                f"{node[0]}:{node[1]} did not answer within {PROBE_TIMEOUT_S:g}s"
            ) from None

    async def _ask(self, node: Address) -> Address:
        kwargs = self._pool.connection_kwargs
        probe = self.base_class(**{**kwargs, "host": node[0], "port": node[1]})
        try:
            await probe.connect()  # type: ignore[no-untyped-call]
            if self.cluster is None:
                self.cluster = await _is_cluster(probe)
                if not self.cluster:
                    return node
            await probe.send_command("CLUSTER", "SLOTS")
            ranges = masters_by_slot(await probe.read_response())
        finally:
            await probe.disconnect()
        self._masters = list(dict.fromkeys(address for _, _, address in ranges))
        self._known = self._masters or self._known
        for first, last, address in ranges:
            if first <= self.slot <= last:
                return address
        raise ResponseError(f"{node[0]}:{node[1]} says no node serves slot {self.slot} now")


async def _is_cluster(probe: AbstractConnection) -> bool:
    """Whether the node is part of a Redis Cluster. A user the ACL denies INFO is taken to
    be on one Redis; on a cluster, MOVED answers still lead its connections (docs/SECURITY.md
    gives the rules a cluster's users need)."""
    await probe.send_command("INFO", "cluster")
    try:
        info = await probe.read_response()
    except ResponseError as exc:
        log.debug("INFO cluster refused (%s): taken for a single Redis", exc)
        return False
    return b"cluster_enabled:1" in _as_bytes(info)


def _as_bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class _FollowsSlot(AbstractConnection):
    """Put before a connection class: it connects where ``locator`` says, and tells it of
    a MOVED answer or a lost connection."""

    locator: ClassVar[SlotLocator]

    async def connect(self, *args: Any, **kwargs: Any) -> None:
        # Here, not in _connect, whose errors redis-py wraps: a refused password while
        # locating reads as itself.
        if not self.is_connected:
            self.host, self.port = await self.locator.address()
        await super().connect(*args, **kwargs)  # type: ignore[no-untyped-call]

    async def _connect(self) -> None:
        try:
            await super()._connect()  # type: ignore[safe-super,no-untyped-call]
        except OSError:
            self.locator.lost()
            raise

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except MovedError as exc:
            self.locator.moved((exc.host, int(exc.port)))
            raise SlotMoved(f"MOVED {exc} (slot {self.locator.slot})") from exc
        except (AskError, TryAgainError, ClusterDownError) as exc:
            # Mid-migration (ASK) or mid-failover: sent again, once the cluster has settled,
            # to the node it names then.
            self.locator.lost()
            raise SlotMoved(f"{type(exc).__name__}: {exc} (slot {self.locator.slot})") from exc
        except RedisConnectionError:
            self.locator.lost()
            raise


def follow_slot(pool: ConnectionPool, key: str) -> SlotLocator | None:
    """Make the connections ``pool`` opens from now on reach the node serving ``key``'s
    slot (the URL's node on a plain Redis); returns the pool's locator, or None for a
    pool of Unix-socket connections (one Redis on this host, never a cluster)."""
    if "path" in pool.connection_kwargs:
        return None
    locator = SlotLocator(key, pool)
    base = pool.connection_class
    pool.connection_class = type(
        f"{base.__name__}FollowsSlot", (_FollowsSlot, base), {"locator": locator}
    )
    return locator


async def cluster_masters(pool: ConnectionPool) -> list[Address] | None:
    """Every master of the Redis Cluster that ``pool``'s node belongs to; None for a
    single Redis (or a user the ACL denies INFO)."""
    locator = SlotLocator("", pool)
    await locator.address()
    return locator.masters() if locator.cluster else None


class SlotClients:
    """Clients for keys of many slots, made from one client: that client itself on a
    single Redis; on a Redis Cluster, one client per slot reaching the slot's master (the
    tools that read many queues: the exporter, top, the OpenAI gateway)."""

    def __init__(self, client: Redis) -> None:
        self.client = client
        self._cluster: bool | None = None
        self._by_slot: dict[int, Redis] = {}

    async def for_key(self, key: str) -> Redis:
        if self._cluster is None:
            self._cluster = await cluster_masters(self.client.connection_pool) is not None
        if not self._cluster:
            return self.client
        slot = key_slot(key.encode())
        own = self.client.connection_pool.connection_class
        if issubclass(own, _FollowsSlot) and own.locator.slot == slot:
            return self.client  # it reaches that slot's master already
        return self.following(key)

    def following(self, key: str) -> Redis:
        """A client whose connections reach ``key``'s node however the server turns out
        (on a single Redis, its only node), made without asking it: one per slot."""
        slot = key_slot(key.encode())
        found = self._by_slot.get(slot)
        if found is None:
            found = self._by_slot[slot] = Redis(connection_pool=_pool_like(self.client, key))
        return found

    async def scan_iter(self, match: str, count: int) -> AsyncIterator[bytes]:
        """SCAN of every master (of the one Redis, where it is not a cluster)."""
        masters = await cluster_masters(self.client.connection_pool)
        if masters is None:
            async for key in self.client.scan_iter(match=match, count=count):
                yield key
            return
        for host, port in masters:
            kwargs = {**self.client.connection_pool.connection_kwargs, "host": host, "port": port}
            node = Redis(connection_pool=ConnectionPool(**kwargs))
            try:
                async for key in node.scan_iter(match=match, count=count):
                    yield key
            finally:
                await node.aclose(close_connection_pool=True)

    async def aclose(self) -> None:
        for client in self._by_slot.values():
            await client.aclose(close_connection_pool=True)
        self._by_slot.clear()


def _pool_like(client: Redis, key: str) -> ConnectionPool:
    """A pool with ``client``'s settings (address, TLS, credentials), following ``key``'s
    slot."""
    pool = client.connection_pool
    made = ConnectionPool(connection_class=_base_class(pool), **pool.connection_kwargs)
    follow_slot(made, key)
    return made


def client_like(client: Redis, key: str) -> Redis:
    """A client with ``client``'s settings and a pool of its own of the same kind and size
    (a blocking pool stays one), reaching the node serving ``key``'s slot (a queue's other
    partition): on a single Redis, the same server."""
    pool = client.connection_pool
    options: dict[str, Any] = {"max_connections": pool.max_connections}
    if isinstance(pool, BlockingConnectionPool):
        options["timeout"] = pool.timeout
    made = type(pool)(connection_class=_base_class(pool), **options, **pool.connection_kwargs)
    follow_slot(made, key)
    return Redis(connection_pool=made)


def _base_class(pool: ConnectionPool) -> type[AbstractConnection]:
    """The pool's connection class as it was before it followed a slot."""
    cls: type[AbstractConnection] = pool.connection_class
    return cls.locator.base_class if issubclass(cls, _FollowsSlot) else cls


def slot_ranges(client: SyncRedis) -> list[tuple[int, int, Address]] | None:
    """(Synchronous.) ``CLUSTER SLOTS``' masters by range, where ``client``'s node is part
    of a Redis Cluster; None for a single Redis (or where INFO is denied)."""
    try:
        info = client.info("cluster")
    except ResponseError:
        return None
    if not info.get("cluster_enabled"):
        return None
    return masters_by_slot(client.execute_command("CLUSTER", "SLOTS"))  # type: ignore[no-untyped-call]


def masters_of(client: SyncRedis) -> list[Address] | None:
    """(Synchronous clients, for one-shot commands.) Every master of the Redis Cluster
    that ``client``'s node belongs to; None for a single Redis (or where INFO is denied)."""
    ranges = slot_ranges(client)
    return None if ranges is None else list(dict.fromkeys(a for _, _, a in ranges))


def node_client(client: SyncRedis, address: Address) -> SyncRedis:
    """(Synchronous.) A client with ``client``'s settings, of the node at ``address``."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "host": address[0], "port": address[1]}
    return SyncRedis(connection_pool=SyncPool(connection_class=pool.connection_class, **kwargs))


def slot_client(client: SyncRedis, key: str) -> SyncRedis:
    """(Synchronous.) A client of the node serving ``key``'s slot: on a single Redis,
    ``client`` itself; on a cluster, a new one (close it)."""
    ranges = slot_ranges(client)
    if ranges is None:
        return client
    slot = key_slot(key.encode())
    address = next(address for first, last, address in ranges if first <= slot <= last)
    return node_client(client, address)
