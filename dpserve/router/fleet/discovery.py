"""Finding replicas through DNS: `dpserve router --discover dns://NAME:PORT`.

On Kubernetes the engine pods sit behind a headless Service, whose name
resolves to one A record per ready pod. Every `discover_interval_s` the name is
resolved again and the pool follows the records: a new address becomes a
replica (`starting`, until the health checks admit it), an address that is
gone leaves the pool (marked `down` first, so nothing new is sent to it;
requests already on it finish on their lease).

The decision is pure (:func:`diff`); the I/O is a resolver you can inject
(:data:`Resolver`), the real one being :func:`resolve_a_records`. A failed
lookup keeps the pool as it is: a DNS hiccup must not empty a serving fleet.
A name that does not exist (NXDOMAIN: a headless Service with no ready pod)
is an empty answer, not a failure.

A discovered replica's id is its `ADDRESS:PORT`, which is also what metrics
label it with; an engine pod restarted elsewhere comes back under a new id.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from dpserve.config import DnsTarget
from dpserve.router.fleet.pool import Replica, ReplicaPool

log = logging.getLogger("dpserve.discovery")

class LookupFailed(OSError):
    """The name could not be resolved now (timeout, server failure): try again later."""


def replica_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def replica_id(address: str, port: int) -> str:
    return f"{address}:{port}" if ":" not in address else f"[{address}]:{port}"


@dataclass(frozen=True)
class Change:
    """What to do to the pool so it matches one lookup."""

    added: dict[str, str]
    """New replicas, id -> URL, in address order."""
    removed: list[str]
    """Ids of discovered replicas whose address is no longer listed."""


def diff(discovered: Mapping[str, str], addresses: Iterable[str], port: int) -> Change:
    """Compare the replicas discovered so far (id -> URL) with one lookup's addresses.

    Pure: the same input gives the same change. Replicas given on the command line
    are not in `discovered` and so are never removed.
    """
    wanted = {replica_id(a, port): replica_url(a, port) for a in sorted(set(addresses))}
    added = {rid: url for rid, url in wanted.items() if rid not in discovered}
    removed = sorted(rid for rid in discovered if rid not in wanted)
    return Change(added, removed)


Resolver = Callable[[str], Awaitable[list[str]]]
"""`await resolver(name)` -> the name's IPv4 addresses; [] if the name does not
exist; raises LookupFailed when the answer is unknown (try again later)."""


async def resolve_a_records(name: str) -> list[str]:
    """The A records of `name`, through the system resolver (what the pod's
    /etc/resolv.conf names: the cluster DNS on Kubernetes)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(name, None, family=socket.AF_INET,
                                       type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise LookupFailed(f"{name}: {exc.strerror}") from None
    return sorted({str(info[4][0]) for info in infos})


class Discovery:
    """Keeps the pool in step with a DNS name. Owned by the router: `run` is its task."""

    def __init__(self, pool: ReplicaPool, target: DnsTarget, *, interval_s: float,
                 resolver: Resolver = resolve_a_records,
                 weight_version: Callable[[], str | None] = lambda: None) -> None:
        self._pool = pool
        self._target = target
        self._interval_s = interval_s
        self._resolver = resolver
        self._weight_version = weight_version
        self._discovered: dict[str, str] = {}

    @property
    def discovered(self) -> dict[str, str]:
        """Replicas this discovery added and still keeps: id -> URL."""
        return dict(self._discovered)

    async def run(self) -> None:
        """Re-resolve forever; cancel the task to stop."""
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh()

    async def refresh(self) -> Change | None:
        """Resolve once and apply the difference; None if the lookup failed."""
        try:
            addresses = await self._resolver(self._target.name)
        except (LookupFailed, OSError) as exc:
            log.warning("discovery %s: lookup failed (%s); keeping %d replica(s)",
                        self._target, exc, len(self._discovered))
            return None
        change = diff(self._discovered, addresses, self._target.port)
        for rid in change.removed:
            self._pool.remove(rid, f"{self._target.name} no longer lists it")
            del self._discovered[rid]
        for rid, url in change.added.items():
            if self._pool.get(rid) is not None:  # also given with --replica
                continue
            self._pool.add(Replica(id=rid, url=url, weight_version=self._weight_version()))
            self._discovered[rid] = url
            log.info("discovery %s: found replica %s", self._target, rid)
        return change
