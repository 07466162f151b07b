"""Requests for a LoRA adapter go where that adapter is already running.

An engine computes with at most `--max-loras` adapters at once: vLLM's scheduler
starts a waiting request only if its adapter is in the running batch or a slot is
free, and skips it otherwise (`vllm/v1/core/sched/scheduler.py`, 0.32). Spread
adapter requests without regard to their adapter and every replica serves every
adapter: its batch is split into turns, one per adapter, a request waits for its
adapter's turn, and the engine swaps adapters in and out of its slots.

:class:`AdapterAffinity` narrows the candidates before the configured policy
chooses among them, so prompts that start alike still share a replica within the
set the adapter prefers. In order, the first non-empty set of candidates under
the bounded-load cap (`load_factor` x the candidates' average in flight):

1. replicas where the adapter is **active**: a request for it is in flight there
   (the router's own count, exact), or the engine reported it running or waiting
   within `max_age_s` (requests from other routers; vLLM's
   `vllm:lora_requests_info`, the signal llm-d's LoRA-affinity scorer reads);
2. replicas with a **free slot**: fewer active adapters than the engine's
   `max_lora` (else the configured `max_loras`);
3. the replicas with the **least work of other adapters** in flight, which must
   drain before the adapter gets a slot.

The cap is what spreads a hot adapter: once its replicas carry more than their
share, its requests take a free slot elsewhere, and that replica becomes one
where it is active. Requests for the base model never wait for a slot and go to
the configured policy unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.policies.base import Policy, RequestInfo
from dpserve.router.routing.policies.recent_work import under_cap

ADAPTER_LOAD_FACTOR = 1.5
"""Default bound: a replica keeps an adapter's requests while its in-flight count is
under 1.5 x the average. At 2 or more, two replicas never spill: one replica holding
every request is exactly twice the average (benchmarks/routing/adapter.py)."""
ENGINE_REPORT_MAX_AGE_S = 3.0
"""An engine's adapter sets count for this long: a few scrapes at the default interval."""


class AdapterAffinity:
    """Adapter requests to replicas where their adapter is active; see the module."""

    def __init__(self, inner: Policy, *, max_loras: int,
                 load_factor: float = ADAPTER_LOAD_FACTOR,
                 max_age_s: float = ENGINE_REPORT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {load_factor}")
        self.inner = inner
        self.name = inner.name
        self.needs = inner.needs | {"engine_load"}
        self.max_loras = max_loras
        self.load_factor = load_factor
        self.max_age_s = max_age_s
        self._clock = clock
        self._wall_clock = wall_clock

    def active(self, replica: Replica) -> set[str]:
        """Adapters running or waiting on `replica`, as far as the router knows now."""
        names = set(replica.adapters_in_flight)
        load = replica.engine
        if (load is not None and load.lora_at is not None
                and replica.engine_scraped_at is not None
                and self._clock() - replica.engine_scraped_at <= self.max_age_s
                and self._wall_clock() - load.lora_at <= self.max_age_s):
            names |= load.lora_running or frozenset()
            names |= load.lora_waiting or frozenset()
        return names

    def slots(self, replica: Replica) -> int:
        """Adapters `replica` computes with at once."""
        load = replica.engine
        return load.max_loras if load is not None and load.max_loras else self.max_loras

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        adapter = request.adapter
        if adapter is None or len(candidates) < 2:
            return self.inner.select(candidates, request)
        return self.inner.select(self.preferred(candidates, adapter), request)

    def preferred(self, candidates: Sequence[Replica], adapter: str) -> list[Replica]:
        """The candidates a request for `adapter` should choose among; never empty when
        `candidates` is not."""
        open_ = under_cap(candidates, self.load_factor)
        active = {r.id: self.active(r) for r in open_}
        running = [r for r in open_ if adapter in active[r.id]]
        if running:
            return running
        free = [r for r in open_ if len(active[r.id]) < self.slots(r)]
        if free:
            return free
        ahead = {r.id: sum(r.adapters_in_flight.values()) for r in open_}
        least = min(ahead.values())
        return [r for r in open_ if ahead[r.id] == least]
