"""The rolling hot-load: one replica (or `batch` of them) at a time, never all at once.

Per replica::

    canary (old weights, still serving) ─▶ drain in the router ─▶ pause(keep)
        ─▶ reload_weights ─▶ reset_prefix_cache ─▶ resume ─▶ canary
        ─▶ update_weight_version ─▶ back into rotation

Why drain *and* pause. `pause(mode=keep)` alone fails no request: in-flight
ones freeze, new ones queue inside the engine. But requests queued there wait
for the reload and the canary, then run on weights nobody checked yet.
Draining first sends new requests to replicas that can answer now, at no
capacity cost (a paused engine serves nothing anyway). Waiting for in-flight
requests to end before pausing is *not* needed for zero failures — frozen
requests are preempted by the cache reset and recomputed on the new weights —
and would keep the replica out as long as the longest generation. The record
counts, per replica, the requests in flight when it was paused (`mixed_versions`:
their responses may straddle two checkpoints); `no_mixed_versions` waits for them
(`drain_wait_s`, default 600 s) and fails the deploy rather than pause a busy
replica. Streams the router can migrate (`dpserve.router.migration.migrator`) do not wait
for the pause: at the drain deadline they move to another replica, on the same
weights when one serves (`migrated_streams`), and any stream still waiting for its
first chunk starts over on another replica; only the moved ones are waited for.
With no other replica ready nothing is drained: queueing for the reload beats
answering 503.

Failure. Any step error stops the rollout after the current batch;
`deployed.current` goes back to the previous weights, and every replica not
serving them is converged back the same way. A replica that cannot be reloaded
is restarted by the supervisor on the previous weights; one that computed NaN
or infinity is always restarted, because non-finite values written to its KV
cache memory survive a reload (seen on vLLM 0.32 CPU). Without a supervisor
(`dpserve router`) such a replica is held out of rotation (`draining`) with
its error, for an operator.

Replicas down or starting at their turn: under a supervisor they are (re)started
on `deployed.current`, so the rollout restarts any that was launched on other
weights and moves on; without one it waits for them (`ready_timeout_s`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from dpserve.checkpoint import CheckpointMeta
from dpserve.httpclient import shared_or_new
from dpserve.rollout import quality
from dpserve.rollout.adapter_deploy import AdapterDeploys
from dpserve.rollout.admin_threads import AdminThreads
from dpserve.rollout.canary_phase import Traffic
from dpserve.rollout.converge import Convergence, Restarter
from dpserve.rollout.deployed import (
    Deployed,
    Weights,
    checkpoint_weights,
    point_deployed_link,
)
from dpserve.rollout.engine_admin import RELOAD_TIMEOUT_S
from dpserve.rollout.lease import Lease
from dpserve.rollout.lock import DeployLock, LockHeld
from dpserve.rollout.progress import (
    DeployOptions,
    DeployProgress,
    DeployState,
    ReplicaProgress,
)
from dpserve.rollout.snapshot import SnapshotStore
from dpserve.rollout.validate import Refused, adapter_as_weights, is_adapter, named_as
from dpserve.rollout.validate_proc import Checker, Job, take_snapshot
from dpserve.router.fleet.adapters import AdapterVersion
from dpserve.router.fleet.live import LiveStreams
from dpserve.router.fleet.pool import Replica, ReplicaPool

if TYPE_CHECKING:
    from dpserve.router.telemetry.metrics import RouterMetrics

log = logging.getLogger("dpserve.rollout")

HISTORY = 20


class Rollout:
    """Owns the deploy lock (one deploy at a time) and the recent deploys' records."""

    def __init__(self, pool: ReplicaPool, deployed: Deployed | None, *,
                 snapshots: SnapshotStore | None = None,
                 checkpoint_root: Path | None = None,
                 lock: DeployLock | None = None,
                 deployed_link: str | None = None,
                 restarter: Restarter | None = None,
                 metrics: RouterMetrics | None = None,
                 reload_timeout_s: float = RELOAD_TIMEOUT_S,
                 client: httpx.AsyncClient | None = None,
                 adapters: AdapterDeploys | None = None) -> None:
        """`snapshots`: where checkpoints are copied before they are checked (without one,
        deploys are refused). `checkpoint_root`: deployable checkpoints lie inside it
        (default: the served model's parent). `lock`: held (shared by every router) for
        the whole of each deploy. `deployed_link`: a symlink pointed at each checkpoint
        whose deploy succeeded (see point_link). `client`: to the engines, closed by
        `aclose` (None: one per deploy)."""
        self._pool = pool
        self._metrics = metrics
        self._deployed = deployed
        self._snapshots = snapshots
        self._checkpoint_root = checkpoint_root
        self._lock = lock
        self.deployed_link = deployed_link
        self._restarter = restarter
        self._reload_timeout_s = reload_timeout_s
        self._client = client
        self.adapters = adapters
        """Adapter deploys (`start(..., name=)`); None: the router serves none."""
        self._history: collections.OrderedDict[str, DeployProgress] = collections.OrderedDict()
        self._active: DeployProgress | None = None
        self._task: asyncio.Task[None] | None = None
        self._hot_loading: set[str] = set()
        self._checker = Checker()
        self._admin = AdminThreads()
        self.traffic: Traffic | None = None
        """Where canary traffic is split (the router's dispatcher; set by `compose`)."""
        self.streams: LiveStreams | None = None
        """The router's migratable streams (set by `compose`)."""
        self._recent: collections.deque[str] = collections.deque(maxlen=2)
        """Snapshots most recently deployed (kept by the store's prune for rollbacks)."""

    def hot_loading(self, replica: Replica) -> bool:
        """Whether this router's deploy is hot-loading `replica` now (its pause is ours)."""
        return replica.id in self._hot_loading

    @property
    def deployed(self) -> Deployed | None:
        return self._deployed

    def deployed_version(self) -> str | None:
        """What a replica should serve now (None: the served model is not known)."""
        return self._deployed.current.version if self._deployed is not None else None

    def get(self, deploy_id: str) -> DeployProgress | None:
        return self._history.get(deploy_id)

    def latest(self) -> DeployProgress | None:
        """The deploy in progress, else the last one."""
        return next(reversed(self._history.values()), None)

    async def start(self, checkpoint: str, options: DeployOptions, *,
                    name: str | None = None) -> DeployProgress:
        """Validate `checkpoint` (Refused on any problem, nothing changed), then start
        rolling it out in the background and return its progress record. With `name`,
        `checkpoint` is a LoRA adapter to serve as model `name` beside the base."""
        if name is not None:
            if self.adapters is None:
                raise Refused(409, "this router serves no LoRA adapters: start it with "
                                   "--enable-lora", param="name")
            self.adapters.check_request(name, self._pool.reported_models())
        self._refuse_if_busy()
        if self._deployed is None:
            raise Refused(409, "this router does not know which model its replicas serve, "
                               "so it cannot check a checkpoint against it: start "
                               "`dpserve router` with --base-model DIR")
        if name is None and self.adapters is not None and self.adapters.adapters.names() \
                and not options.drop_adapters:
            if await asyncio.to_thread(is_adapter, checkpoint):  # the 422 that says --name
                raise adapter_as_weights(checkpoint)
            served = ", ".join(sorted(self.adapters.adapters.names()))
            raise Refused(409, f"LoRA adapters serve on the current weights ({served}); they "
                               "were trained on them, not on this checkpoint. Deploy with "
                               "--drop-adapters (\"drop_adapters\": true) to stop serving "
                               "them first", param="drop_adapters")
        n = len(self._pool)
        options.check_fleet(n, adapter=name is not None)
        if options.canary_weight is not None and self.traffic is None:
            raise Refused(409, "this rollout has no router to split traffic with",
                          param="canary_weight")
        if self._snapshots is None:
            raise Refused(409, "this router has no snapshot store to copy checkpoints into "
                               "before checking them: start `dpserve router` with "
                               "--snapshot-dir DIR on storage every engine can read")
        gate = None
        if name is None and options.eval_data is not None:
            gate = await self._admin.run(
                quality.gate_for, options, replicas=n, root=self._root(),
                lora=self.adapters is not None and self.adapters.enabled)
            self._refuse_if_busy()  # another request may have started one meanwhile
        deploy_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        lease = Lease(self._lock, executor=self._admin.executor)
        try:
            await lease.take(deploy_id)
        except LockHeld as exc:
            raise Refused(409, str(exc)) from None
        progress = DeployProgress(id=deploy_id, checkpoint=checkpoint, options=asdict(options))
        self._active = progress
        self._history[progress.id] = progress
        while len(self._history) > HISTORY:
            self._history.popitem(last=False)
        lease.keep(progress)
        progress.event(f"validating {checkpoint}")
        try:
            target: Weights | AdapterVersion = (
                await self._validate(Path(checkpoint)) if name is None else
                await self._admin.run(self._validate_adapter, name, Path(checkpoint)))
            if lease.lost is not None:
                raise Refused(409, f"the deploy lock was lost while validating "
                                   f"({lease.lost}); nothing was changed")
        except Exception as exc:
            refused = isinstance(exc, Refused)
            progress.finish(DeployState.REFUSED if refused else DeployState.FAILED,
                            exc.message if isinstance(exc, Refused)
                            else f"validation crashed: {exc!r}")
            await lease.end()
            await self._admin.run(self._prune_snapshots)
            raise
        progress.version = target.version
        progress.snapshot = target.path
        progress.replicas = [ReplicaProgress(r.id, from_version=r.weight_version)
                             for r in self._pool]
        progress.state = DeployState.ROLLING
        if isinstance(target, AdapterVersion):
            current = self.adapters.adapters.current(target.name) if self.adapters else None
            progress.adapter = target.name
            progress.previous_version = current.version if current is not None else None
            work = self._deploy_adapter(progress, target, lease)
        else:
            progress.previous_version = self._deployed.current.version
            if options.drop_adapters and self.adapters is not None:
                for version in self.adapters.withdraw_all():
                    progress.event(f"adapter {version.name} no longer served (was "
                                   f"{version.version}); unloaded once its requests end")
            work = self._deploy(progress, target, options, lease, gate)
        self._task = asyncio.create_task(work, name=f"dpserve-deploy-{progress.id}")
        return progress

    async def prepare(self) -> None:
        """Start the process that checks checkpoints, before a deploy needs it (each
        deploy would otherwise pay its start-up while the engines keep the cores busy).
        A failure is logged; the first deploy tries again."""
        if self._snapshots is not None:
            try:
                await self._checker.start()
            except OSError as exc:
                log.warning("cannot start the checkpoint-checking process yet: %s", exc)

    async def wait(self) -> None:
        """Until the deploy in progress (if any) has ended."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def aclose(self) -> None:
        """Stop the deploy in progress, the checking process, the client, and the admin
        threads: not waited for, as one stuck on storage would hold up the shutdown."""
        if self.adapters is not None:
            await self.adapters.aclose()
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._checker.aclose()
        if self._client is not None:
            await self._client.aclose()
        self._admin.close()

    def _refuse_if_busy(self) -> None:
        """Refused (409) while a deploy runs: one deploy at a time."""
        if self._active is not None and not self._active.done:
            raise Refused(409, f"deploy {self._active.id} of {self._active.checkpoint} is "
                               "in progress; one deploy at a time")

    async def _validate(self, ckpt_dir: Path) -> Weights:
        """Snapshot the checkpoint into the store, then check the snapshot: what passes is
        what the engines will load, byte for byte. In a child process
        (`validate_proc`): it reads every byte, and the router's loop keeps its GIL."""
        assert self._deployed is not None and self._snapshots is not None
        snapshot, meta = await self._checker.check(Job(
            checkpoint=str(ckpt_dir), within=str(self._root()),
            base=self._deployed.base.path, store=str(self._snapshots.root)))
        weights = checkpoint_weights(snapshot, meta)
        if self.adapters is not None:
            self.adapters.know_weights(weights.path, meta)
        return weights

    def _take_snapshot(self, ckpt_dir: Path) -> tuple[Path, CheckpointMeta]:
        """Copy `ckpt_dir` (inside the checkpoint root) into the store, checking its
        manifest and every file's sha256 on the way. Refused (403, 422) otherwise."""
        assert self._snapshots is not None
        return take_snapshot(self._snapshots, ckpt_dir, within=self._root())

    def _root(self) -> Path:
        """Where deployable checkpoints lie: --checkpoint-root, else the model's parent."""
        assert self._deployed is not None
        return self._checkpoint_root or Path(self._deployed.base.path).parent

    def check_adapter(self, checkpoint: str, name: str, served_names: frozenset[str]) -> None:
        """What a deploy of adapter `checkpoint` (relative to the working directory) as
        `name` checks before it changes anything (blocking: copies and hashes); Refused
        on a problem. `dpserve serve --lora` runs it
        before it starts a replica; the deploy reuses the snapshot taken."""
        if self.adapters is None or self._deployed is None or self._snapshots is None:
            raise Refused(409, "this router serves no LoRA adapters: start it with "
                               "--enable-lora", param="name")
        self.adapters.check_request(name, served_names)
        self._validate_adapter(name, Path(checkpoint).absolute())

    def _validate_adapter(self, name: str, ckpt_dir: Path) -> AdapterVersion:
        """Snapshot an adapter checkpoint, then check it against the weights served now."""
        assert self.adapters is not None and self._deployed is not None
        served = Path(self._deployed.current.path)
        if not served.is_dir():
            raise Refused(409, f"the served model {served} is not a local directory, so an "
                               "adapter cannot be checked against it")
        snapshot, meta = self._take_snapshot(ckpt_dir)
        with named_as(snapshot, ckpt_dir):
            return self.adapters.validate(name, snapshot, meta, served_weights=served)

    async def _deploy_adapter(self, progress: DeployProgress, target: AdapterVersion,
                              lease: Lease) -> None:
        assert self.adapters is not None
        try:
            state = await self.adapters.run(progress, target)
            self._finish(progress, state, progress.error)
        except asyncio.CancelledError:
            self._finish(progress, DeployState.FAILED, "cancelled: the router is shutting down")
            raise
        except Exception as exc:
            log.exception("deploy %s crashed", progress.id)
            self._finish(progress, DeployState.FAILED, f"internal error: {exc!r}")
        finally:
            await lease.end()
            await self._admin.run(self._prune_snapshots)

    async def _deploy(self, progress: DeployProgress, target: Weights,
                   options: DeployOptions, lease: Lease,
                   gate: quality.Gate | None) -> None:
        assert self._deployed is not None
        previous = self._deployed.current
        self._deployed.current = target  # replicas (re)started from now on load the target
        progress.event(f"rolling out {target.version} (was {previous.version}) to "
                       f"{len(self._pool)} replica(s), {options.batch} at a time")
        try:
            async with shared_or_new(self._client) as client:
                convergence = Convergence(
                    self._pool, progress, options, client, restarter=self._restarter,
                    metrics=self._metrics, reload_timeout_s=self._reload_timeout_s,
                    hot_loading=self._hot_loading, lock_lost=lambda: lease.lost,
                    gate=gate, traffic=self.traffic, streams=self.streams)
                error = await convergence.forward(target)
                if error is None:
                    if self.deployed_link is not None:
                        await point_deployed_link(Path(self.deployed_link), target.path,
                                                  progress, executor=self._admin.executor)
                    self._recent.append(target.path)
                    self._finish(progress, DeployState.SUCCEEDED)
                    return
                self._deployed.current = previous
                progress.error = error
                progress.state = DeployState.ROLLING_BACK
                progress.event(f"rolling back to {previous.version}", level=logging.WARNING)
                ok = await convergence.rollback(previous)
                self._finish(progress, DeployState.ROLLED_BACK if ok else DeployState.FAILED)
        except asyncio.CancelledError:
            self._finish(progress, DeployState.FAILED, "cancelled: the router is shutting down")
            raise
        except Exception as exc:
            log.exception("deploy %s crashed", progress.id)
            self._deployed.current = previous
            self._finish(progress, DeployState.FAILED, f"internal error: {exc!r}")
        finally:
            await lease.end()
            await self._admin.run(self._prune_snapshots)

    def _prune_snapshots(self) -> None:
        """Delete snapshots nothing needs: not what replicas should serve, not the last
        deploys' (rollbacks), not the deployed link's target (other routers' engines)."""
        assert self._snapshots is not None and self._deployed is not None
        in_use = [self._deployed.current.path, self._deployed.base.path, *self._recent,
                  *(self.adapters.in_use() if self.adapters is not None else ())]
        if self.deployed_link is not None:
            in_use.append(self.deployed_link)
        try:
            for path in self._snapshots.prune(in_use):
                log.info("removed snapshot %s", path)
        except OSError as exc:
            log.warning("could not prune the snapshot store %s: %s", self._snapshots.root, exc)

    def _finish(self, progress: DeployProgress, state: DeployState,
                error: str | None = None) -> None:
        progress.finish(state, error)
        if self._metrics is not None:
            self._metrics.deploys.labels(state.value).inc()
            self._metrics.deploy_duration.observe(progress.finished_at - progress.started_at
                                                  if progress.finished_at else 0.0)
