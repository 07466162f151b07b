"""Routing on KV events, wall clock: dpserve's prefix affinity and kv-aware against
vllm-router, behind 1 or 2 routers, on a simulated fleet publishing KV events.

    python -m benchmarks.routing.quality_kv [--workloads chat-fits,chat-1.5x,chat-deploy]
        [--arms dpserve:prefix-affinity,dpserve:kv-aware:2,vllm-router:cache_aware,...]
        [--replicas 8] [--conversations 64] [--json OUT] [--smoke]

For every (workload, arm), from cold, as ``quality.py`` does: a fresh simulated fleet
(``python -m dpserve.sim --kv-events``, the engines of ``sim_fleet.SIM_CONFIG``), the
arm's router process(es) in front, the load in a process of its own, the fleet's
``/metrics`` before and after. An arm is ``KIND:POLICY[:ROUTERS][:peers][:wWORKERS]``:
``ROUTERS`` separate router processes on their own ports with the same replicas, which
the load sends to in turn (clients behind a Kubernetes Service); ``peers``: dpserve
routers told of each other; ``wWORKERS``: each dpserve router with that many
data-plane workers. dpserve's ``kv-aware`` runs with
``--tokenizer sim``, the simulator's own tokenizer, so that the token ids it looks up
are the ones the engines cache and publish; vllm-router's ``kv_aware`` is pointed at
each replica's event endpoints (``GET /kv_event_sources``); see the README for why it
is not among the default arms.

Workloads: ``uniform``, ``heavy-tail``, ``tenants`` as ``quality.py`` offers them
(``load.py``, its rates); ``chat-fits``, ``chat-1.5x``: the multi-turn chat of
``kv_study.py`` (``workloads.chat``, played by ``chat_load.py``), with every replica's KV
cache sized as kv_study sizes it so that the conversations' working set is 0.75x and
1.5x the fleet's cache; ``chat-deploy``: ``chat-fits`` with every replica's prefix cache
reset at ``--reset-at`` s (``POST /reset_prefix_cache?reset_running_requests=true``).

Per run: the fleet's prefix-cache hit rate, TTFT mean/p50/p99, output tokens/s, the
router process(es)' CPU seconds per completed request (user + system, psutil, over the
load), the load average and the simulator's timing error, and what the routers' own
``/metrics`` say KV routing did. Then the targets of ``quality_kv_report``.
Exit status: 0 when every run completed, 1 when one could not be made, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from typing import Any

from benchmarks.common.services import (
    HOST,
    CpuMeter,
    Service,
    free_ports,
    http_call,
    start_service,
    stop_all,
)
from benchmarks.common.tools import (
    REPO,
    VLLM_ROUTER_SPEC,
    ensure_tool,
    export_ref,
    vllm_router_version,
)
from benchmarks.routing import chat_load, kv_study, quality, workloads
from benchmarks.routing import sim_fleet as fleet
from benchmarks.routing.kv_routers import router_command, wait_following
from benchmarks.routing.quality_kv_report import (
    ARM_FORM,
    Arm,
    Row,
    add_series,
    kv_series,
    parse_arm,
    print_tables,
    verdicts,
)
from dpserve.sim.config import build_sim_config

OPEN_LOOP = ("uniform", "heavy-tail", "tenants")
CHAT = {"chat-fits": 0.75, "chat-1.5x": 1.5, "chat-deploy": 0.75}
"""Chat workloads: working set / fleet KV cache (as kv_study's ``--pressure``)."""
WORKLOADS = (*OPEN_LOOP, *CHAT)
ARMS = tuple(Arm(k, p, n) for k, p in (("dpserve", "prefix-affinity"), ("dpserve", "kv-aware"),
                                       ("vllm-router", "cache_aware")) for n in (1, 2))
OPT_IN_ARMS = (Arm("vllm-router", "kv_aware"), Arm("vllm-router", "kv_aware", 2))
"""Runnable, left out of the default arms to keep a full run's length: vllm-router's
kv_aware follows the simulator's events on the empty topic (README)."""
ANSWER_S_BOUND = 30.0
"""Longest a chat answer is allowed in the bound on a chat run (a 256-token answer takes
~15 s with these engines)."""
"""The peers' shared key in these runs (a benchmark's, on loopback)."""
SMOKE = {"workloads": "chat-deploy", "arms": "dpserve:kv-aware,dpserve:kv-aware:2",
         "replicas": 4, "conversations": 16, "turns": 3, "think_s": 2.0,
         "start_window_s": 10.0, "reset_at": 15.0}
"""``--smoke``: two short runs (~2 min) that exercise every moving part: events, two
routers, the reset. Flags given with it override these."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--workloads", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    add("--arms", default=",".join(a.name for a in ARMS),
        help=f"{ARM_FORM}, comma-separated (also: "
             + ",".join(a.name for a in OPT_IN_ARMS) + ")")
    add("--replicas", type=int, default=8)
    add("--num-prompts", type=int, default=400, help="requests per open-loop run")
    add("--rate-scale", type=float, default=1.0, help="times quality.py's open-loop rates")
    add("--conversations", type=int, default=64, help="per chat run")
    add("--turns", type=int, help="keep only each conversation's first N turns")
    add("--think-s", type=float, default=workloads.CHAT_THINK_S)
    add("--start-window-s", type=float, default=kv_study.START_WINDOW_S)
    add("--reset-at", type=float, default=90.0, help="chat-deploy: seconds into the run")
    add("--seed", type=int, default=0)
    add("--request-timeout", type=float, default=120.0)
    add("--retries", type=int, default=0, help="repeat a distorted run up to N times")
    add("--quiet-cores", type=float, default=0.5)
    add("--quiet-wait", type=float, default=60.0)
    add("--dpserve-ref", metavar="REF", help="run dpserve's router and fleet as committed")
    add("--vllm-router-spec", default=VLLM_ROUTER_SPEC)
    add("--json", type=Path, metavar="OUT")
    add("--keep-logs", action="store_true")
    add("--smoke", action="store_true", help="; ".join(f"{k}={v}" for k, v in SMOKE.items()))
    args = p.parse_args(argv)
    if args.smoke:  # its settings as defaults: flags given still win
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        p.error(f"--workloads: choose from {','.join(WORKLOADS)}")
    try:
        args.arms = [parse_arm(a) for a in args.arms.split(",") if a.strip()]
    except ValueError as exc:
        p.error(f"--arms: {exc}")
    unknown = [a.name for a in args.arms if a.kind not in ("dpserve", "vllm-router")]
    if unknown or not args.arms:
        p.error(f"--arms: unknown router kind in {unknown or 'an empty list'}")
    if min(args.replicas, args.num_prompts, args.conversations, args.turns or 1) < 1:
        p.error("--replicas, --num-prompts, --conversations and --turns must be >= 1")
    return args


@dataclasses.dataclass
class Job:
    """What one workload's runs share: the fleet's config and the load's input."""

    workload: str
    sim_config: Path
    load_input: Path
    header: str
    limit_s: float
    """Longest the load may take before it is stopped."""


def prepare(args: argparse.Namespace, workload: str, work_dir: Path) -> Job:
    # vLLM's default topic, the empty one: vllm-router's `--kv-event-source` subscribes
    # to it alone (dpserve's router reads the topic from `/kv_event_sources`).
    overrides: dict[str, object] = {"kv_events": True, "kv_events_topic": ""}
    if workload in CHAT:
        convs = workloads.chat(args.conversations, seed=args.seed, think_s=args.think_s,
                               start_window_s=args.start_window_s)
        if args.turns:
            convs = [dataclasses.replace(c, turns=c.turns[:args.turns]) for c in convs]
        cfg = kv_study.sim_config(convs, args.replicas, CHAT[workload])
        overrides |= {"kv_cache_tokens": cfg.kv_cache_tokens, "max_model_len": cfg.max_model_len}
        path = chat_load.write_conversations(convs, work_dir / f"{workload}.json")
        turns = sum(len(c.turns) for c in convs)
        reset = f", every cache reset at {args.reset_at:g} s" if workload == "chat-deploy" else ""
        header = (f"{len(convs)} conversations, {turns} turns, {cfg.num_blocks} KV blocks per "
                  f"replica (working set / fleet cache {CHAT[workload]:g}){reset}")
        limit = chat_load.schedule_s(convs, ANSWER_S_BOUND) + args.request_timeout
    else:
        max_model_len = int(fleet.SIM_CONFIG["max_model_len"])  # type: ignore[call-overload]
        requests = workloads.build(workload, args.num_prompts, seed=args.seed,
                                   max_model_len=max_model_len)
        path = workloads.write_jsonl(requests, work_dir / f"{workload}.jsonl")
        rate = open_loop_rate(args, workload)
        header = f"{rate:g} req/s offered, {args.num_prompts} requests"
        limit = args.num_prompts / rate + args.request_timeout + quality.DRAIN_SLACK_S
    sim = fleet.write_config(work_dir / f"sim-{workload}.yaml", overrides)
    return Job(workload, sim, path, f"{header}, {args.replicas} replicas", limit)


def open_loop_rate(args: argparse.Namespace, workload: str) -> float:
    return float(quality.RATE_PER_REPLICA[workload] * args.replicas * args.rate_scale)


@dataclasses.dataclass
class Router:
    service: Service
    url: str
    metrics_url: str


class Bench:
    """Runs (workload, arm) pairs; owns every process it starts."""

    def __init__(self, args: argparse.Namespace, work_dir: Path, vllm_router: str | None
                 ) -> None:
        self.args = args
        self.work_dir = work_dir
        self.vllm_router = vllm_router
        self.src = export_ref(args.dpserve_ref, work_dir) if args.dpserve_ref else None
        self.services: list[Service] = []

    def measure(self, job: Job, arm: Arm) -> Row:
        attempts = []
        for attempt in range(1 + self.args.retries):
            fleet.wait_for_quiet(self.args.quiet_cores, self.args.quiet_wait)
            started = time.monotonic()
            row = self.run(job, arm)
            row.wall_s = round(time.monotonic() - started, 1)
            row.load_average = os.getloadavg()[0]
            attempts.append(row)
            _say(row)
            if row.fleet is None or not row.fleet.distorted:
                break
            if attempt < self.args.retries:
                print("  again, on a fresh fleet and routers", flush=True)
        return min(attempts, key=lambda r: (r.fleet.very_late_share or 0.0) if r.fleet
                   else math.inf)

    def run(self, job: Job, arm: Arm) -> Row:
        row = Row(workload=job.workload, arm=arm)
        tag = f"{job.workload}-{arm.name.replace(':', '-')}"
        try:
            urls = fleet.start_fleet(self.args.replicas, job.sim_config, self.work_dir,
                                     self.services, cwd=self.src)
            peer_ports = free_ports(arm.routers) if arm.peers else []
            try:
                routers = [self._start_router(arm, urls, f"{tag}-{i}", peer_ports, i)
                           for i in range(arm.routers)]
            except RuntimeError as exc:
                row.error = f"router did not start: {exc}"
                return row
            meter = CpuMeter([r.service.pid for r in routers])
            before, cpu = fleet.sample(urls), meter.seconds()
            row.load = self._load(job, [r.url for r in routers], urls, tag)
            after_cpu = meter.seconds()
            row.fleet = fleet.delta(before, fleet.sample(urls))
            row.cpu_s = None if cpu is None or after_cpu is None else after_cpu - cpu
            for r in routers:
                row.kv = add_series(row.kv, kv_series(
                    http_call(r.metrics_url, timeout=5.0)[1].decode(errors="replace")))
            if row.load is None:
                row.error = f"the load run failed; see {self.work_dir}/load-{tag}.log"
            elif job.workload == "chat-deploy" and row.load.get("reset_s") is not None:
                row.deploy_windows = chat_load.window_means(
                    row.load["turns"], row.load["reset_s"] - 20.0, 10.0, 4)
        finally:
            stop_all(self.services)
        return row

    def _start_router(self, arm: Arm, urls: list[str], tag: str, peer_ports: list[int],
                      me: int) -> Router:
        port, metrics_port = free_ports(2)
        url = f"http://{HOST}:{port}"
        sim = build_sim_config({}, fleet.SIM_CONFIG)
        cmd = router_command(arm, urls, port, metrics_port, tokenizer="sim",
                             peer_ports=peer_ports, me=me, vllm_router=self.vllm_router,
                             block_size=sim.block_size, model=sim.model)
        service = start_service(f"router-{tag}", cmd.argv, self.work_dir,
                                env={**os.environ, **cmd.env} if cmd.env else None,
                                cwd=self.src if arm.kind == "dpserve" else None)
        self.services.append(service)
        quality.wait_ready(service, url, arm.kind, len(urls))
        if arm.policy == "kv-aware":
            wait_following(service, cmd.metrics_url, len(urls))
        return Router(service, url, cmd.metrics_url)

    def _load(self, job: Job, router_urls: list[str], replica_urls: list[str], tag: str
              ) -> dict[str, Any] | None:
        result = self.work_dir / f"load-{tag}.json"
        if job.workload in CHAT:
            module = "benchmarks.routing.chat_load"
            spec: dict[str, Any] = {
                "base_urls": router_urls, "conversations": str(job.load_input),
                "request_timeout_s": self.args.request_timeout, "result_json": str(result),
                "replica_urls": replica_urls,
                "reset_at_s": self.args.reset_at if job.workload == "chat-deploy" else None}
        else:
            module = "benchmarks.routing.load"
            spec = {"base_urls": router_urls, "dataset_path": str(job.load_input),
                    "num_prompts": self.args.num_prompts,
                    "request_rate": open_loop_rate(self.args, job.workload),
                    "seed": self.args.seed, "request_timeout_s": self.args.request_timeout,
                    "duration_s": None, "result_json": str(result), "labels": {"run": tag}}
        spec_path = self.work_dir / f"load-{tag}.spec.json"
        spec_path.write_text(json.dumps(spec))
        load = start_service(f"load-{tag}", [sys.executable, "-m", module, str(spec_path)],
                             self.work_dir, cwd=REPO)
        self.services.append(load)
        try:
            code = load.proc.wait(job.limit_s)
        except subprocess.TimeoutExpired:
            print(f"  load run exceeded {job.limit_s:.0f} s; stopped", flush=True)
            return None
        if code != 0 or not result.exists():
            print(f"  load run exited with code {code}:\n{load.log_tail(5)}", flush=True)
            return None
        return dict(json.loads(result.read_text()))


def _say(row: Row) -> None:
    f = row.fleet
    line = f"  {row.error}" if row.error else (
        f"  hit rate {100 * (row.hit_rate or 0):.1f}%, TTFT mean {row.ttft_mean or 0:,.0f} ms,"
        f" p99 {row.ttft_p99 or 0:,.0f} ms, router CPU {row.cpu_ms_per_request or 0:.2f} "
        f"ms/req, kv {row.kv_summary()}, {row.wall_s} s")
    print(line, flush=True)
    if f is not None and f.distorted:
        print(f"  WARNING: the simulator was distorted (load average {row.load_average:.1f}):"
              f" {100 * (f.very_late_share or 0):.1f}% of steps > 10 ms late, "
              f"{f.resyncs:.0f} > 100 ms", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, quality.raise_interrupt)
    work_dir = Path(tempfile.mkdtemp(prefix="dpserve-routing-kv-"))
    bench: Bench | None = None
    failed = True
    rows: list[Row] = []
    started = time.monotonic()
    try:
        versions = {"dpserve": quality.describe(args.dpserve_ref)}
        vllm_router = None
        if any(a.kind == "vllm-router" for a in args.arms):
            try:
                vllm_router = ensure_tool("vllm-router", args.vllm_router_spec)
                versions["vllm-router"] = vllm_router_version(vllm_router)
            except RuntimeError as exc:
                print(f"note: vllm-router is not measured: {exc}")
        bench = Bench(args, work_dir, vllm_router)
        print(f"{len(args.workloads)} workload(s) x {len(args.arms)} arm(s), {args.replicas} "
              f"simulated replicas; {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f}; {versions}", flush=True)
        headers = {}
        for workload in args.workloads:
            job = prepare(args, workload, work_dir)
            headers[workload] = job.header
            for arm in args.arms:
                print(f"{workload} through {arm.label} ...", flush=True)
                rows.append(bench.measure(job, arm))
        total = time.monotonic() - started
        print_tables(rows, headers)
        results = verdicts(rows)
        print(f"\n{len(rows)} runs in {total / 60:.1f} min")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "args": {k: str(v) if isinstance(v, Path) else v
                         for k, v in vars(args).items() if k != "arms"},
                "arms": [a.name for a in args.arms], "versions": versions,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": os.cpu_count(),
                "wall_s": round(total), "headers": headers,
                "runs": [r.as_dict() for r in rows], "verdicts": results}, indent=1,
                default=str))
            print(f"results written to {args.json}")
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


if __name__ == "__main__":
    sys.exit(main())
