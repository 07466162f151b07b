"""Per-replica process metrics, on real process trees."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dpserve.metrics.process import ProcessCollector, cpuset_size, replica_cores
from tests.waiting import wait_for_sync

# A parent that starts a child and waits: the shape of a vLLM API server and its engine core.
# The child says `ready` on the shared stdout once its interpreter is up: caught earlier
# (just forked, or just exec'd) its memory is a fraction of a started one's, and a scrape
# under load once found it so (the tree 1.19x the parent alone).
PARENT_WITH_CHILD = (
    "import subprocess, sys, time;"
    "subprocess.Popen([sys.executable, '-c', 'import time; print(\"ready\", flush=True); "
    "time.sleep(60)']);"
    "time.sleep(60)"
)
BUSY = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"


@pytest.fixture
def spawn() -> Iterator:
    started: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                stdout=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the children go too
        proc.wait()
        proc.stdout.close()


def scrape(collector: ProcessCollector) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, s.labels["replica"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_children(pid: int, n: int) -> list[psutil.Process]:
    def children() -> list[psutil.Process]:
        kids = psutil.Process(pid).children(recursive=True)
        return kids if len(kids) >= n else []

    return wait_for_sync(children, f"{n} child processes to start", every_s=0.02)


def wait_idle(pid: int) -> None:
    proc = psutil.Process(pid)
    seen = [sum(proc.cpu_times()[:2])]

    def idle() -> bool:
        seen.append(sum(proc.cpu_times()[:2]))
        return seen[-1] == seen[-2]

    wait_for_sync(idle, "the process to stop using CPU")


def test_memory_is_summed_over_the_replica_process_tree(spawn):
    parent = spawn(PARENT_WITH_CHILD)
    assert parent.stdout.readline() == "ready\n"  # the child's interpreter is up
    (child,) = wait_children(parent.pid, 1)
    got = scrape(ProcessCollector(lambda: {"r0": parent.pid}))
    alone = psutil.Process(parent.pid).memory_info().rss
    tree = alone + child.memory_info().rss
    assert got[("dpserve_replica_memory_rss_bytes", "r0")] == pytest.approx(tree, rel=0.2)
    assert got[("dpserve_replica_memory_rss_bytes", "r0")] > alone * 1.3


def test_cpu_utilization_is_measured_since_the_previous_scrape_per_bound_core(spawn):
    busy = spawn(BUSY)
    idle = spawn("import time; time.sleep(60)")
    wait_idle(idle.pid)  # past Python's start-up
    collector = ProcessCollector(lambda: {"busy": busy.pid, "idle": idle.pid},
                                 cores={"busy": 2, "idle": 1})
    t0 = time.monotonic()
    first = scrape(collector)
    t1 = time.monotonic()
    time.sleep(0.5)
    t2 = time.monotonic()
    second = scrape(collector)
    t3 = time.monotonic()
    used = (second[("dpserve_replica_cpu_seconds_total", "busy")]
            - first[("dpserve_replica_cpu_seconds_total", "busy")])
    assert used > 0.05  # it ran, however busy this machine is
    # The collector's own interval lies between t2 - t1 and t3 - t0; CPU time counts in
    # 10 ms clock ticks. Utilization is per bound core (2 here).
    ratio = second[("dpserve_replica_cpu_utilization_ratio", "busy")]
    assert (used - 0.02) / (t3 - t0) / 2 <= ratio <= (used + 0.02) / (t2 - t1) / 2
    # A sleeping process: its ratio is what it used in this interval (a tick or two when
    # this machine is busy), not its start-up averaged over its lifetime.
    idle_used = (second[("dpserve_replica_cpu_seconds_total", "idle")]
                 - first[("dpserve_replica_cpu_seconds_total", "idle")])
    idle_ratio = second[("dpserve_replica_cpu_utilization_ratio", "idle")]
    assert idle_ratio <= (idle_used + 0.02) / (t2 - t1)


def test_a_replica_whose_process_is_gone_is_left_out(spawn):
    alive = spawn("import time; time.sleep(60)")
    gone = spawn("pass")
    gone.wait()
    got = scrape(ProcessCollector(lambda: {"r0": alive.pid, "r1": gone.pid}))
    assert ("dpserve_replica_memory_rss_bytes", "r0") in got
    assert ("dpserve_replica_memory_rss_bytes", "r1") not in got


def test_a_restarted_replica_is_followed_to_its_new_process(spawn):
    first = spawn("import time; time.sleep(60)")
    pids = {"r0": first.pid}
    collector = ProcessCollector(lambda: pids)
    assert ("dpserve_replica_memory_rss_bytes", "r0") in scrape(collector)
    first.kill()
    first.wait()
    pids["r0"] = spawn("import time; time.sleep(60)").pid
    assert ("dpserve_replica_memory_rss_bytes", "r0") in scrape(collector)


def test_cores_come_from_the_replica_cpuset():
    assert cpuset_size("0") == 1
    assert cpuset_size("0,1") == 2
    assert cpuset_size("0-3,8") == 5
    assert replica_cores([("r0", "cpu:0-3"), ("r1", "cpu:4"), ("r2", "gpu:0")], default=16) == {
        "r0": 4, "r1": 1, "r2": 16}
