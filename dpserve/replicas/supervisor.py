"""Starting, watching, restarting and stopping replica processes.

Each replica runs in its own process group (vLLM forks an engine-core
process; killing the group takes both). The supervisor:

* starts every replica and waits for its `/health`, with a deadline; a replica
  that exits or times out raises :class:`ReplicaStartError` carrying the tail
  of its log;
* watches each process: when one dies it is taken out of the router's rotation
  at once (`pool.mark_down`), then restarted after a backoff that doubles on
  each quick crash; the health loop re-admits it when it answers again;
* stops them all: SIGTERM to the group, wait, SIGKILL what is left.

With a `Deployed` record, every (re)start loads `deployed.current` instead of
the spec's `--model`: a replica whose engine died during or after a rolling
deploy comes back on the deployed checkpoint, never on stale weights. The
rollout can also ask for a restart (`restart`) of a replica it cannot reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from dpserve.config import ServeConfig
from dpserve.replicas.launcher import ReplicaSpec, argv_with_model, engine_environment
from dpserve.replicas.startup import OUR_HEADER, log_end, read_phase
from dpserve.rollout.deployed import Deployed
from dpserve.router.fleet.pool import ReplicaPool, ReplicaState

log = logging.getLogger("dpserve.supervisor")

LOG_TAIL_LINES = 40
STILL_STARTING_EVERY_S = 30.0
"""While a replica starts (vLLM: ~45 s on CPU, minutes for a large model on a GPU), a
line this often says it is still at it, with the last line of its log."""
# A replica that ran this long before dying is treated as a fresh failure: its
# restart backoff starts over.
STABLE_AFTER_S = 60.0


class ReplicaStartError(RuntimeError):
    """A replica did not become healthy; the message ends with its log tail."""

    def __init__(self, replica_id: str, reason: str, log_path: Path) -> None:
        tail = log_tail(log_path)
        super().__init__(
            f"replica {replica_id} failed to start: {reason}\n"
            f"--- last lines of {log_path} ---\n{tail}"
        )
        self.replica_id = replica_id
        self.reason = reason


def restart_delay(failures: int, base: float, cap: float) -> float:
    """Backoff before restart number `failures` (1-based): base, 2·base, 4·base, ... ≤ cap."""
    return float(min(cap, base * 2 ** max(0, failures - 1)))


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        data = log_end(path)
    except OSError as exc:
        return f"(log unreadable: {exc})"
    return "\n".join(data.splitlines()[-lines:]) or "(log is empty)"


def _in_child(cores: tuple[int, ...]) -> None:
    """In the child before exec: get SIGTERM if the supervisor dies without cleaning up,
    and run only on `cores` (when given; cores this machine lacks are left out)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if cores:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)


@dataclass(eq=False)
class _Managed:
    spec: ReplicaSpec
    proc: asyncio.subprocess.Process | None = None
    log_file: IO[bytes] | None = None
    started_at: float = 0.0
    failures: int = 0
    restarts: int = 0
    watcher: asyncio.Task[None] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    launches: int = 0
    launched_version: str | None = None
    """Weight version the current process was started on (with a Deployed record)."""
    restart_requested: bool = False
    """The next exit was asked for (`Supervisor.restart`): restart at once, no backoff."""


class Supervisor:
    def __init__(
        self,
        specs: list[ReplicaSpec],
        pool: ReplicaPool,
        config: ServeConfig,
        *,
        on_restart: Callable[[str], None] | None = None,
        deployed: Deployed | None = None,
        still_starting_every_s: float = STILL_STARTING_EVERY_S,
    ) -> None:
        self._replicas = [_Managed(s) for s in specs]
        self._still_starting_every_s = still_starting_every_s
        self._deployed = deployed
        self._pool = pool
        self._config = config
        self._on_restart = on_restart
        self._stopping = False
        self._forced = asyncio.Event()
        """Set by `force`: replicas still exiting are killed now."""
        self._client = httpx.AsyncClient()

    @property
    def pids(self) -> dict[str, int]:
        return {m.spec.id: m.proc.pid for m in self._replicas if m.proc is not None}

    def launched(self, replica_id: str) -> tuple[int, str | None]:
        """(processes started so far for the replica, weight version of the latest)."""
        m = self._managed(replica_id)
        return m.launches, m.launched_version

    async def restart(self, replica_id: str, reason: str) -> None:
        """Stop the replica's process group; the watcher starts it again at once, on
        `deployed.current`. Nothing to do while it is between two processes."""
        m = self._managed(replica_id)
        if m.proc is None or m.proc.returncode is not None or self._stopping:
            return
        log.warning("replica %s: restarting (%s)", replica_id, reason)
        replica = self._pool.get(replica_id)
        if replica is not None:  # out of rotation and of the health loop while it stops:
            # a dying engine still answers /health for a few seconds
            self._pool.set_state(replica, ReplicaState.DRAINING, f"restarting: {reason}")
        m.restart_requested = True
        _signal_group(m.proc.pid, signal.SIGTERM)

    def _managed(self, replica_id: str) -> _Managed:
        for m in self._replicas:
            if m.spec.id == replica_id:
                return m
        raise KeyError(replica_id)

    async def start(self) -> None:
        """Start every replica; return when all are healthy, or raise ReplicaStartError."""
        for m in self._replicas:
            await self._spawn(m)
        results = await asyncio.gather(
            *(self._wait_healthy(m) for m in self._replicas), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for e in errors:
                if not isinstance(e, ReplicaStartError):
                    raise e
            raise errors[0]
        for m in self._replicas:
            m.watcher = asyncio.create_task(self._watch(m), name=f"dpserve-watch-{m.spec.id}")

    def force(self) -> None:
        """Kill now what `stop` is still waiting on (a second Ctrl-C)."""
        self._forced.set()

    async def stop(self) -> None:
        """Stop every replica: SIGTERM its process group, wait (up to `stop_timeout_s`,
        or until `force`), then SIGKILL."""
        self._stopping = True
        running = sum(m.proc is not None and m.proc.returncode is None
                      for m in self._replicas)
        if running and not self._forced.is_set():
            log.info("stopping %d replica(s): up to %g s each to exit, then killed "
                     "(Ctrl-C again kills them now)", running, self._config.stop_timeout_s)
        for m in self._replicas:
            if m.watcher is not None:
                m.watcher.cancel()
        await asyncio.gather(*(self._terminate(m) for m in self._replicas))
        await self._client.aclose()

    async def _spawn(self, m: _Managed) -> None:
        spec = m.spec
        argv = spec.argv
        if self._deployed is not None:
            weights = self._deployed.current
            argv = argv_with_model(spec.argv, weights.path)
            m.launched_version = weights.version
            replica = self._pool.get(spec.id)
            if replica is not None:
                replica.weight_version = weights.version
        m.launches += 1
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        if m.log_file is None:
            m.log_file = spec.log_path.open("ab")
        m.log_file.write(f"\n{OUR_HEADER} starting {spec.id} on {spec.device}: "
                         f"{' '.join(argv)}\n".encode())
        m.log_file.flush()
        m.ready.clear()
        self._pool_state(spec.id, ReplicaState.STARTING)
        m.proc = await asyncio.create_subprocess_exec(
            *argv,
            env=engine_environment(os.environ, spec.env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=m.log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # own process group: the engine core dies with it
            preexec_fn=functools.partial(_in_child, spec.cores),
        )
        m.started_at = time.monotonic()
        log.info("replica %s: started pid %d on %s, port %d, log %s",
                 spec.id, m.proc.pid, spec.device, spec.port, spec.log_path)

    async def _wait_healthy(self, m: _Managed) -> None:
        assert m.proc is not None
        deadline = m.started_at + self._config.startup_timeout_s
        next_note = m.started_at + self._still_starting_every_s
        proc = m.proc
        while True:
            if time.monotonic() >= next_note:
                next_note += self._still_starting_every_s
                phase = await asyncio.to_thread(read_phase, m.spec.log_path)
                log.info("replica %s: still starting after %.0f s: %s (log: %s)", m.spec.id,
                         time.monotonic() - m.started_at, phase, m.spec.log_path)
            if proc.returncode is not None:
                raise ReplicaStartError(m.spec.id, f"process exited with code {proc.returncode}",
                                        m.spec.log_path)
            if time.monotonic() > deadline:
                raise ReplicaStartError(
                    m.spec.id, f"no healthy /health within {self._config.startup_timeout_s:g} s",
                    m.spec.log_path)
            with contextlib.suppress(httpx.HTTPError):
                resp = await self._client.get(m.spec.url + "/health", timeout=2.0)
                if resp.status_code == 200:
                    log.info("replica %s: healthy after %.1f s", m.spec.id,
                             time.monotonic() - m.started_at)
                    await self._tell_version(m)
                    m.ready.set()
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=0.5)

    async def _watch(self, m: _Managed) -> None:
        """Restart the replica whenever its process dies, until stop()."""
        while not self._stopping:
            assert m.proc is not None
            code = await m.proc.wait()
            if self._stopping:
                return
            replica = self._pool.get(m.spec.id)
            reason = f"process exited with code {code}"
            if replica is not None and m.restart_requested:
                self._pool.set_state(replica, ReplicaState.DOWN, reason)
            elif replica is not None:
                self._pool.mark_down(replica, reason)
            await self._kill_group(m)  # the engine core may outlive the API server
            ran_for = time.monotonic() - m.started_at
            if m.restart_requested:  # asked for, not a crash: no backoff
                m.restart_requested, delay = False, 0.0
            else:
                m.failures = 1 if ran_for >= STABLE_AFTER_S else m.failures + 1
                delay = restart_delay(m.failures, self._config.restart_backoff_s,
                                      self._config.restart_backoff_max_s)
            log.error("replica %s: %s after %.0f s; restarting in %.1f s (log: %s)\n%s",
                      m.spec.id, reason, ran_for, delay, m.spec.log_path,
                      log_tail(m.spec.log_path, 10))
            await asyncio.sleep(delay)
            if self._stopping:
                return
            m.restarts += 1
            if self._on_restart is not None:
                self._on_restart(m.spec.id)
            await self._spawn(m)
            try:
                await self._wait_healthy(m)
            except ReplicaStartError as exc:
                log.error("%s", exc)  # the loop sees the exit (or kills it) and backs off
                if m.proc.returncode is None:
                    await self._terminate(m)

    async def _tell_version(self, m: _Managed) -> None:
        """Name the weights in vLLM's own /weight_info too (best effort: the router's
        pool is what dpserve reports)."""
        if m.launched_version is None:
            return
        with contextlib.suppress(httpx.HTTPError):
            await self._client.post(m.spec.url + "/update_weight_version",
                                    json={"new_version": m.launched_version}, timeout=5.0)

    def _pool_state(self, replica_id: str, state: ReplicaState) -> None:
        replica = self._pool.get(replica_id)
        if replica is not None and replica.state in (ReplicaState.DOWN, ReplicaState.STARTING):
            self._pool.set_state(replica, state)

    async def _terminate(self, m: _Managed) -> None:
        proc = m.proc
        if proc is None:
            return
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            exited = asyncio.ensure_future(proc.wait())
            forced = asyncio.ensure_future(self._forced.wait())
            try:
                await asyncio.wait({exited, forced}, timeout=self._config.stop_timeout_s,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                forced.cancel()
                if not exited.done():
                    exited.cancel()
                    if self._forced.is_set():
                        log.warning("replica %s: killed without waiting", m.spec.id)
                    else:
                        log.warning("replica %s: still running %g s after SIGTERM; killing",
                                    m.spec.id, self._config.stop_timeout_s)
        await self._kill_group(m)
        if m.log_file is not None and self._stopping:
            m.log_file.close()
            m.log_file = None

    async def _kill_group(self, m: _Managed) -> None:
        """SIGKILL whatever is left of the replica's process group, and reap the leader."""
        assert m.proc is not None
        pgid = m.proc.pid
        if not await _group_gone(pgid, within_s=1.0):  # children finishing their SIGTERM
            _signal_group(pgid, signal.SIGKILL)
            if not await _group_gone(pgid, within_s=5.0):
                log.error("replica %s: process group %d survived SIGKILL", m.spec.id, pgid)
        if m.proc.returncode is None:
            await m.proc.wait()


async def _group_gone(pgid: int, *, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
