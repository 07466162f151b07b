"""A real 2-replica deployment (vLLM on CPU, the tiny model), started once per session."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dpserve.demo import serve_command, wait_ready
from dpserve.replicas.launcher import free_port
from tests.otlp import OtlpReceiver
from tests.procs import process_alive, processes_in_group

__all__ = ["process_alive", "processes_in_group"]

MODEL_NAME = "dpserve-tiny-llama"
READY_DEADLINE_S = 600.0
_STARTED = re.compile(r"replica (r\d+): started pid (\d+) on \S+, port (\d+)")


def offline_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            # The tiny model answers in well under a second: a replica silent for 20 s
            # is frozen, and the fault tests need not wait the 600 s default.
            "DPSERVE_FIRST_BYTE_TIMEOUT_S": "20",
            # Likewise a stream silent for 20 s mid-way: it moves to another replica.
            "DPSERVE_STREAM_IDLE_TIMEOUT_S": "20"}


@dataclass
class Deployment:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def replicas(self) -> dict[str, tuple[int, int]]:
        """Latest (pid, port) of each replica, read from the supervisor's log."""
        found: dict[str, tuple[int, int]] = {}
        for rid, pid, port in _STARTED.findall(self.log()):
            found[rid] = (int(pid), int(port))
        return found

    def stop(self, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise


def spawn_deployment(model: Path, workdir: Path, *, replicas: int,
                     checkpoint_root: Path | None = None, serve_args: tuple[str, ...] = (),
                     vllm_args: tuple[str, ...] = (),
                     env: dict[str, str] | None = None) -> Deployment:
    """Start `dpserve serve` of `model` in its own process group, logging to
    `workdir/serve.log`, without waiting for it (tests prepare checkpoints meanwhile).
    `serve_args` go to dpserve, `vllm_args` to every engine (the last of a repeated
    vLLM option wins); `env` adds settings (`DPSERVE_*`)."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "serve.log"
    cmd = serve_command(model, replicas=replicas, port=port, served_name=MODEL_NAME,
                        run_dir=workdir / "runs", checkpoint_root=checkpoint_root)
    cut = cmd.index("--")
    cmd = [*cmd[:cut], *serve_args, *cmd[cut:], *vllm_args]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**offline_env(), **(env or {})}, start_new_session=True)
    return Deployment(f"http://127.0.0.1:{port}", proc, log_path)


def start_deployment(model: Path, workdir: Path, *, replicas: int,
                     serve_args: tuple[str, ...] = (),
                     env: dict[str, str] | None = None) -> Deployment:
    deployment = spawn_deployment(model, workdir, replicas=replicas, serve_args=serve_args,
                                  env=env)
    try:
        wait_ready(deployment.base_url, deployment.proc, READY_DEADLINE_S)
    except BaseException:
        deployment.stop()
        raise RuntimeError(f"deployment did not start:\n{deployment.log()[-5000:]}") from None
    return deployment


@pytest.fixture(scope="session")
def otlp() -> Iterator[OtlpReceiver]:
    """Where the session's deployment sends its traces (router and engines)."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def deployment(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
               otlp: OtlpReceiver) -> Iterator[Deployment]:
    """With tracing on, so every fault test runs with it too (spans leave every 0.5 s)."""
    d = start_deployment(tiny_model, tmp_path_factory.mktemp("serve"), replicas=2,
                         serve_args=("--otlp-traces-endpoint", otlp.url),
                         env={"OTEL_BSP_SCHEDULE_DELAY": "500"})
    yield d
    d.stop()


def replica_metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextmanager
def replica_slowed(pgid: int, *, stop_s: float, run_s: float) -> Iterator[None]:
    """The replica whose process group is `pgid` (its API server, the engine running in
    the same process) stopped for `stop_s` and let run for `run_s`, over and over, while
    in the block; let run on leaving. What a slow or stalled engine looks like from the
    router, short of failing its health checks. Measured: stopped 200 ms of every
    220, a 300-token completion took 10.1 s against 2.1 s."""
    stop = threading.Event()

    def signal_all(sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:  # killed by the test
            pass

    def cycle() -> None:
        while not stop.is_set():
            signal_all(signal.SIGSTOP)
            stop.wait(stop_s)
            signal_all(signal.SIGCONT)
            stop.wait(run_s)

    cycler = threading.Thread(target=cycle, daemon=True)
    cycler.start()
    try:
        yield
    finally:
        stop.set()
        cycler.join(timeout=10)
        signal_all(signal.SIGCONT)
