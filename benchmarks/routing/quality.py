"""Routing quality, side by side: dpserve's policies and vllm-router's on a simulated fleet.

For every workload and every router, one run, each from cold:

1. a fresh simulated fleet (``python -m dpserve.sim --replicas N``, its own
   process; engine model in ``sim_fleet.SIM_CONFIG``: an 8B model on an
   L4-class GPU), so prefix caches and counters start empty;
2. the router in front of it, its own process on 127.0.0.1 and a free port:
   ``python -m dpserve router --policy P`` for dpserve's five policies, or
   ``vllm-router --policy P`` (PyPI, pip-installed into ``build/bench-venv``
   by ``common.tools.ensure_tool``, started as ``router/overhead.py`` starts it) for
   ``round_robin``, ``power_of_two`` and ``cache_aware``;
3. the load, its own process (``load.py``, loadtest's harness):
   streaming completions, Poisson arrivals at the workload's rate, the same
   prompts in the same order and the same seed for every router;
4. the fleet's ``/metrics`` before and after: prefix-cache hits / queries
   summed over replicas, requests finished per replica (spread), and the
   simulator's own step timing error (a warning when the machine was too busy
   to simulate faithfully).

Workloads (``workloads.py``, exact lengths in simulator tokens):
``uniform`` 512 in / 128 out; ``heavy-tail`` lognormal in (median 256) and out
(median 96), capped by max_model_len; ``tenants`` 32 tenants, each a 2,000-token
system prompt then a 20-100 token question, interleaved, ``user: tenant-K``.

Targets, printed as PASS/FAIL: dpserve's default policy (prefix-affinity)
has p99 TTFT no worse than the best vllm-router policy on each workload;
dpserve's prefix-affinity hit rate at least matches cache_aware's.

    python -m benchmarks.routing.quality [--replicas 8] [--num-prompts 400]
        [--workloads uniform,heavy-tail,tenants] [--routers dpserve:least-outstanding,...]
        [--request-rate R] [--rate-scale X] [--json OUT] [--dpserve-config router.yaml]
        [--dpserve-ref HEAD]

Exit status: 0 when every run completed (targets met or not), 1 when a run
could not be made (a router that fails to start is reported and skipped), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.common.services import HOST, Service, free_ports, http_call, start_service, stop_all
from benchmarks.common.tools import (
    REPO,
    VLLM_ROUTER_SPEC,
    ensure_tool,
    export_ref,
    vllm_router_argv,
    vllm_router_version,
)
from benchmarks.routing import sim_fleet as fleet
from benchmarks.routing import workloads
from benchmarks.routing.report import RunRow, print_tables, verdicts
from dpserve.config import POLICIES, RouterConfig

DPSERVE_POLICIES = tuple(p for p in POLICIES if p != "auto")
VLLM_ROUTER_POLICIES = ("round_robin", "power_of_two", "cache_aware")
WORKERS_ROUTER = "dpserve-2w"
"""dpserve with `--workers 2` (the data plane in two processes), default policy only."""
ROUTERS = tuple([f"dpserve:{p}" for p in DPSERVE_POLICIES]
                + [f"{WORKERS_ROUTER}:{RouterConfig().policy}"]
                + [f"vllm-router:{p}" for p in VLLM_ROUTER_POLICIES])
RATE_PER_REPLICA = {"uniform": 2.75, "heavy-tail": 3.0, "tenants": 1.25}
"""Default offered load, requests/s per replica: 75-85% of the rate where a cache-blind
policy's p99 TTFT takes off and preemptions start (uniform ~3.5, heavy-tail ~3.5,
tenants ~1.5 per replica with this engine model; calibrated in benchmarks/routing/README.md)."""
READY_TIMEOUT_S = 30.0
DRAIN_SLACK_S = 60.0
"""Beyond the arrival schedule, how long a load run may take before it is killed."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--replicas", type=int, default=8, help="simulated replicas")
    add("--num-prompts", type=int, default=400, help="requests per run")
    add("--workloads", default=",".join(workloads.WORKLOADS),
        help=f"comma-separated subset of {','.join(workloads.WORKLOADS)}")
    add("--routers", default=",".join(ROUTERS),
        help="comma-separated subset of " + ",".join(ROUTERS))
    add("--request-rate", type=float,
        help="requests/s for every workload (default: per workload, "
             + ", ".join(f"{w} {r:g}" for w, r in RATE_PER_REPLICA.items())
             + " per replica)")
    add("--rate-scale", type=float, default=1.0, help="multiply the default rates")
    add("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    add("--request-timeout", type=float, default=120.0, help="per request, seconds")
    add("--sim-processes", type=int, default=1,
        help="spread the fleet over this many processes (python -m dpserve.sim --processes)")
    add("--sim-config", type=Path,
        help="YAML of SimConfig fields overriding sim_fleet.SIM_CONFIG")
    add("--dpserve-config", type=Path,
        help="YAML passed to `dpserve router --config` (e.g. router: {load_factor: 2})")
    add("--retries", type=int, default=2,
        help="repeat a run whose simulator was distorted (busy machine) up to this many times")
    add("--quiet-cores", type=float, default=0.5,
        help="before a run, wait until other processes use fewer cores than this")
    add("--quiet-wait", type=float, default=120.0, help="longest such wait, seconds")
    add("--dpserve-ref", metavar="REF",
        help="run dpserve's router and the simulated fleet as committed at REF (git archive), "
             "not from the working tree, which others may be editing")
    add("--vllm-router-spec", default=VLLM_ROUTER_SPEC, help="pip spec installed when absent")
    add("--json", type=Path, metavar="OUT", help="write every number here as JSON")
    add("--keep-logs", action="store_true", help="keep the temp dir with logs and prompts")
    args = p.parse_args(argv)
    args.workloads = _subset(p, "--workloads", args.workloads, workloads.WORKLOADS)
    args.routers = _subset(p, "--routers", args.routers, ROUTERS)
    if args.retries < 0 or args.quiet_wait < 0:
        p.error("--retries and --quiet-wait must be >= 0")
    if min(args.replicas, args.num_prompts, args.sim_processes) < 1:
        p.error("--replicas, --num-prompts and --sim-processes must be at least 1")
    if (args.request_rate is not None and args.request_rate <= 0) or args.rate_scale <= 0:
        p.error("--request-rate and --rate-scale must be > 0")
    if args.dpserve_config is not None:
        args.dpserve_config = args.dpserve_config.resolve()  # the router may run elsewhere
    return args


def _subset(p: argparse.ArgumentParser, flag: str, text: str, known: Sequence[str]
            ) -> list[str]:
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in known]
    if unknown or not chosen:
        p.error(f"{flag}: unknown {unknown or 'empty list'}; choose from {','.join(known)}")
    return [x for x in known if x in chosen]  # the canonical order


def rate_for(args: argparse.Namespace, workload: str) -> float:
    if args.request_rate is not None:
        return float(args.request_rate)
    return RATE_PER_REPLICA[workload] * args.replicas * args.rate_scale


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM: stop everything the way Ctrl-C does


class Bench:
    """Runs (workload, router) pairs; owns every process it starts via ``services``."""

    def __init__(self, args: argparse.Namespace, work_dir: Path, sim_config: Path,
                 vllm_router: str | None) -> None:
        self.args = args
        self.src = export_ref(args.dpserve_ref, work_dir) if args.dpserve_ref else None
        """Where ``python -m dpserve`` runs from: an exported ref, or None for the tree."""
        self.work_dir = work_dir
        self.sim_config = sim_config
        self.vllm_router = vllm_router
        self.services: list[Service] = []

    def measure(self, workload: str, prompts: Path, router: str) -> RunRow:
        """One run, repeated (up to ``--retries`` times) while the simulator was distorted;
        the least distorted attempt is kept, the others are summarized in it."""
        attempts: list[RunRow] = []
        for attempt in range(1 + self.args.retries):
            waited = fleet.wait_for_quiet(self.args.quiet_cores, self.args.quiet_wait)
            row = self.run(workload, prompts, router)
            row.quiet_wait_s = waited
            row.load_average = os.getloadavg()[0]
            attempts.append(row)
            _say(row)
            if row.fleet is None or not row.fleet.distorted:
                break
            if attempt < self.args.retries:
                print("  again, on a fresh fleet and router", flush=True)
        best = min(attempts, key=lambda r: (r.fleet.very_late_share or 0.0) if r.fleet
                   else math.inf)
        best.attempts = [a.attempt_summary() for a in attempts]
        return best

    def run(self, workload: str, prompts: Path, router: str) -> RunRow:
        kind, policy = router.split(":", 1)
        rate = rate_for(self.args, workload)
        row = RunRow(workload=workload, router=kind, policy=policy, rate=rate)
        tag = f"{workload}-{kind}-{policy}"
        t = time.monotonic()

        def phase(name: str) -> None:
            nonlocal t
            now = time.monotonic()
            row.phases_s[name] = round(now - t, 2)
            t = now

        try:
            urls = fleet.start_fleet(self.args.replicas, self.sim_config, self.work_dir,
                                     self.services, processes=self.args.sim_processes,
                                     cwd=self.src)
            phase("fleet_start")
            try:
                url = self._start_router(kind, policy, urls, tag)
            except RuntimeError as exc:
                row.error = f"router did not start: {exc}"
                return row
            phase("router_start")
            before = fleet.sample(urls)
            row.load = self._load(url, prompts, rate, tag)
            row.fleet = fleet.delta(before, fleet.sample(urls))
            phase("load")
            if row.load is None:
                row.error = f"the load run failed; see {self.work_dir}/load-{tag}.log"
        finally:
            stop_all(self.services)
            phase("stop")
        return row

    def _start_router(self, kind: str, policy: str, urls: list[str], tag: str) -> str:
        port, metrics_port = free_ports(2)
        if kind.startswith("dpserve"):
            argv = [sys.executable, "-m", "dpserve", "router", "--host", HOST, "--port",
                    str(port), "--policy", policy, "--log-level", "warning",
                    "--workers", "2" if kind == WORKERS_ROUTER else "1"]
            argv += [a for u in urls for a in ("--replica", u)]
            if self.args.dpserve_config:
                argv += ["--config", str(self.args.dpserve_config)]
        else:
            if self.vllm_router is None:
                raise RuntimeError("vllm-router is not installed")
            argv = vllm_router_argv(self.vllm_router, urls, port, metrics_port, policy)
        service = start_service(f"router-{tag}", argv, self.work_dir,
                                cwd=self.src if kind.startswith("dpserve") else None)
        self.services.append(service)
        url = f"http://{HOST}:{port}"
        wait_ready(service, url, kind, len(urls))
        return url

    def _load(self, url: str, prompts: Path, rate: float, tag: str) -> dict[str, Any] | None:
        result = self.work_dir / f"load-{tag}.json"
        spec = {"base_url": url, "dataset_path": str(prompts),
                "num_prompts": self.args.num_prompts, "request_rate": rate,
                "seed": self.args.seed, "request_timeout_s": self.args.request_timeout,
                "duration_s": None, "result_json": str(result), "labels": {"run": tag}}
        spec_path = self.work_dir / f"load-{tag}.spec.json"
        spec_path.write_text(json.dumps(spec))
        load = start_service(f"load-{tag}", [sys.executable, "-m", "benchmarks.routing.load",
                                              str(spec_path)], self.work_dir, cwd=REPO)
        self.services.append(load)
        limit = self.args.num_prompts / rate + self.args.request_timeout + DRAIN_SLACK_S
        try:
            code = load.proc.wait(limit)
        except subprocess.TimeoutExpired:
            print(f"  load run exceeded {limit:.0f} s; stopped", flush=True)
            return None
        if code != 0 or not result.exists():
            print(f"  load run exited with code {code}:\n{load.log_tail(5)}", flush=True)
            return None
        return dict(json.loads(result.read_text()))


def wait_ready(service: Service, url: str, kind: str, replicas: int) -> None:
    """Until the router routes to every replica (dpserve: all ready in /admin/replicas)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        service.check_alive("start-up")
        if kind.startswith("dpserve"):
            status, body = http_call(f"{url}/admin/replicas", timeout=2.0)
            if status == 200:
                states = [r.get("state") for r in _replica_list(body)]
                last = f"states {states}"
                if states.count("ready") >= replicas:
                    return
        else:
            status, _ = http_call(f"{url}/readiness", timeout=2.0)
            last = f"HTTP {status}"
            if status == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{service.name} not ready within {READY_TIMEOUT_S:.0f} s ({last}):\n"
                       f"{service.log_tail(10)}")


def _replica_list(body: bytes) -> list[dict[str, Any]]:
    try:
        data = json.loads(body)
    except ValueError:
        return []
    items = data.get("replicas", data) if isinstance(data, dict) else data
    return [r for r in items if isinstance(r, dict)] if isinstance(items, list) else []


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_interrupt)
    work_dir = Path(tempfile.mkdtemp(prefix="dpserve-routing-"))
    bench: Bench | None = None
    failed = True
    rows: list[RunRow] = []
    versions: dict[str, str] = {}
    try:
        vllm_router = None
        if any(r.startswith("vllm-router:") for r in args.routers):
            try:
                vllm_router = ensure_tool("vllm-router", args.vllm_router_spec)
                versions["vllm-router"] = vllm_router_version(vllm_router)
            except RuntimeError as exc:
                print(f"note: vllm-router is not measured: {exc}")
        versions["dpserve"] = describe(args.dpserve_ref)
        sim_overrides = _read_yaml(args.sim_config)
        sim_config = fleet.write_config(work_dir / "sim.yaml", sim_overrides)
        max_model_len = int(dict(fleet.SIM_CONFIG | sim_overrides)["max_model_len"])
        bench = Bench(args, work_dir, sim_config, vllm_router)
        print(f"{len(args.workloads)} workload(s) x {len(args.routers)} router(s), "
              f"{args.num_prompts} requests each, {args.replicas} simulated replicas; "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start",
              flush=True)
        for workload in args.workloads:
            requests = workloads.build(workload, args.num_prompts, seed=args.seed,
                                       max_model_len=max_model_len)
            prompts = workloads.write_jsonl(requests, work_dir / f"{workload}.jsonl")
            for router in args.routers:
                print(f"{workload} @ {rate_for(args, workload):g} req/s through {router} ...",
                      flush=True)
                started = time.monotonic()
                row = bench.measure(workload, prompts, router)
                row.wall_s = time.monotonic() - started
                rows.append(row)
        print_tables(args, rows)
        results = verdicts(rows)
        if args.json:
            _write_json(args, rows, results, versions)
        failed = any(r.error and "did not start" not in r.error for r in rows)
        return 1 if failed else 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; stopping every process started", file=sys.stderr)
        failed = False
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if bench is not None:
            stop_all(bench.services)
        if failed or args.keep_logs:
            print(f"logs, prompts and raw results kept in {work_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _say(row: RunRow) -> None:
    if row.error:
        print(f"  {row.error}", flush=True)
    f = row.fleet
    if f is not None and f.distorted:
        print(f"  WARNING: the simulator was distorted (machine too busy, load average "
              f"{row.load_average or 0:.1f}): of {f.steps:.0f} engine steps "
              f"{100 * (f.late_share or 0):.1f}% woke > 1 ms late, "
              f"{100 * (f.very_late_share or 0):.1f}% > 10 ms, {f.resyncs:.0f} > 100 ms; "
              f"mean miss {f.mean_error_ms or 0:.2f} ms", flush=True)


def describe(ref: str | None) -> str:
    """The commit dpserve runs from (``+ working tree`` when it is not an exported ref)."""
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse",
                          "--short", ref or "HEAD"], capture_output=True, text=True, check=False)
    commit = out.stdout.strip() or "?"
    return commit if ref else f"{commit} + working tree"


def _read_yaml(path: Path | None) -> dict[str, object]:
    if path is None:
        return {}
    import yaml

    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise RuntimeError(f"{path}: expected a mapping of SimConfig fields")
    return data


def _write_json(args: argparse.Namespace, rows: list[RunRow], results: list[dict[str, Any]],
                versions: dict[str, str]) -> None:
    payload = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cores": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": versions,
        "sim_config": fleet.SIM_CONFIG | _read_yaml(args.sim_config),
        "rates": {w: rate_for(args, w) for w in args.workloads},
        "runs": [r.as_dict() for r in rows],
        "verdicts": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2, default=_json_default))
    print(f"results written to {args.json}")


def _json_default(value: object) -> object:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
