"""The simulated fleet of ``quality.py``: its engine model, its process, its metrics.

The fleet runs as ``python -m dpserve.sim --replicas N --config sim.yaml`` in a
process group of its own (so the engines' event loop shares nothing with the
router or the load generator) and is started afresh for every run: cold prefix
caches, zeroed counters, no requests left over from the run before.

The simulator is only as exact as its event loop is punctual. Each run's
``dpserve_sim_step_timing_error_seconds`` says how punctual it was
(``FleetDelta.distorted``), and ``wait_for_quiet`` holds a run back while
other processes keep the machine's cores busy.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from benchmarks.common.services import Service, http_call, start_service

SIM_CONFIG: dict[str, object] = {
    # An 8B model in bf16 on one 24 GB L4-class GPU under vLLM's online defaults:
    # a decode step reads 16 GB of weights at ~300 GB/s (~50 ms), prefill runs at
    # ~5k tokens/s, and ~4 GB is left for KV cache (128 KiB per token: 32k tokens).
    # A slow GPU keeps the fleet's token rate, which every process on a 2-core
    # machine pays per streamed token, low enough to simulate faithfully, while
    # the fleet is as loaded as a real one: batches of tens, queues, a prefix
    # cache too small for every tenant's system prompt.
    "max_model_len": 8192,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "kv_cache_tokens": 32768,
    "block_size": 16,
    "step_base_s": 0.05,
    "prefill_per_token_s": 0.0002,
    "decode_per_seq_s": 0.0003,
    "decode_per_context_token_s": 4e-7,
    "step_jitter": 0.05,
}
START_TIMEOUT_S = 30.0
LATE_S = 0.001
"""The simulator README's bar: a step woken more than 1 ms after its deadline is late."""
VERY_LATE_S = 0.01
RESYNC_S = 0.1
"""A step this late makes the engine restart its clock (the lost time is not made up)."""
VERY_LATE_SHARE = 0.01
MEAN_ERROR_S = 0.002
"""Distortion bars. Steps here are >= 50 ms and lateness does not accumulate (each step
has a fixed deadline), so a miss of e.g. 1 ms delays one token by 1 ms: 0.5% of a
200 ms TTFT. What moves the tables is a share of misses comparable to the differences
between routers: more than 1% of steps over 10 ms late, a mean miss over 2 ms, or any
clock restart. Past those a warning is printed."""

_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')


@dataclass(kw_only=True)
class FleetSample:
    """The fleet's counters at one moment, summed over replicas (per replica where noted)."""

    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    preemptions: float = 0.0
    finished: list[float] = field(default_factory=list)
    """Requests finished, per replica."""
    steps: float = 0.0
    timing_error_sum_s: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)
    """Timing-error histogram (cumulative counts by upper bound), summed over replicas."""
    unreadable: int = 0
    """Replicas whose /metrics did not answer."""


@dataclass(kw_only=True)
class FleetDelta:
    """What one run did to the fleet: the difference of two samples."""

    prefix_cache_queries: float
    prefix_cache_hits: float
    hit_rate: float | None
    preemptions: float
    finished_per_replica: list[float]
    imbalance: float | None
    """Most requests finished on one replica / the mean: 1.0 is a perfect spread."""
    steps: float
    late_share: float | None
    """Share of engine steps woken more than LATE_S after their deadline."""
    very_late_share: float | None
    """Share of engine steps woken more than VERY_LATE_S late."""
    resyncs: float
    """Steps more than RESYNC_S late."""
    mean_error_ms: float | None
    unreadable: int

    @property
    def distorted(self) -> bool:
        return bool(self.unreadable or self.resyncs
                    or (self.very_late_share or 0) > VERY_LATE_SHARE
                    or (self.mean_error_ms or 0) > MEAN_ERROR_S * 1e3)

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"distorted": self.distorted}


def write_config(path: Path, overrides: dict[str, object] | None = None) -> Path:
    path.write_text(yaml.safe_dump(SIM_CONFIG | (overrides or {}), sort_keys=False))
    return path


def start_fleet(replicas: int, config: Path, log_dir: Path, services: list[Service], *,
                processes: int = 1, cwd: Path | None = None) -> list[str]:
    """Start the fleet's process(es) and return its URLs once every replica answers /health.
    With ``cwd``, ``python -m dpserve.sim`` imports the ``dpserve`` package found there."""
    argv = [sys.executable, "-m", "dpserve.sim", "--replicas", str(replicas),
            "--config", str(config)]
    if processes > 1:
        argv += ["--processes", str(processes)]
    fleet = start_service("fleet", argv, log_dir, cwd=cwd)
    services.append(fleet)
    deadline = time.monotonic() + START_TIMEOUT_S
    log = Path(log_dir / "fleet.log")
    while time.monotonic() < deadline:
        fleet.check_alive("start-up")
        urls = [line.strip() for line in log.read_text(errors="replace").splitlines()
                if line.startswith("http://")]
        if len(urls) >= replicas and all(http_call(f"{u}/health")[0] == 200 for u in urls):
            return urls[:replicas]
        time.sleep(0.1)
    raise RuntimeError(f"the simulated fleet did not start within {START_TIMEOUT_S:.0f} s:\n"
                       f"{fleet.log_tail()}")


def sample(urls: Sequence[str]) -> FleetSample:
    """Read every replica's /metrics."""
    s = FleetSample()
    for url in urls:
        status, body = http_call(f"{url}/metrics", timeout=5.0)
        if status != 200:
            s.unreadable += 1
            s.finished.append(0.0)
            continue
        finished = 0.0
        for line in body.decode(errors="replace").splitlines():
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            if name == "vllm:prefix_cache_queries_total":
                s.prefix_cache_queries += value
            elif name == "vllm:prefix_cache_hits_total":
                s.prefix_cache_hits += value
            elif name == "vllm:num_preemptions_total":
                s.preemptions += value
            elif name == "vllm:request_success_total":
                finished += value
            elif name == "dpserve_sim_step_timing_error_seconds_count":
                s.steps += value
            elif name == "dpserve_sim_step_timing_error_seconds_sum":
                s.timing_error_sum_s += value
            elif name == "dpserve_sim_step_timing_error_seconds_bucket":
                le = re.search(r'le="([^"]+)"', labels)
                if le:
                    bound = float(le.group(1))
                    s.buckets[bound] = s.buckets.get(bound, 0.0) + value
        s.finished.append(finished)
    return s


def delta(before: FleetSample, after: FleetSample) -> FleetDelta:
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    finished = [a - b for a, b in zip(after.finished, before.finished, strict=True)]
    mean = sum(finished) / len(finished) if finished else 0.0
    steps = after.steps - before.steps

    def over(bound: float) -> float:
        return steps - (after.buckets.get(bound, 0.0) - before.buckets.get(bound, 0.0))

    def share(n: float) -> float | None:
        return n / steps if steps else None

    error_s = after.timing_error_sum_s - before.timing_error_sum_s
    return FleetDelta(
        prefix_cache_queries=queries, prefix_cache_hits=hits,
        hit_rate=hits / queries if queries else None,
        preemptions=after.preemptions - before.preemptions,
        finished_per_replica=finished,
        imbalance=max(finished) / mean if mean else None,
        steps=steps, late_share=share(over(LATE_S)), very_late_share=share(over(VERY_LATE_S)),
        resyncs=over(RESYNC_S), mean_error_ms=1e3 * error_s / steps if steps else None,
        unreadable=after.unreadable)


def busy_cores(interval_s: float = 1.0) -> float:
    """Cores' worth of CPU the whole machine used over ``interval_s`` (/proc/stat)."""

    def read() -> tuple[float, float]:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = read()
        time.sleep(interval_s)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return 0.0
    cores = os.cpu_count() or 1
    return cores * (1 - (idle1 - idle0) / max(total1 - total0, 1e-9))


def wait_for_quiet(max_busy: float, max_wait_s: float) -> float:
    """Wait (at most ``max_wait_s``) until other work uses under ``max_busy`` cores.

    Between runs none of the benchmark's processes run, so what is busy is someone
    else's; starting a run then would measure the machine, not the router. Returns
    the seconds waited.
    """
    start = time.monotonic()
    said = False
    while time.monotonic() - start < max_wait_s:
        busy = busy_cores(2.0)
        if busy < max_busy:
            break
        if not said:
            print(f"  waiting up to {max_wait_s:.0f} s: other processes keep {busy:.1f} cores "
                  "busy", flush=True)
            said = True
    waited = time.monotonic() - start
    if said:
        print(f"  started after {waited:.0f} s", flush=True)
    return round(waited, 1)
