"""A deploy's canary phase: the first updated replica, back in rotation, gets
`canary_weight`% of new requests for `canary_duration_s`, then is compared with the
replicas still on the current version (`router.canary.compare`). The record's `canary`
is updated every second while it runs (`dpserve deploy` shows it); a failure raises
EngineAdminError("canary traffic", why) and the deploy rolls back.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from dpserve.rollout.engine_admin import EngineAdminError
from dpserve.rollout.progress import DeployOptions, DeployProgress
from dpserve.router.canary import CanarySplit, Thresholds, compare
from dpserve.router.pool import Replica, ReplicaState

TICK_S = 1.0


class Traffic(Protocol):
    """Where new requests are split (the router's dispatcher)."""

    canary: CanarySplit | None


async def run_canary(traffic: Traffic, replica: Replica, options: DeployOptions,
                     progress: DeployProgress) -> None:
    assert options.canary_weight is not None
    split = CanarySplit(replica.id, options.canary_weight)
    record: dict[str, Any] = {"replica": replica.id, "weight": options.canary_weight,
                              "duration_s": options.canary_duration_s, "elapsed_s": 0.0}
    progress.canary = record
    progress.event(f"{replica.id}: canary, {options.canary_weight:g}% of new requests for "
                   f"{options.canary_duration_s:g} s")
    t0 = time.monotonic()
    traffic.canary = split
    try:
        while (left := t0 + options.canary_duration_s - time.monotonic()) > 0:
            await asyncio.sleep(min(TICK_S, left))
            _update(record, split, time.monotonic() - t0)
            if replica.state is not ReplicaState.READY:
                raise EngineAdminError("canary traffic", f"the canary left rotation "
                                                         f"({replica.state.value})")
    finally:
        traffic.canary = None
    _update(record, split, time.monotonic() - t0)
    reason = compare(split, Thresholds(
        max_error_rate_delta=options.canary_max_error_rate_delta,
        max_ttft_ratio=options.canary_max_ttft_ratio,
        ttft_slack_ms=options.canary_ttft_slack_ms,
        min_requests=options.canary_min_requests))
    record["passed"] = reason is None
    progress.event(f"{replica.id}: canary {'passed' if reason is None else 'failed'}: "
                   f"canary {record['canary']}, others {record['others']}")
    if reason is not None:
        record["reason"] = reason
        raise EngineAdminError("canary traffic", reason)


def _update(record: dict[str, Any], split: CanarySplit, elapsed: float) -> None:
    record.update(elapsed_s=round(elapsed, 1), canary=split.canary.to_json(),
                  others=split.others.to_json())
