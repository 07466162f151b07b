"""Processes a benchmark starts and must stop: process groups, CPU placement, readiness.

Every process runs in its own session (so the terminal's Ctrl-C reaches only the
benchmark, which then stops them in order) with its output in a log file, and is
stopped with SIGTERM then SIGKILL to the whole group — nginx's workers and
uvicorn's children included.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.1
STOP_GRACE_S = 5.0


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Which cores each role may run on; empty sets mean "not pinned"."""

    load: frozenset[int]
    upstream: frozenset[int]
    router: frozenset[int]

    @property
    def pinned(self) -> bool:
        return bool(self.router)

    def describe(self) -> str:
        if not self.pinned:
            return "not pinned (the kernel places every process)"

        def cores(s: frozenset[int]) -> str:
            return ",".join(str(c) for c in sorted(s))

        return (f"load generator on core(s) {cores(self.load)}, upstreams on core(s) "
                f"{cores(self.upstream)}, router under test alone on core(s) "
                f"{cores(self.router)}")


def plan_placement(pin: bool, router_cores: int = 1) -> Placement:
    """``router_cores`` cores for the router under test, the others for the load and the
    upstreams.

    The router gets cores of its own so that dpserve (Python processes) and vllm-router
    (a multi-threaded Rust server that would otherwise spread over every core) are
    compared per core, each with the same room. With two cores the load generator and
    the upstreams share the other core; with more, the upstreams get as many cores as
    the router (the ones before its) and the load generator the rest. Raises
    ValueError when there are not enough cores for ``router_cores``.
    """
    try:
        available = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        available = []
    empty: frozenset[int] = frozenset()
    if router_cores > 1 and pin and len(available) < 2 * router_cores + 1:
        raise ValueError(f"--router-cores {router_cores} needs {2 * router_cores + 1} cores "
                         f"(router, upstreams, load); this machine has {len(available)}")
    if not pin or len(available) < 2:
        return Placement(load=empty, upstream=empty, router=empty)
    k = router_cores
    router = frozenset(available[-k:])
    if len(available) == 2:
        rest = frozenset(available[:1])
        return Placement(load=rest, upstream=rest, router=router)
    return Placement(load=frozenset(available[:-2 * k]),
                     upstream=frozenset(available[-2 * k:-k]), router=router)


def pin_self(cpus: frozenset[int]) -> None:
    """Move the calling process onto ``cpus`` (no-op when empty)."""
    if cpus:
        os.sched_setaffinity(0, cpus)


@dataclass(kw_only=True)
class Service:
    """A process we started in its own group, with its output in a file."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def check_alive(self, during: str) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} during "
                               f"{during}; its output:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:
            # The leader is gone; children left in its group (nginx workers) are not.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.log.close()


def start_service(
    name: str, argv: Sequence[str], log_dir: Path, *, cpus: frozenset[int] = frozenset(),
    env: dict[str, str] | None = None, cwd: Path | None = None,
) -> Service:
    """Start ``argv`` in a new session, pinned to ``cpus`` (children inherit it)."""
    log = (log_dir / f"{name}.log").open("w+b")

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    proc = subprocess.Popen(
        list(argv),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=pin if cpus else None,
        env=env,
        cwd=cwd,
    )
    return Service(name=name, argv=[str(a) for a in argv], proc=proc, log=log)


def stop_all(services: list[Service]) -> None:
    """Stop ``services`` newest first and forget them."""
    while services:
        services.pop().stop()


def free_ports(n: int) -> list[int]:
    """Ports the kernel hands out as free, held open together so they differ."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_call(url: str, body: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """One request (POST when ``body`` is given); (0, b"") when nothing answered."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_until_ok(service: Service, url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
    """Poll ``url`` until it answers 200; seconds waited. Fails early if the process exits."""
    start = time.monotonic()
    deadline = start + timeout_s
    last = 0
    while time.monotonic() < deadline:
        service.check_alive(f"start-up (waiting for {url})")
        last, _ = http_call(url, timeout=2.0)
        if last == 200:
            return time.monotonic() - start
        time.sleep(POLL_INTERVAL_S)
    raise RuntimeError(
        f"{service.name}: {url} did not answer 200 within {timeout_s:.0f} s "
        f"(last status: {last or 'no answer'}); its output:\n{service.log_tail()}"
    )


class CpuMeter:
    """User+system CPU seconds of some processes and their children (psutil, if importable)."""

    def __init__(self, pids: Sequence[int]) -> None:
        try:
            import psutil
        except ImportError:
            self._procs: list[Any] | None = None
            return
        self._procs = [psutil.Process(pid) for pid in pids]

    def seconds(self) -> float | None:
        if self._procs is None:
            return None
        import psutil

        total = 0.0
        for proc in self._procs:
            try:
                family = [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in family:
                try:
                    times = p.cpu_times()
                except psutil.NoSuchProcess:  # a child that ended since listing
                    continue
                total += times.user + times.system
        return total
