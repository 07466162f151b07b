"""A deploy's canary phase: the first updated replica, back in rotation, gets
`canary_weight`% of new requests for `canary_duration_s`, then is compared with a
baseline (`router.canary`): the replica updated next, still on the current version,
its prefix cache reset as the canary's window opens so that both start cold. The
record's `canary` is updated every second while it runs (`dpserve deploy` shows it); a
failure raises EngineAdminError("canary traffic", why) and the deploy rolls back.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dpserve.rollout.engine_admin import EngineAdminError
from dpserve.rollout.progress import DeployOptions, DeployProgress
from dpserve.router.fleet.pool import Replica, ReplicaState
from dpserve.router.routing.canary import CanarySplit, baseline_weight
from dpserve.router.routing.canary_verdict import (
    NOT_WORSE,
    UNSURE,
    WORSE,
    Rule,
    Verdict,
    judge,
)

if TYPE_CHECKING:
    from dpserve.router.telemetry.metrics import RouterMetrics

TICK_S = 1.0
"""The record's counts are refreshed this often."""
LOOKS_PER_DURATION = 4

ResetCache = Callable[[Replica], Awaitable[None]]
"""Drops a replica's prefix cache (its running requests are recomputed, not failed)."""


class Traffic(Protocol):
    """Where new requests are split (the router's dispatcher)."""

    canary: CanarySplit | None


def pick_baseline(ready: Sequence[Replica], canary: Replica) -> Replica | None:
    """A replica in rotation still on another version than the canary's, one sharing
    the canary's device when there is one (CPU replicas on the same cores: the same
    neighbours, so what differs is the version), else the first: the one a rollout
    updates next, so the cache it loses now it would lose soon anyway."""
    others = [r for r in ready if r is not canary and r.weight_version != canary.weight_version]
    twins = [r for r in others if r.device == canary.device and r.device != "remote"]
    return next(iter(twins or others), None)


async def run_canary(traffic: Traffic, replica: Replica, options: DeployOptions,
                     progress: DeployProgress, *, ready: Sequence[Replica],
                     reset_cache: ResetCache, metrics: RouterMetrics | None = None) -> None:
    """`ready`: the replicas in rotation now, the canary among them."""
    weight = options.canary_weight
    assert weight is not None
    split = await _split(replica, weight, ready, reset_cache, progress)
    plan = window(options)
    rule = plan.rule
    record: dict[str, Any] = {"replica": replica.id, "weight": weight,
                              "duration_s": options.canary_duration_s,
                              "max_duration_s": plan.max_s, "confidence": rule.confidence,
                              "inconclusive_means": options.canary_inconclusive,
                              "elapsed_s": 0.0, "looks": 0}
    progress.canary = record
    progress.event(f"{replica.id}: canary, {weight:g}% of new requests for "
                   f"{options.canary_duration_s:g} s (up to {plan.max_s:g} s while unsure)"
                   + (f", against the baseline {split.baseline_id} at "
                      f"{split.baseline_weight_pct:g}%, its prefix cache reset"
                      if split.baseline_id is not None else ""))
    t0 = time.monotonic()
    traffic.canary = split
    verdict = None
    try:
        for look in range(1, rule.looks + 1):
            due = t0 + look * plan.every_s
            while (left := due - time.monotonic()) > 0:
                await asyncio.sleep(min(TICK_S, left))
                _update(record, split, time.monotonic() - t0)
                if replica.state is not ReplicaState.READY:
                    raise EngineAdminError("canary traffic", f"the canary left rotation "
                                                             f"({replica.state.value})")
            # Off the event loop: up to a million pairs partitioned (`canary_stats`).
            verdict = await asyncio.to_thread(judge, split.snapshot(), rule)
            record.update(looks=look, verdict=verdict.to_json(), against=verdict.against)
            if verdict.outcome != UNSURE:
                break
    finally:
        traffic.canary = None
    elapsed = time.monotonic() - t0
    _update(record, split, elapsed)
    assert verdict is not None  # at least one look
    outcome = {WORSE: "failed", NOT_WORSE: "passed"}.get(verdict.outcome, "inconclusive")
    passed = outcome == "passed" or (outcome == "inconclusive"
                                     and options.canary_inconclusive == "promote")
    reason = (verdict.describe(rule) + f" ({elapsed:.0f} s, {record['looks']} look"
              + ("s" if record["looks"] > 1 else "") + ")"
              + (f"; inconclusive means {options.canary_inconclusive}"
                 if outcome == "inconclusive" else ""))
    record.update(outcome=outcome, passed=passed, reason=reason)
    if metrics is not None:
        _export(metrics, verdict, outcome, passed)
    progress.event(f"{replica.id}: canary {outcome}"
                   + (f" ({'promoted' if passed else 'rolled back'})"
                      if outcome == "inconclusive" else "") + f": {reason}")
    if not passed:
        raise EngineAdminError("canary traffic", reason)


@dataclass(frozen=True)
class Window:
    rule: Rule
    every_s: float
    """Seconds between looks."""
    max_s: float


def window(options: DeployOptions) -> Window:
    """When a canary window is looked at, and the rule each look applies: a look every
    quarter of `canary_duration_s`, until `canary_max_duration_s` (default twice the
    duration) while the verdict is unsure."""
    every = options.canary_duration_s / LOOKS_PER_DURATION
    longest = options.canary_max_duration_s or 2 * options.canary_duration_s
    longest = max(longest, options.canary_duration_s)
    looks = max(1, math.ceil(longest / every - 1e-9))
    return Window(Rule(max_ttft_ratio=options.canary_max_ttft_ratio,
                       ttft_slack_ms=options.canary_ttft_slack_ms,
                       max_error_rate_delta=options.canary_max_error_rate_delta,
                       min_requests=options.canary_min_requests,
                       confidence=options.canary_confidence, looks=looks),
                  every_s=every, max_s=looks * every)


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


def _update(record: dict[str, Any], split: CanarySplit, elapsed: float) -> None:
    baseline = None if split.baseline_id is None else {
        "replica": split.baseline_id, "weight": split.baseline_weight_pct,
        **split.baseline.to_json()}
    record.update(elapsed_s=round(elapsed, 1), canary=split.canary.to_json(),
                  baseline=baseline, others=split.others.to_json())


def _export(metrics: RouterMetrics, verdict: Verdict, outcome: str, passed: bool) -> None:
    metrics.canary_windows.labels(outcome, "promoted" if passed else "rolled_back").inc()
    metrics.canary_last.clear()
    for check, c in (("ttft_ratio", verdict.ttft), ("error_rate_difference", verdict.errors)):
        if c.interval is not None:
            for bound in ("estimate", "low", "high"):
                metrics.canary_last.labels(check, bound).set(getattr(c.interval, bound))
    metrics.canary_last.labels("answers", "canary").set(verdict.ttft.canary_n)
    metrics.canary_last.labels("answers", "baseline").set(verdict.ttft.reference_n)
