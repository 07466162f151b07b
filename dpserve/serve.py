"""`dpserve serve` and `dpserve router`: the router in front, replicas behind.

One asyncio loop runs the router (uvicorn) and, for `serve`, the replica
supervisor. Shutdown order on SIGINT/SIGTERM: stop accepting connections, let
in-flight requests finish (bounded by `graceful_shutdown_s`), then stop the
replicas (SIGTERM → wait → SIGKILL). A second SIGINT skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn

from dpserve.config import RouterConfig, ServeConfig, effective_policy, parse_lora_spec
from dpserve.httpclient import control_client
from dpserve.metrics.gpu import GpuCollector, gpu_replicas, load_nvml
from dpserve.metrics.process import ProcessCollector, replica_cores
from dpserve.prompt_tokens import open_named
from dpserve.replicas.launcher import (
    free_port,
    plan_replicas,
    usable_cores,
    visible_gpus,
)
from dpserve.replicas.supervisor import ReplicaStartError, Supervisor
from dpserve.rollout.adapter_deploy import AdapterDeploys
from dpserve.rollout.admit import Admission
from dpserve.rollout.api import deploy_routes
from dpserve.rollout.converge import Restarter
from dpserve.rollout.deployed import Deployed, weights_for
from dpserve.rollout.lock import DeployLock
from dpserve.rollout.progress import DeployOptions, DeployState
from dpserve.rollout.rollout import Rollout
from dpserve.rollout.snapshot import SnapshotStore
from dpserve.rollout.validate import Refused
from dpserve.router.fleet.adapters import Adapters
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.http.app import Router
from dpserve.router.http.server import listen, uvicorn_server
from dpserve.router.telemetry.metrics import RouterMetrics
from dpserve.router.workers.process import Workers, start_workers

log = logging.getLogger("dpserve.serve")

START_ADAPTERS_WAIT_S = 60.0
"""How long `--lora` adapters wait for every replica to be in rotation before loading
(into those that are; the others get them before they turn ready)."""


class _Signals:
    """SIGINT/SIGTERM → `stop` event; a second SIGINT → `force`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_force: Callable[[], None]) -> None:
        self.stop = asyncio.Event()
        self._loop = loop
        self._on_force = on_force
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._handle, sig)

    def _handle(self, sig: int) -> None:
        if self.stop.is_set() and sig == signal.SIGINT:
            log.warning("second interrupt: not waiting for in-flight requests or replicas")
            self._on_force()
        else:
            log.info("received %s: shutting down (Ctrl-C again: without waiting)",
                     signal.Signals(sig).name)
        self.stop.set()

    def close(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.remove_signal_handler(sig)


def make_rollout(pool: ReplicaPool, deployed: Deployed | None, config: RouterConfig, *,
                 restarter: Restarter | None = None, metrics: RouterMetrics | None = None,
                 default_snapshot_dir: Path | None = None,
                 adapters: AdapterDeploys | None = None,
                 client: httpx.AsyncClient | None = None) -> Rollout:
    """The rolling deploy as `config` sets it up: its snapshot store, checkpoint root,
    deploy lock and deployed link; `client` (to the engines) is closed with it."""
    snapshot_dir = (Path(config.snapshot_dir) if config.snapshot_dir is not None
                    else default_snapshot_dir)
    return Rollout(
        pool, deployed, restarter=restarter, metrics=metrics,
        snapshots=SnapshotStore(snapshot_dir) if snapshot_dir is not None else None,
        checkpoint_root=(Path(config.checkpoint_root) if config.checkpoint_root is not None
                         else None),
        lock=(DeployLock(config.deploy_lock, ttl_s=config.deploy_lock_ttl_s)
              if config.deploy_lock is not None else None),
        deployed_link=config.deployed_link, adapters=adapters, client=client)


def compose(pool: ReplicaPool, deployed: Deployed | None, config: RouterConfig, *,
            restarter: Restarter | None = None, metrics: RouterMetrics | None = None,
            default_snapshot_dir: Path | None = None,
            warm_up: bool = True) -> tuple[Router, Rollout]:
    """The router and its rolling deploy, wired together (the composition root: the
    router knows nothing of deploys but the callables and routes it is given).
    `warm_up=False` admits replicas without their warm-up request (`rollout.admit`):
    only a benchmark's baseline wants that."""
    metrics = metrics if metrics is not None else RouterMetrics(pool)
    # One client for the deploy side, built now: built while the router serves, it
    # would hold up its event loop (`dpserve.httpclient`). Closed by `rollout.aclose`.
    control = control_client()
    adapters = AdapterDeploys(pool, Adapters(), enabled=config.enable_lora,
                              max_lora_rank=config.max_lora_rank, client=control)
    rollout = make_rollout(pool, deployed, config, restarter=restarter, metrics=metrics,
                           default_snapshot_dir=default_snapshot_dir, adapters=adapters,
                           client=control)
    router = Router(pool, config, metrics=metrics, own_pause=rollout.hot_loading,
                    weight_version=rollout.deployed_version, routes=deploy_routes(rollout),
                    adapters=adapters.adapters, open_tokenizer=open_named,
                    admit=(Admission(then=adapters.admit, client=control) if warm_up
                           else adapters.admit))
    rollout.traffic = router.dispatcher
    rollout.streams = router.dispatcher.streams
    return router, rollout


def announce_ready(pool: ReplicaPool, since: float) -> None:
    """Log `K/N replicas ready after S s` each time more replicas are in rotation, until
    all of them first are: the router's /ready is 200 from the first, but a user waits
    for the last. Later restarts say nothing here (the pool logs every state change)."""
    shown = 0

    def on_change(replica: Replica, old: ReplicaState, new: ReplicaState) -> None:
        nonlocal shown
        ready = len(pool.ready())
        if new is not ReplicaState.READY or shown >= len(pool) or ready <= shown:
            return
        shown = len(pool) if ready == len(pool) else ready
        log.info("%d/%d replicas ready after %.0f s", ready, len(pool),
                 time.monotonic() - since)

    pool.on_state_change(on_change)


async def run_router(config: RouterConfig, replica_urls: list[str],
                     base_model: str | None = None,
                     sockets: list[socket.socket] | None = None) -> int:
    """Serve the router alone in front of replicas started elsewhere.

    `base_model` is the local model directory the replicas were started on: deploys
    check checkpoints against it (without it, `/admin/deploy` refuses). Nothing
    restarts these replicas, so one restarted elsewhere loads whatever its own command
    line says: point that at the deployed checkpoint. `sockets`: already bound by
    `listen(config)` (else bound here).
    """
    started = time.monotonic()
    deployed = Deployed(weights_for(base_model)) if base_model else None
    version = deployed.current.version if deployed else None
    pool = ReplicaPool([
        Replica(id=f"r{i}", url=url.rstrip("/"), weight_version=version)
        for i, url in enumerate(replica_urls)
    ])
    router, rollout = compose(pool, deployed, config)
    announce_ready(pool, started)
    sockets = listen(config) if sockets is None else sockets
    server = uvicorn_server(router, config)
    signals = _Signals(asyncio.get_running_loop(), lambda: setattr(server, "force_exit", True))
    workers = (start_workers(router, server.config.app, config, sockets[0])
               if config.workers > 1 else None)
    try:
        await rollout.prepare()
        serving = asyncio.create_task(server.serve(sockets=sockets), name="dpserve-router")
        if config.loras:
            problem = await deploy_start_adapters(rollout, pool, config)
            if problem is not None:
                log.error("%s", problem)
                server.should_exit = True
                await serving
                return 1
        return await _serve_until_stopped(server, signals, serving, workers)
    finally:
        if workers is not None:
            await workers.stop(config.graceful_shutdown_s)
        await rollout.aclose()
        signals.close()


async def run_serve(config: ServeConfig, sockets: list[socket.socket] | None = None) -> int:
    """Start the replicas and the router; return the process exit code. `sockets`: the
    router's, already bound by `listen(config.router)` (else bound here)."""
    started = time.monotonic()
    run_dir = Path(config.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    gpus = visible_gpus() if config.gpus is None else config.gpus
    # The engines' KV-event sockets: private to this user, short enough for a socket's
    # address (a run directory's path may not be), removed when serve ends.
    kv_dir = (Path(tempfile.mkdtemp(prefix="dpserve-kv-"))
              if effective_policy(config.router) == "kv-aware" else None)
    specs = plan_replicas(config, gpus=gpus, cores=usable_cores(), port=lambda _: free_port(),
                          run_dir=run_dir, kv_dir=kv_dir)
    # What replicas load: the model, then whatever checkpoint is deployed (restarts too).
    deployed = Deployed(weights_for(config.model))
    pool = ReplicaPool([Replica(id=s.id, url=s.url, device=s.device,
                                weight_version=deployed.current.version) for s in specs])
    metrics = RouterMetrics(pool)
    restarts = metrics.replica_restarts
    supervisor = Supervisor(specs, pool, config,
                            on_restart=lambda rid: restarts.labels(rid).inc(),
                            deployed=deployed)
    router, rollout = compose(pool, deployed, config.router, restarter=supervisor,
                              metrics=metrics,
                              default_snapshot_dir=Path(config.run_dir) / "snapshots")
    announce_ready(pool, started)
    sockets = listen(config.router) if sockets is None else sockets
    server = uvicorn_server(router, config.router)
    def force() -> None:  # a second Ctrl-C: in-flight requests and replicas cut now
        server.force_exit = True
        supervisor.force()

    signals = _Signals(asyncio.get_running_loop(), force)
    workers: Workers | None = None
    # Read at scrape time: GPUs through NVML where there are any, else the replicas'
    # processes, so one dashboard serves GPU and CPU fleets.
    devices = [(s.id, s.device) for s in specs]
    gpu_metrics = GpuCollector.open(load_nvml(), replicas=lambda: gpu_replicas(devices))
    router.metrics.registry.register(
        gpu_metrics if gpu_metrics is not None else ProcessCollector(
            lambda: supervisor.pids, replica_cores(devices, default=len(usable_cores()))))
    problem = await check_start_adapters(rollout, config)
    if problem is not None:
        log.error("%s", problem)
        return 2
    log.info("starting %d replica(s) of %s; logs in %s", len(specs), config.model, run_dir)
    try:
        # Router first: /health and /ready answer (503 until a replica is up) while
        # the engines load, as orchestrators' probes expect.
        serving = asyncio.create_task(server.serve(sockets=sockets), name="dpserve-router")
        if config.router.workers > 1:
            workers = start_workers(router, server.config.app, config.router, sockets[0])
        starting = asyncio.create_task(supervisor.start(), name="dpserve-start")
        await rollout.prepare()
        stopped = asyncio.create_task(signals.stop.wait())
        done, _ = await asyncio.wait({serving, starting, stopped},
                                     return_when=asyncio.FIRST_COMPLETED)
        if starting in done:
            starting.result()  # raises ReplicaStartError
            problem = await deploy_start_adapters(rollout, pool, config.router)
            if problem is not None:
                log.error("%s", problem)
                return 1
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, ReplicaStartError):
                await starting
        if serving in done:
            log.error("the router stopped unexpectedly (is port %d free?)", config.router.port)
            return 1
        stopped.cancel()
        return await _serve_until_stopped(server, signals, serving, workers)
    except ReplicaStartError as exc:
        log.error("%s", exc)
        return 1
    finally:
        server.should_exit = True
        if workers is not None:
            await workers.stop(config.router.graceful_shutdown_s)
        if not serving.done():
            with contextlib.suppress(Exception):
                await serving
        await rollout.aclose()
        await supervisor.stop()
        if gpu_metrics is not None:
            gpu_metrics.close()
        if kv_dir is not None:
            shutil.rmtree(kv_dir, ignore_errors=True)
        signals.close()
        log.info("stopped")


async def check_start_adapters(rollout: Rollout, config: ServeConfig) -> str | None:
    """Check each `--lora NAME=DIR` as its deploy will, before any replica starts (a
    wrong path or base costs no engine start-up); why one is refused, or None."""
    served = frozenset({config.served_model_name or config.model})
    for spec in config.router.loras or ():
        name, path = parse_lora_spec(spec)
        try:
            await asyncio.to_thread(rollout.check_adapter, path, name, served)
        except Refused as exc:
            return f"--lora {spec}: refused: {exc.message}"
    return None


async def deploy_start_adapters(rollout: Rollout, pool: ReplicaPool,
                                config: RouterConfig) -> str | None:
    """Deploy each `--lora NAME=DIR` as `dpserve deploy DIR --name NAME` would, once the
    replicas are in rotation; why one could not be, or None."""
    if not config.loras:
        return None
    deadline = time.monotonic() + START_ADAPTERS_WAIT_S
    while len(pool.ready()) < len(pool) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # health checks admit replicas on their own schedule
    for spec in config.loras:
        name, path = parse_lora_spec(spec)
        try:
            where = await asyncio.to_thread(os.path.abspath, path)
            progress = await rollout.start(where, DeployOptions(), name=name)
        except Refused as exc:
            return f"--lora {spec}: refused: {exc.message}"
        await rollout.wait()
        if progress.state is not DeployState.SUCCEEDED:
            return f"--lora {spec}: {progress.state.value}: {progress.error}"
        log.info("adapter %s serves version %s", name, progress.version)
    return None


async def _serve_until_stopped(
    server: uvicorn.Server, signals: _Signals, serving: asyncio.Task[None],
    workers: Workers | None = None,
) -> int:
    stopped = asyncio.create_task(signals.stop.wait())
    done, _ = await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if serving in done:
        stopped.cancel()
        if signals.stop.is_set():
            return 0
        log.error("the router stopped unexpectedly")
        return 1
    server.should_exit = True  # stop accepting; uvicorn drains in-flight requests
    if workers is not None:  # and so does every worker, at the same time
        await asyncio.gather(serving, workers.stop(server.config.timeout_graceful_shutdown
                                                   or 0.0))
    await serving
    return 0
