"""Converging the replicas on one set of weights, replica by replica: one deploy's work.

`Rollout` (dpserve.rollout.rollout) decides: it takes the lock, validates, keeps
the history. A `Convergence` does: for one deploy it moves batch after batch of
replicas onto the target weights (`forward`), and on failure moves every replica
not known to serve the previous weights back (`rollback`). See rollout.py's
docstring for the steps per replica and why each is there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import httpx

from dpserve.rollout import quality
from dpserve.rollout.canary_phase import Traffic, run_canary
from dpserve.rollout.deployed import Weights
from dpserve.rollout.engine_admin import EngineAdmin, EngineAdminError
from dpserve.rollout.progress import DeployOptions, DeployProgress, Phase, ReplicaProgress
from dpserve.router.fleet.adapters import VERSION_SEP
from dpserve.router.fleet.live import LiveStreams
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState

if TYPE_CHECKING:
    from dpserve.rollout.quality import Gate
    from dpserve.router.telemetry.metrics import RouterMetrics

_POLL_S = 0.05


class Restarter(Protocol):
    """What the supervisor offers the rollout (absent in router-only mode)."""

    def launched(self, replica_id: str) -> tuple[int, str | None]:
        """(processes started so far for the replica, version the latest was started on)."""
        ...

    async def restart(self, replica_id: str, reason: str) -> None:
        """Stop the replica's process; the supervisor starts it on `deployed.current`."""
        ...


class _StepFailed(Exception):
    """A replica could not be converged; already recorded in the progress."""


class _Untouched(Exception):
    """A replica failed before anything about it changed (its pre-check canary)."""


EVICTED_LEAVE_S = 5.0
"""How long the streams moved off a drained replica may take to leave it."""


class Convergence:
    """One deploy's convergence of the replicas; `forward`, then `rollback` on failure.

    `hot_loading` is shared with the Rollout: the replicas being hot-loaded now, whose
    pause is this router's own. `lock_lost` says why the deploy lock was lost, if it
    was: the next batch does not start then.
    """

    def __init__(self, pool: ReplicaPool, progress: DeployProgress, options: DeployOptions,
                 client: httpx.AsyncClient, *, restarter: Restarter | None,
                 metrics: RouterMetrics | None, reload_timeout_s: float,
                 hot_loading: set[str], lock_lost: Callable[[], str | None],
                 gate: Gate | None = None, traffic: Traffic | None = None,
                 streams: LiveStreams | None = None) -> None:
        self.pool = pool
        self._streams = streams
        """The router's migratable streams: moved off a replica drained past its deadline."""
        self._gate = gate
        self._traffic = traffic if options.canary_weight is not None else None
        """Split for the first replica updated, once it serves again (`canary_phase`)."""
        """Scored on the first replica updated, before it re-enters rotation."""
        self.progress = progress
        self.options = options
        self.client = client
        self._restarter = restarter
        self._metrics = metrics
        self._reload_timeout_s = reload_timeout_s
        self._hot_loading = hot_loading
        self._lock_lost = lock_lost
        self.failed: set[str] = set()
        """Replicas whose hot-load failed in this deploy: what they serve is unknown."""
        self.poisoned: set[str] = set()
        """Replicas that computed NaN/inf: restart them, never trust a reload."""
        self.touched: dict[str, int] = {}
        """Replica -> its process generation when this deploy first paused it: a process
        started later is a fresh one (the supervisor restarted it), not the one we touched."""

    async def forward(self, target: Weights) -> str | None:
        """Converge batch after batch; the first error message, or None."""
        replicas = list(self.pool)
        # With a quality gate or a canary, the first replica goes alone: no other of the
        # new version serves before it passed.
        first = (1 if self._gate is not None or self._traffic is not None
                 else self.options.batch)
        starts = [0, *range(first, len(replicas), self.options.batch)]
        for i, end in zip(starts, [*starts[1:], len(replicas)], strict=True):
            if self._lock_lost() is not None:
                return f"the deploy lock was lost ({self._lock_lost()}); stopped"
            group = replicas[i:end]
            ids = {r.id for r in group}
            results = await asyncio.gather(
                *(self._converge(r, target, ids, rollback=False) for r in group),
                return_exceptions=True)
            errors = [str(e) or repr(e) for e in results if isinstance(e, BaseException)]
            if errors:
                return errors[0]
        return None

    async def rollback(self, previous: Weights) -> bool:
        """Converge every replica not known to serve `previous`; True if all are (or are
        being restarted on it)."""
        ok = True
        for replica in list(self.pool):
            if (replica.weight_version == previous.version and replica.id not in self.failed
                    and replica.id not in self.poisoned):
                continue
            try:
                await self._converge(replica, previous, {replica.id}, rollback=True)
            except _StepFailed:
                ok = False
        return ok

    async def _converge(self, replica: Replica, weights: Weights,
                        batch: set[str], *, rollback: bool) -> None:
        """Make `replica` serve `weights`, or raise _StepFailed (recorded)."""
        rp = self.progress.replica(replica.id)
        if replica.id in self.poisoned:
            await self._recover(replica, weights, "it computed NaN or infinity",
                                since=self.touched.get(replica.id))
            return
        if replica.id not in self.failed:  # a failed one's weights are unknown: reload
            if replica.weight_version == weights.version:
                if not rollback:
                    rp.phase, rp.version, rp.note = Phase.SKIPPED, weights.version, "serving it"
                return
            if replica.state in (ReplicaState.DOWN, ReplicaState.STARTING):
                if self._restarter is not None:
                    await self._recover(replica, weights, f"it is {replica.state.value}")
                    return
                await self._wait_ready(replica)
                if replica.weight_version == weights.version:
                    rp.phase, rp.version, rp.note = Phase.SKIPPED, weights.version, "serving it"
                    return
        try:
            await self._hot_load(replica, weights, batch, rollback=rollback)
        except Exception as exc:
            if not isinstance(exc, _Untouched):
                self.failed.add(replica.id)
            if isinstance(exc, EngineAdminError) and exc.non_finite:
                self.poisoned.add(replica.id)
            rp.phase, rp.error = Phase.FAILED, f"{exc}"
            self.progress.event(f"{replica.id}: {exc}", level=logging.WARNING)
            self._count_reload(replica, "failed")
            if rollback:
                await self._recover(replica, weights, f"{exc}",
                                    since=self.touched.get(replica.id))
                return
            raise _StepFailed(f"{replica.id}: {exc}") from None
        self.failed.discard(replica.id)
        rp.phase = Phase.ROLLED_BACK if rollback else Phase.DONE
        self._count_reload(replica, "rolled_back" if rollback else "succeeded", rp.seconds)
        self.progress.event(f"{replica.id}: serving {weights.version} after {rp.seconds:.2f} s")

    def _count_reload(self, replica: Replica, outcome: str, seconds: float | None = None
                      ) -> None:
        if self._metrics is not None:
            self._metrics.replica_reloads.labels(replica.id, outcome).inc()
            if seconds is not None:
                self._metrics.replica_reload_duration.observe(seconds)

    async def _hot_load(self, replica: Replica, weights: Weights,
                        batch: set[str], *, rollback: bool) -> None:
        """Drain (if another replica can take the traffic), pause, reload, reset the
        prefix cache, resume, canary, name the version, re-admit. Raises on any error,
        leaving the replica out of rotation (or, alone, in it) for the rollback."""
        self._hot_loading.add(replica.id)
        try:
            await self._hot_load_steps(replica, weights, batch, rollback=rollback)
        finally:
            self._hot_loading.discard(replica.id)

    async def _hot_load_steps(self, replica: Replica, weights: Weights,
                              batch: set[str], *, rollback: bool) -> None:
        rp = self.progress.replica(replica.id)
        reason = f"deploy {self.progress.id}"
        admin_drained = (replica.state is ReplicaState.DRAINING
                         and replica.id not in self.failed)
        if self._restarter is not None:
            self.touched.setdefault(replica.id, self._restarter.launched(replica.id)[0])
        admin = EngineAdmin(self.client, replica.url, reload_timeout_s=self._reload_timeout_s)
        model, steps = canary_model(replica), rp.steps
        if replica.id not in self.failed:
            # The canary on the old weights first, while the replica still serves: one that
            # cannot pass fails here, before anything changes. It costs milliseconds: the
            # engine's one-time set-up of this path was paid by its warm-up (`admit`).
            rp.phase = Phase.PRECHECK
            try:
                await _timed(steps, "precheck", admin.canary(model, self.options.canary_prompt))
            except EngineAdminError as exc:
                raise _Untouched(f"before reloading, on the old weights: {exc}") from None
        started = time.monotonic()
        strict = self.options.no_mixed_versions and not rollback
        if any(r.id not in batch and r is not replica for r in self.pool.ready()):
            if replica.state is ReplicaState.READY:
                rp.phase = Phase.DRAINING
                self.pool.set_state(replica, ReplicaState.DRAINING, reason)
            if replica.state is ReplicaState.DRAINING:
                idle = await self.pool.wait_idle(replica, self.options.drain_deadline_s)
                if not idle and self._streams is not None:
                    idle = await self._move_streams(replica, rp, strict)
                if strict and not idle:
                    if not admin_drained:
                        self.pool.set_state(replica, ReplicaState.READY,
                                            f"{reason}: not reloaded")
                    raise _Untouched(
                        f"{replica.in_flight} request(s) still in flight after "
                        f"{self.options.drain_deadline_s:g} s of draining; no_mixed_versions "
                        "keeps them off the new weights (raise drain_wait_s)")
                self.pool.set_state(replica, ReplicaState.RELOADING, reason)
        elif strict:  # alone, it keeps serving: what it runs when paused would mix
            raise _Untouched("no other replica is ready to serve while it drains, so "
                             "requests would begin on the old weights and end on the new "
                             "(no_mixed_versions)")
        # else it stays in rotation: requests queue in the paused engine instead of a 503
        rp.phase = Phase.RELOADING
        steps["drain"] = round(time.monotonic() - started, 4)
        rp.mixed += replica.in_flight  # frozen by the pause, resumed on the new weights
        await _timed(steps, "pause", admin.pause())
        await _timed(steps, "reload", admin.reload_weights(weights.path))
        await _timed(steps, "reset_prefix_cache", admin.reset_prefix_cache())
        await _timed(steps, "resume", admin.resume())
        rp.phase = Phase.CANARY
        await _timed(steps, "canary", admin.canary(model, self.options.canary_prompt))
        if self._gate is not None and not rollback:
            gate, self._gate = self._gate, None  # once, on the first replica updated
            await _timed(steps, "eval", self._evaluate(gate, replica, model))
        await _timed(steps, "update_weight_version", admin.set_weight_version(weights.version))
        replica.weight_version = weights.version
        if replica.state is not ReplicaState.READY:
            self.pool.set_state(replica, ReplicaState.DRAINING if admin_drained
                                 else ReplicaState.READY, f"{reason}: serving {weights.version}")
        rp.version, rp.seconds = weights.version, round(time.monotonic() - started, 3)
        if self._traffic is not None and not rollback and replica.state is ReplicaState.READY:
            traffic, self._traffic = self._traffic, None  # once, on the first replica
            await run_canary(traffic, replica, self.options, self.progress,
                             ready=self.pool.ready(), reset_cache=self._reset_cache,
                             metrics=self._metrics)

    async def _reset_cache(self, replica: Replica) -> None:
        """A canary's baseline starts cold like the canary (`canary_phase`)."""
        await EngineAdmin(self.client, replica.url,
                          reload_timeout_s=self._reload_timeout_s).reset_prefix_cache()

    async def _move_streams(self, replica: Replica, rp: ReplicaProgress, strict: bool) -> bool:
        """Move the streams still on a drained replica to others; whether it is idle
        then. Moved to a replica on other weights, a stream mixes versions: counted,
        and not done at all under no_mixed_versions."""
        same = any(r is not replica and r.weight_version == replica.weight_version
                   for r in self.pool.ready())
        if strict and not same:
            return False
        assert self._streams is not None
        staying = replica.in_flight
        moved = self._streams.evict(replica.id)
        rp.migrated, rp.restarted = moved.migrating, moved.restarting
        if not same:  # a restarted stream runs wholly on one version: it mixes none
            rp.mixed += moved.migrating
        if not moved:
            return False
        # Wait for the moved ones to leave, not for the rest: under no_mixed_versions
        # nothing may stay; otherwise what stays is frozen by the pause, as without a move.
        await self.pool.wait_idle(replica, EVICTED_LEAVE_S, poll_s=0.01,  # out of rotation
                                  at_most=0 if strict else max(0, staying - moved.total))
        return replica.in_flight == 0

    async def _evaluate(self, gate: Gate, replica: Replica, model: str) -> None:
        """Score the eval set on `replica` (updated, out of rotation) and, for the
        comparison, on a replica still serving the current version; EngineAdminError
        ("gate") if the gate fails. The scores go in the record either way."""
        record: dict[str, object] = {"eval_data": gate.eval_data, "metric": gate.metric}
        self.progress.quality = record
        t0 = time.monotonic()
        candidate = [await quality.score(self.client, replica.url, model, gate.cases,
                                         logprobs=gate.logprobs)
                     for _ in range(gate.repeats)]
        record["candidate"] = quality.Score.mean(candidate).to_json()
        current = comparison = None
        if gate.vs_current:
            on_current = [r for r in self.pool.ready()
                          if r.weight_version == self.progress.previous_version]
            if not on_current:
                raise EngineAdminError("gate", "no ready replica serves the current version "
                                               "to compare the new one with")
            current = [await quality.score(self.client, on_current[0].url,
                                           canary_model(on_current[0]), gate.cases,
                                           logprobs=gate.logprobs)
                       for _ in range(gate.repeats)]
            record["current"] = quality.Score.mean(current).to_json()
            comparison = gate.compare(candidate, current)
            record["comparison"] = comparison.to_json(gate.margin)
        if self._metrics is not None:
            self._metrics.deploy_eval_score.clear()
            for of, runs in (("candidate", candidate), ("current", current)):
                for metric in quality.METRICS:
                    got = None if runs is None else quality.Score.mean(runs).metric(metric)
                    if got is not None:
                        self._metrics.deploy_eval_score.labels(metric, of).set(got)
        reason = gate.verdict(candidate, comparison) if gate.gates else None
        record["seconds"] = round(time.monotonic() - t0, 3)
        if gate.gates:
            record["passed"] = reason is None
        scored = quality.Score.mean(candidate)
        self.progress.event(f"{replica.id}: eval {scored.describe(gate.metric)}"
                            + (f", current {quality.Score.mean(current).describe(gate.metric)}"
                               if current else "")
                            + (f", difference {comparison.describe()}" if comparison else "")
                            + ("" if not gate.gates else ": passed" if reason is None
                               else ": failed"))
        if reason is not None:
            record["reason"] = reason
            raise EngineAdminError("gate", reason)

    async def _recover(self, replica: Replica, weights: Weights, why: str, *,
                       since: int | None = None) -> None:
        """Bring back a replica that cannot (or must not) be reloaded by restarting it on
        `weights`, unless a process started after generation `since` (any, if None) is
        already on them. Without a supervisor: hold it out of rotation, raise _StepFailed."""
        rp = self.progress.replica(replica.id)
        self.poisoned.discard(replica.id)
        if self._restarter is None:
            replica.weight_version = None
            self.pool.set_state(replica, ReplicaState.DRAINING, "deploy failed")
            replica.last_error = (f"deploy {self.progress.id} could not restore it ({why}); "
                                  "restart this engine, then undrain it")
            rp.phase, rp.error = Phase.FAILED, replica.last_error
            raise _StepFailed(f"{replica.id}: {replica.last_error}")
        count, version = self._restarter.launched(replica.id)
        if replica.state not in (ReplicaState.DOWN, ReplicaState.STARTING):
            self.pool.set_state(replica, ReplicaState.DOWN, f"deploy: {why}")
        if version == weights.version and (since is None or count > since):
            rp.note = f"{why}; the supervisor is starting it on {weights.version}"
        else:
            rp.note = f"{why}; restarting it on {weights.version}"
            await self._restarter.restart(replica.id, rp.note)
        rp.phase = Phase.RESTARTING
        self.progress.event(f"{replica.id}: {rp.note}")

    async def _wait_ready(self, replica: Replica) -> None:
        rp = self.progress.replica(replica.id)
        rp.note = f"waiting for it to be ready (it is {replica.state.value})"
        deadline = time.monotonic() + self.options.ready_timeout_s
        while replica.state is not ReplicaState.READY:
            if time.monotonic() > deadline:
                rp.phase = Phase.FAILED
                rp.error = f"not ready within {self.options.ready_timeout_s:g} s"
                raise _StepFailed(f"{replica.id}: {rp.error}")
            await asyncio.sleep(_POLL_S * 4)
        rp.note = None


async def _timed(steps: dict[str, float], name: str, step: Awaitable[object]) -> None:
    t0 = time.monotonic()
    await step
    steps[name] = round(time.monotonic() - t0, 4)


def canary_model(replica: Replica) -> str:
    """The base model's name for the canary: the engine also lists the LoRA adapter
    versions it holds (`NAME@VERSION`), which are not the weights being checked (and
    may be unloaded while the canary runs)."""
    if not replica.models:
        raise EngineAdminError("canary", "the replica has not reported a model name")
    base = sorted(m for m in replica.models if VERSION_SEP not in m)
    return (base or sorted(replica.models))[0]
