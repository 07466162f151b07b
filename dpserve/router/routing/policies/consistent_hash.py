"""Consistent hashing with bounded loads, shared by the affinity policies.

Affinity wants the same key (a session, a prompt prefix) on the same replica,
where vLLM's prefix cache already holds its KV blocks. Plain consistent hashing
gives that, and moves only ~1/N of the keys when a replica joins or leaves, but
one hot key can bury its replica. Bounded loads (Mirrokni, Thorup, Zadimoghaddam,
"Consistent Hashing with Bounded Loads", 2018) cap every replica at

    capacity = ceil(load_factor * (total in flight + 1) / replicas)

(the `+ 1` is the request being placed) and walk the ring clockwise from the
key to the first replica whose load is under the cap. Some replica is always
under it, since the average is. The cost of the cap is locality at low load:
with 4 replicas and nothing in flight the cap is 1, so a second concurrent
request for the same key already goes to the next replica — which then caches
the prefix too. A larger `load_factor` trades balance for locality.
:class:`~dpserve.router.routing.policies.recent_work.RecentWork` uses the same cap.

Hashes come from blake2b, never Python's `hash()`: a key must map to the same
replica in every router process and after every restart.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence

from dpserve.router.fleet.pool import Replica

DEFAULT_VNODES = 160
"""Points per replica on the ring: with 160, each replica's share of the keys is
within about 10% of the mean (the spread shrinks as 1/sqrt(vnodes))."""
DEFAULT_LOAD_FACTOR = 2.0
"""1 + epsilon of the paper: no replica takes more than twice the average load. Tighter
bounds spill hot keys onto replicas that must cache them too: with 32 tenants on 8
simulated replicas, 1.25 lost 5-10 points of prefix-cache hit rate
(benchmarks/routing/README.md)."""


def stable_hash(text: str) -> int:
    """64-bit hash of `text`, the same on every machine and in every process."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def capacity(total_in_flight: int, replicas: int, load_factor: float) -> int:
    """Most requests one replica may hold once the new one is placed."""
    # The small subtraction keeps float error from rounding an exact quotient up
    # (1.1 * 10 is 11.000000000000002 in binary floating point).
    return math.ceil(load_factor * (total_in_flight + 1) / replicas - 1e-9)


class HashRing:
    """Replica ids placed at `vnodes` pseudo-random points each on a 64-bit ring."""

    def __init__(self, ids: Iterable[str], *, vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.ids = frozenset(ids)
        points = sorted((stable_hash(f"{rid}#{i}"), rid) for rid in self.ids
                        for i in range(vnodes))
        self._positions = [p for p, _ in points]
        self._owners = [rid for _, rid in points]

    def walk(self, key_hash: int) -> Iterator[str]:
        """Every id once, in clockwise order from `key_hash`'s position."""
        n = len(self._positions)
        start = bisect.bisect_left(self._positions, key_hash)
        seen: set[str] = set()
        for k in range(n):
            rid = self._owners[(start + k) % n]
            if rid not in seen:
                seen.add(rid)
                yield rid
                if len(seen) == len(self.ids):
                    return


class BoundedLoadHash:
    """Place a key on a replica by consistent hashing with bounded loads.

    The ring is cached and rebuilt only when a candidate appears that it does
    not hold. Candidates missing from it (a replica that is down, or already
    tried by this request) are skipped during the walk, which gives exactly
    the answer a ring built without them would; the next rebuild drops them.
    Load is the router's in-flight count.
    """

    def __init__(self, *, load_factor: float = DEFAULT_LOAD_FACTOR,
                 vnodes: int = DEFAULT_VNODES) -> None:
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {load_factor}")
        self.load_factor = load_factor
        self._vnodes = vnodes
        self._ring = HashRing((), vnodes=vnodes)

    def select(self, candidates: Sequence[Replica], key: str) -> Replica | None:
        if not candidates:
            return None
        by_id = {r.id: r for r in candidates}
        if not by_id.keys() <= self._ring.ids:
            self._ring = HashRing(by_id, vnodes=self._vnodes)
        cap = capacity(sum(r.in_flight for r in candidates), len(candidates), self.load_factor)
        for rid in self._ring.walk(stable_hash(key)):
            replica = by_id.get(rid)
            if replica is not None and replica.in_flight < cap:
                return replica
        # Not reached: the least-loaded replica is at or below the average, under the cap.
        return min(candidates, key=lambda r: r.in_flight)
