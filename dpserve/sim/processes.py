"""A fleet spread over several processes, to use more than one core.

One process simulates about as many streamed tokens per second as its core can
write (README.md, "Capacity"). `python -m dpserve.sim --processes P` starts P
child processes of the same command, each with a share of the replicas, the
same settings (passed as a YAML file) and its own replica numbering, prints all
their URLs in replica order and stops them all on SIGINT or SIGTERM.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import yaml

from dpserve.sim.config import SimConfig

log = logging.getLogger("dpserve.sim")

START_TIMEOUT_S = 60.0
"""How long a child process may take to print its replicas' URLs."""


def shares(replicas: int, processes: int) -> list[tuple[int, int]]:
    """(first replica index, replica count) per process, as even as can be."""
    out, first = [], 0
    for p in range(processes):
        count = replicas // processes + (1 if p < replicas % processes else 0)
        if count:
            out.append((first, count))
        first += count
    return out


def run(config: SimConfig, replicas: int, processes: int, *, base_port: int,
        kv_events_port: int, extra_args: list[str]) -> int:
    """Run the children until a signal; 0 on a clean stop, 1 if a child failed. Each
    child gets its share of the HTTP ports and of the KV-event ports (two per replica)
    when they were asked for, so the children's ports never collide."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with tempfile.TemporaryDirectory(prefix="dpserve-sim-") as tmp:
        config_file = Path(tmp) / "sim.yaml"
        config_file.write_text(yaml.safe_dump(dataclasses.asdict(config)))
        children: list[subprocess.Popen[str]] = []
        try:
            for first, count in shares(replicas, processes):
                port = base_port + first if base_port else 0
                kv_port = kv_events_port + 2 * first if kv_events_port else 0
                children.append(subprocess.Popen(
                    [sys.executable, "-m", "dpserve.sim", "--replicas", str(count),
                     "--first-index", str(first), "--base-port", str(port),
                     "--kv-events-port", str(kv_port), "--config", str(config_file),
                     *extra_args],
                    stdout=subprocess.PIPE, text=True))
            urls = [_read_urls(child, count, stop)
                    for child, (_, count) in zip(children, shares(replicas, processes),
                                                 strict=True)]
            if any(u is None for u in urls):
                return 1
            for url in (u for group in urls for u in group or []):
                print(url, flush=True)
            log.info("%d replicas in %d processes ready", replicas, len(children))
            while not stop.wait(0.5):
                if any(c.poll() is not None for c in children):
                    log.error("a simulator process exited; stopping the others")
                    return 1
            return 0
        finally:
            for child in children:
                if child.poll() is None:
                    child.terminate()
            for child in children:
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                if child.stdout is not None:
                    child.stdout.close()


def _read_urls(child: subprocess.Popen[str], count: int,
               stop: threading.Event) -> list[str] | None:
    """The `count` URL lines a child prints once ready; None if it fails or times out."""
    urls: list[str] = []
    done = threading.Event()

    def read() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            urls.append(line.strip())
            if len(urls) == count:
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(START_TIMEOUT_S) or len(urls) < count or stop.is_set():
        log.error("a simulator process did not start (exit code %s)", child.poll())
        return None
    return urls
