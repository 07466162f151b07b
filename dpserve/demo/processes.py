"""The demo's own processes: stop them, and make sure nothing `serve` started is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable


def shutdown(serve: subprocess.Popen[bytes]) -> tuple[int, list[int]]:
    """SIGTERM `serve` and wait; (its exit status, pids of its processes still alive)."""
    import psutil

    try:
        family = psutil.Process(serve.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    if serve.poll() is None:
        serve.send_signal(signal.SIGTERM)
    try:
        code = serve.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, signal.SIGKILL)
        code = serve.wait()

    def alive() -> list[int]:
        return [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    with contextlib.suppress(TimeoutError):
        poll(lambda: not alive(), 30, "the replicas to exit")
    leftover = alive()
    for pid in leftover:  # ours: do not leave them running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return code, leftover


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def poll(cond: Callable[[], object], within_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within_s:g} s waiting for {what}")
        time.sleep(interval_s)
