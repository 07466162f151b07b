"""A deploy's canary phase: the first updated replica, back in rotation, gets
`canary_weight`% of new requests for `canary_duration_s`, then is compared with a
baseline (`router.canary`): the replica updated next, still on the current version,
its prefix cache reset as the canary's window opens so that both start cold. The
record's `canary` is updated every second while it runs (`dpserve deploy` shows it); a
failure raises EngineAdminError("canary traffic", why) and the deploy rolls back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from dpserve.rollout.engine_admin import EngineAdminError
from dpserve.rollout.progress import DeployOptions, DeployProgress
from dpserve.router.fleet.pool import Replica, ReplicaState
from dpserve.router.routing.canary import (
    CanarySplit,
    Thresholds,
    baseline_weight,
    compare,
    reference,
)

TICK_S = 1.0

ResetCache = Callable[[Replica], Awaitable[None]]
"""Drops a replica's prefix cache (its running requests are recomputed, not failed)."""


class Traffic(Protocol):
    """Where new requests are split (the router's dispatcher)."""

    canary: CanarySplit | None


def pick_baseline(ready: Sequence[Replica], canary: Replica) -> Replica | None:
    """The first replica in rotation still on another version than the canary's: the
    one a rollout updates next, so the cache it loses now it would lose soon anyway."""
    return next((r for r in ready if r is not canary
                 and r.weight_version != canary.weight_version), None)


async def run_canary(traffic: Traffic, replica: Replica, options: DeployOptions,
                     progress: DeployProgress, *, ready: Sequence[Replica],
                     reset_cache: ResetCache) -> None:
    """`ready`: the replicas in rotation now, the canary among them."""
    weight = options.canary_weight
    assert weight is not None
    split = await _split(replica, weight, ready, reset_cache, progress)
    limits = Thresholds(max_error_rate_delta=options.canary_max_error_rate_delta,
                        max_ttft_ratio=options.canary_max_ttft_ratio,
                        ttft_slack_ms=options.canary_ttft_slack_ms,
                        min_requests=options.canary_min_requests)
    record: dict[str, Any] = {"replica": replica.id, "weight": weight,
                              "duration_s": options.canary_duration_s, "elapsed_s": 0.0}
    progress.canary = record
    progress.event(f"{replica.id}: canary, {weight:g}% of new requests for "
                   f"{options.canary_duration_s:g} s" + (
                       f", against the baseline {split.baseline_id} at "
                       f"{split.baseline_weight_pct:g}%, its prefix cache reset"
                       if split.baseline_id is not None else ""))
    t0 = time.monotonic()
    traffic.canary = split
    try:
        while (left := t0 + options.canary_duration_s - time.monotonic()) > 0:
            await asyncio.sleep(min(TICK_S, left))
            _update(record, split, limits, time.monotonic() - t0)
            if replica.state is not ReplicaState.READY:
                raise EngineAdminError("canary traffic", f"the canary left rotation "
                                                         f"({replica.state.value})")
    finally:
        traffic.canary = None
    _update(record, split, limits, time.monotonic() - t0)
    reason = compare(split, limits)
    record["passed"] = reason is None
    against, sample = reference(split, limits)
    progress.event(f"{replica.id}: canary {'passed' if reason is None else 'failed'}: "
                   f"canary {record['canary']}, {against} {sample.to_json()}")
    if reason is not None:
        record["reason"] = reason
        raise EngineAdminError("canary traffic", reason)


async def _split(replica: Replica, weight: float, ready: Sequence[Replica],
                 reset_cache: ResetCache, progress: DeployProgress) -> CanarySplit:
    baseline = pick_baseline(ready, replica)
    if baseline is None:
        return CanarySplit(replica.id, weight)
    try:
        await reset_cache(baseline)
    except EngineAdminError as exc:
        progress.event(f"{baseline.id}: not a baseline, its prefix cache was not reset "
                       f"({exc}); the canary is judged against the other replicas")
        return CanarySplit(replica.id, weight)
    return CanarySplit(replica.id, weight, baseline_id=baseline.id,
                       baseline_weight_pct=baseline_weight(weight, len(ready)))


def _update(record: dict[str, Any], split: CanarySplit, limits: Thresholds,
            elapsed: float) -> None:
    baseline = None if split.baseline_id is None else {
        "replica": split.baseline_id, "weight": split.baseline_weight_pct,
        **split.baseline.to_json()}
    record.update(elapsed_s=round(elapsed, 1), canary=split.canary.to_json(),
                  baseline=baseline, others=split.others.to_json(),
                  against=reference(split, limits)[0])
