"""Routing on KV events on real vLLM CPU replicas: dpserve's prefix affinity and
kv-aware (1 router, 2, 2 with peers, 1 with data-plane workers: ``dpserve:kv-aware:w2``)
against vllm-router's cache_aware and kv_aware.

    python -m benchmarks.routing.real_kv [--replicas 2] [--conversations 32] [--turns 4]
        [--pressure 0.75,1.5] [--rounds 3] [--arms ...] [--json OUT]

The fleet: ``--replicas`` vLLM CPU engines of the tiny model (``make model``), one core
each, started here as ``dpserve serve`` starts them (``TINY_VLLM_ARGS``, dev endpoints)
but publishing KV events on TCP (``tcp://*:PORT``) so every router, dpserve's and
vllm-router's, reads the same sockets from ``GET /kv_event_sources``. Each engine's KV
cache is ``--num-gpu-blocks-override`` blocks, sized so the conversations' working set is
``--pressure`` times the fleet's cache (estimated with the model's tokenizer and chat
template, answers counted at ``--max-tokens``). One fleet per pressure.

Per round, every arm in turn (the order rotated each round): every replica's prefix
cache reset (``POST /reset_prefix_cache``), the arm's router process(es) started against
the replicas, the chats of ``real_chat.py`` (the same conversations for every arm of a
round, new ones each round), the engines' own counts before and after (prefix-cache hits and
queries; per request, their TTFT from its arrival at the engine, split into the time in
the engine's queue and prefilling; preemptions), the routers' CPU. A client's TTFT
above the engine's is the router, the network and the client waiting for a core; a
dpserve router's own time to the first byte from a replica (`/metrics`) splits it.
dpserve's kv-aware reads prompts with ``--tokenizer`` on the model's own tokenizer and
chat template; vllm-router's kv_aware with the engines' block size (128 on CPU) and the served name.

By default the machine is shared: 2 engines on 2 cores with the routers and the client
beside them, so TTFT includes the routers waiting for a core (each router's event-loop lag
is reported). ``--engine-cpus 0 --router-cpus 1`` gives the routers and the client a core
of their own, as a deployment would: the engines share the other. Hit rates are the
engines' own. Exit status 0 when every run completed, 1 when one could not be made.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.services import (
    HOST,
    CpuMeter,
    Service,
    free_ports,
    http_call,
    start_service,
    stop_all,
    wait_until_ok,
)
from benchmarks.common.tools import (
    REPO,
    VLLM_ROUTER_SPEC,
    ensure_tool,
)
from benchmarks.routing import quality, real_chat
from benchmarks.routing.kv_routers import router_command, wait_following
from benchmarks.routing.quality_kv_report import Arm, parse_arm
from dpserve.demo import TINY_VLLM_ARGS
from dpserve.demo.run import OFFLINE_ENV
from dpserve.replicas.launcher import VLLM_ENTRY
from dpserve.tinymodel import TINY_MODEL_NAME

BLOCK_SIZE = 128
"""vLLM's CPU block size."""
ARMS = ("dpserve:prefix-affinity,dpserve:prefix-affinity:2,dpserve:kv-aware,"
        "dpserve:kv-aware:2,dpserve:kv-aware:2:peers,vllm-router:cache_aware,"
        "vllm-router:kv_aware")
READY_S = 300.0
NA = "n/a"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--model", type=Path, default=REPO / "build" / "tiny-llama")
    add("--replicas", type=int, default=2)
    add("--conversations", type=int, default=32)
    add("--turns", type=int, default=4)
    add("--system-sentences", type=int, default=15, help="~25 tokens each")
    add("--max-tokens", type=int, default=32)
    add("--think-s", type=float, default=1.0)
    add("--start-window-s", type=float, default=8.0)
    add("--pressure", default="0.75,1.5", help="working set / fleet KV cache, one fleet each")
    add("--rounds", type=int, default=3)
    add("--arms", default=ARMS)
    add("--seed", type=int, default=0)
    add("--request-timeout", type=float, default=60.0)
    add("--vllm-router-spec", default=VLLM_ROUTER_SPEC)
    add("--engine-cpus", metavar="LIST", help="run every engine (API server and engine "
        "core) on these CPUs, e.g. 0 (default: engine i on CPU i, unpinned servers)")
    add("--router-cpus", metavar="LIST", help="run the routers and the client on these "
        "CPUs, e.g. 1: a router on cores of its own, as in a deployment")
    add("--json", type=Path, metavar="OUT")
    add("--logs", type=Path, metavar="DIR", help="keep every process's log here")
    args = p.parse_args(argv)
    try:
        args.pressure = [float(x) for x in args.pressure.split(",") if x.strip()]
        args.arms = [parse_arm(a) for a in args.arms.split(",") if a.strip()]
    except ValueError as exc:
        p.error(f"--pressure/--arms: {exc}")
    if not args.pressure or min(args.pressure) <= 0:
        p.error("--pressure: one or more positive numbers")
    if min(args.replicas, args.conversations, args.turns, args.rounds) < 1:
        p.error("--replicas, --conversations, --turns and --rounds must be >= 1")
    for flag, spec in (("--engine-cpus", args.engine_cpus), ("--router-cpus", args.router_cpus)):
        try:
            if spec and not parse_cpus(spec) <= os.sched_getaffinity(0):
                p.error(f"{flag}: {spec} names CPUs this process may not use "
                        f"({sorted(os.sched_getaffinity(0))})")
        except ValueError:
            p.error(f"{flag}: {spec!r} is not a CPU list such as 0 or 0,2-3")
    if not (args.model / "config.json").is_file():
        p.error(f"--model: {args.model} has no config.json (run `make model`)")
    return args


def working_set_blocks(model: Path, convs: Sequence[real_chat.Conversation],
                       max_tokens: int) -> int:
    """Blocks the conversations' last turns occupy, answers counted at ``max_tokens``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    answer = str(tok.decode(list(range(100, 100 + max_tokens))))
    total = 0
    for c in convs:
        messages: list[dict[str, str]] = [{"role": "system", "content": c.system}]
        for q in c.questions:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]
        text = tok.apply_chat_template(messages, tokenize=False)
        total += math.ceil(len(tok(text, add_special_tokens=False)["input_ids"]) / BLOCK_SIZE)
    return total


@dataclasses.dataclass
class Run:
    pressure: float
    round: int
    arm: str
    hits: float = 0.0
    queries: float = 0.0
    ttft_ms: list[float] = dataclasses.field(default_factory=list)
    head_ms: list[float] = dataclasses.field(default_factory=list)
    """Per answered turn, when the client had the answer's head (a dpserve router sends
    it with the replica's first chunk)."""
    by_replica: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """The client's TTFT of the turns each replica served."""
    failed: int = 0
    cpu_s: float | None = None
    requests: int = 0
    moved: int | None = None
    """Turns served by another replica than the turn before (None: the router does not
    name the replica)."""
    engine: dict[str, float] = dataclasses.field(default_factory=dict)
    """The engines' own counts over the run (`ENGINE_SERIES`' short names)."""

    error: str | None = None

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.services: list[Service] = []
        self.vllm_router: str | None = None
        if any(a.kind == "vllm-router" for a in args.arms):
            self.vllm_router = ensure_tool("vllm-router", args.vllm_router_spec)

    def start_fleet(self, blocks: int) -> list[str]:
        urls = []
        for i in range(self.args.replicas):
            port, pub, replay = free_ports(3)
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                      "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
            argv = [sys.executable, *VLLM_ENTRY, "--model", str(self.args.model.resolve()),
                    "--served-model-name", TINY_MODEL_NAME, "--host", HOST, "--port",
                    str(port), "--kv-events-config", json.dumps(config), *TINY_VLLM_ARGS,
                    "--num-gpu-blocks-override", str(blocks)]
            cpus = self.args.engine_cpus or str(i % (os.cpu_count() or 1))
            if self.args.engine_cpus:
                argv = ["taskset", "-c", cpus, *argv]
            env = {**os.environ, **OFFLINE_ENV, "VLLM_SERVER_DEV_MODE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": cpus,
                   "VLLM_CPU_KVCACHE_SPACE": "1", "CUDA_VISIBLE_DEVICES": ""}
            self.services.append(start_service(f"engine-r{i}-{blocks}", argv, self.work,
                                               env=env))
            urls.append(f"http://{HOST}:{port}")
        deadline = time.monotonic() + READY_S
        for service, url in zip(self.services, urls, strict=True):
            while http_call(f"{url}/health", timeout=2.0)[0] != 200:
                service.check_alive("start-up")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} not healthy in {READY_S:.0f} s")
                time.sleep(1.0)
        for url in urls:  # the engine's one-time set-up of its first request, not measured
            body = json.dumps({"model": TINY_MODEL_NAME, "prompt": "warm", "max_tokens": 2})
            http_call(f"{url}/v1/completions", body.encode(), timeout=120.0)
        return urls

    def run(self, arm: Arm, urls: list[str], convs: list[real_chat.Conversation],
            out: Run) -> None:
        for url in urls:
            status, body = http_call(f"{url}/reset_prefix_cache", b"", timeout=30.0)
            if status != 200:
                raise RuntimeError(f"{url}/reset_prefix_cache: HTTP {status} {body[:200]!r}")
        started: list[Service] = []
        try:
            peer_ports = free_ports(arm.routers) if arm.peers else []
            routers = []
            for me in range(arm.routers):
                service, url = self._router(arm, urls, peer_ports, me, out)
                started.append(service)
                routers.append(url)
            meter = CpuMeter([s.pid for s in started])
            firsts = [f"{u}/metrics" for u in routers] if arm.kind == "dpserve" else []
            before, cpu0 = engine_counts(urls), meter.seconds()
            first0 = scraped_totals(firsts, ROUTER_SERIES)
            turns = real_chat.play(routers, convs, model=TINY_MODEL_NAME,
                                   max_tokens=self.args.max_tokens,
                                   timeout_s=self.args.request_timeout)
            cpu1, after = meter.seconds(), engine_counts(urls)
            first1 = scraped_totals(firsts, ROUTER_SERIES)
        finally:
            for s in started:
                s.stop()
        out.engine = {name: after[name] - before[name] for name in after}
        if firsts:
            out.engine |= {name: first1[name] - first0[name] for name in first1}
        out.hits, out.queries = out.engine["hits"], out.engine["queries"]
        out.cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
        out.requests = len(turns)
        out.failed = sum(t.error is not None for t in turns)
        done = [t for t in turns if t.error is None and t.ttft_s]
        out.ttft_ms = [t.ttft_s * 1000 for t in done if t.ttft_s]
        out.head_ms = [t.head_s * 1000 for t in done if t.head_s is not None]
        for t in done:
            if t.replica and t.ttft_s:
                out.by_replica.setdefault(t.replica, []).append(t.ttft_s * 1000)
        if any(t.replica for t in turns):
            last: dict[int, str | None] = {}
            out.moved = 0
            for t in sorted(turns, key=lambda t: (t.conversation, t.turn)):
                if t.conversation in last and t.replica and t.replica != last[t.conversation]:
                    out.moved += 1
                last[t.conversation] = t.replica

    def _router(self, arm: Arm, urls: list[str], peer_ports: list[int], me: int,
                out: Run) -> tuple[Service, str]:
        port, metrics_port = free_ports(2)
        url = f"http://{HOST}:{port}"
        tag = f"router-{out.pressure:g}-{out.round}-{arm.name.replace(':', '-')}-{me}"
        cmd = router_command(arm, urls, port, metrics_port,
                             tokenizer=str(self.args.model.resolve()), peer_ports=peer_ports,
                             me=me, vllm_router=self.vllm_router, block_size=BLOCK_SIZE,
                             model=TINY_MODEL_NAME)
        argv = cmd.argv if not self.args.router_cpus else [
            "taskset", "-c", self.args.router_cpus, *cmd.argv]
        service = start_service(tag, argv, self.work,
                                env={**os.environ, **OFFLINE_ENV, **cmd.env}, cwd=REPO)
        try:
            quality.wait_ready(service, url, arm.kind, len(urls))
            if arm.kind == "dpserve":  # /ready: the tokenizer loaded too
                wait_until_ok(service, f"{url}/ready", READY_S)
            if arm.policy == "kv-aware":
                wait_following(service, cmd.metrics_url, len(urls))
        except BaseException:
            service.stop()
            raise
        return service, url


ENGINE_SERIES = {
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:time_to_first_token_seconds_sum": "ttft_s",
    "vllm:time_to_first_token_seconds_count": "ttft_n",
    "vllm:request_queue_time_seconds_sum": "queue_s",
    "vllm:request_queue_time_seconds_count": "queue_n",
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:request_prefill_time_seconds_count": "prefill_n",
    "vllm:num_preemptions_total": "preemptions",
}
"""What the engines count, summed over the fleet: their prefix cache in tokens, and per
request their own TTFT (from arrival at the engine), the time waiting in its queue
and the time prefilling, and the preemptions (a request pushed out for KV space)."""


ROUTER_SERIES = {
    "dpserve_time_to_first_byte_seconds_sum": "router_s",
    "dpserve_time_to_first_byte_seconds_count": "router_n",
    "dpserve_event_loop_lag_seconds_sum": "lag_s",
    "dpserve_event_loop_lag_seconds_count": "lag_n",
    'dpserve_event_loop_lag_seconds_bucket{le="0.01"}': "lag_fast",
    'dpserve_kv_routing_decisions_total{basis="events"}': "on_events",
    "dpserve_kv_event_batches_total": "event_batches",
    'dpserve_kv_routed_tokens_total{kind="prompt"}': "expected_prompt",
    'dpserve_kv_routed_tokens_total{kind="cached"}': "expected_cached",
}
"""A dpserve router's time from taking a request to the first byte from a replica, its
event loop's lag (samples within 10 ms: `lag_fast`), and with kv-aware the requests
placed on events and the event batches applied."""


def parse_cpus(spec: str) -> set[int]:
    """`0,2-3` -> {0, 2, 3} (taskset's list syntax)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def engine_counts(urls: Sequence[str]) -> dict[str, float]:
    """The fleet's totals of `ENGINE_SERIES` (by their short names)."""
    return scraped_totals([f"{url}/metrics" for url in urls], ENGINE_SERIES)


def scraped_totals(metrics_urls: Sequence[str], series: dict[str, str]) -> dict[str, float]:
    """The samples of `series` (exposition name, or name and labels as exposed -> short
    name) summed over every label set and every `/metrics` in `metrics_urls`."""
    totals = dict.fromkeys(series.values(), 0.0)
    for url in metrics_urls:
        status, body = http_call(url, timeout=5.0)
        if status != 200:
            raise RuntimeError(f"{url}: HTTP {status}")
        for line in body.decode(errors="replace").splitlines():
            name = series.get(line.split("{", 1)[0].split(" ", 1)[0]) or series.get(
                line.rsplit(" ", 1)[0])
            if name is not None:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def percentile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def report(runs: Sequence[Run], arms: Sequence[Arm]) -> None:
    for pressure in sorted({r.pressure for r in runs}):
        print(f"\n## working set / fleet cache {pressure:g}: medians over rounds "
              "[min, max]; TTFT ms of every round's turns pooled")
        print("| arm | hit rate | TTFT mean | p50 | p99 | client head | router first byte | "
              "engine TTFT | queue | prefill | preempted | moved turns | failed | "
              "router CPU ms/req | loop lag mean | lag > 10 ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for arm in arms:
            mine = [r for r in runs if r.pressure == pressure and r.arm == arm.name]
            if not mine:
                continue
            ttft = [x for r in mine for x in r.ttft_ms]
            rates = [r.hit_rate for r in mine if r.hit_rate is not None]
            cpu = [r.cpu_s * 1000 / r.requests for r in mine if r.cpu_s and r.requests]
            head = [x for r in mine for x in r.head_ms]
            print(f"| {arm.label} | {_spread(rates, pct=True)} | "
                  f"{_num(statistics.fmean(ttft) if ttft else None)} | "
                  f"{_num(percentile(ttft, 50))} | {_num(percentile(ttft, 99))} | "
                  f"{_num(statistics.fmean(head) if head else None)} | "
                  f"{_engine_ms(mine, 'router')} | "
                  f"{_engine_ms(mine, 'ttft')} | {_engine_ms(mine, 'queue')} | "
                  f"{_engine_ms(mine, 'prefill')} | "
                  f"{_num(sum(r.engine.get('preemptions', 0.0) for r in mine))} | "
                  f"{_moved(mine)} | {sum(r.failed for r in mine)} | "
                  f"{_num(statistics.median(cpu) if cpu else None, 1)} | "
                  f"{_engine_ms(mine, 'lag', 1)} | {_slow_loop(mine)} |")
        for a, b in (("dpserve:kv-aware:2", "dpserve:kv-aware"),
                     ("dpserve:kv-aware:2:peers", "dpserve:kv-aware"),
                     ("dpserve:kv-aware", "dpserve:prefix-affinity"),
                     ("dpserve:kv-aware:w2", "dpserve:kv-aware"),
                     ("dpserve:kv-aware:2:peers", "dpserve:prefix-affinity:2")):
            pairs = _pairs(runs, pressure, a, b)
            if pairs:
                print(f"- {a} / {b}, per round: hit rate "
                      f"{_spread([x for x, _ in pairs])}, mean TTFT "
                      f"{_spread([y for _, y in pairs])}")


def _engine_ms(runs: Sequence[Run], what: str, digits: int = 0) -> str:
    """The engines' (or routers') mean over every round's samples (NA where they count
    none)."""
    total = sum(r.engine.get(f"{what}_s", 0.0) for r in runs)
    n = sum(r.engine.get(f"{what}_n", 0.0) for r in runs)
    return _num(total / n * 1000, digits) if n else NA


def _slow_loop(runs: Sequence[Run]) -> str:
    """The share of the routers' loop-lag samples above 10 ms."""
    n = sum(r.engine.get("lag_n", 0.0) for r in runs)
    fast = sum(r.engine.get("lag_fast", 0.0) for r in runs)
    return f"{(n - fast) / n:.1%}" if n else NA


def _kv(run: Run) -> str:
    if not run.engine.get("event_batches"):
        return ""
    expected = run.engine.get("expected_cached")
    said = "" if expected is None else (
        f"; the router expected {expected:,.0f} of {run.engine.get('expected_prompt', 0):,.0f}"
        f" prompt tokens cached where it sent them, the engines hit {run.hits:,.0f} of "
        f"{run.queries:,.0f}")
    return (f"; placed on events {run.engine.get('on_events', 0):.0f}, "
            f"{run.engine['event_batches']:.0f} event batches{said}")


def _per_replica(run: Run) -> str:
    return ", ".join(f"{rid} {len(xs)} turns {statistics.fmean(xs):,.0f} ms"
                     for rid, xs in sorted(run.by_replica.items()))


def _moved(runs: Sequence[Run]) -> str:
    moved = [r.moved for r in runs if r.moved is not None]
    return NA if not moved else str(sum(moved))


def _pairs(runs: Sequence[Run], pressure: float, a: str, b: str
           ) -> list[tuple[float, float]]:
    out = []
    for rnd in sorted({r.round for r in runs}):
        ra = [r for r in runs if (r.pressure, r.round, r.arm) == (pressure, rnd, a)]
        rb = [r for r in runs if (r.pressure, r.round, r.arm) == (pressure, rnd, b)]
        if ra and rb and ra[0].hit_rate and rb[0].hit_rate and ra[0].ttft_ms and rb[0].ttft_ms:
            out.append((ra[0].hit_rate / rb[0].hit_rate,
                        statistics.fmean(ra[0].ttft_ms) / statistics.fmean(rb[0].ttft_ms)))
    return out


def _spread(xs: Sequence[float], pct: bool = False) -> str:
    if not xs:
        return NA
    spec = ".1%" if pct else ".3f"
    return (f"{statistics.median(xs):{spec}} [{min(xs):{spec}}, {max(xs):{spec}}]")


def _error(run: Run) -> str:
    return f", ERROR {run.error}" if run.error else ""


def _num(x: float | None, digits: int = 0) -> str:
    return NA if x is None else f"{x:,.{digits}f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    runs: list[Run] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="real-kv-") as tmp:
        work = args.logs or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        bench = Bench(args, work)
        try:
            for pressure in args.pressure:
                convs0 = real_chat.conversations(
                    args.conversations, args.turns, system_sentences=args.system_sentences,
                    start_window_s=args.start_window_s, think_s=args.think_s, seed=args.seed)
                ws = working_set_blocks(args.model, convs0, args.max_tokens)
                blocks = max(math.ceil(1024 / BLOCK_SIZE) + 1,
                             math.ceil(ws / args.replicas / pressure))
                print(f"# pressure {pressure:g}: working set ~{ws} blocks of {BLOCK_SIZE}, "
                      f"{blocks} per replica x {args.replicas}", flush=True)
                urls = bench.start_fleet(blocks)
                if args.router_cpus:  # the client beside the routers, off the engines'
                    os.sched_setaffinity(0, parse_cpus(args.router_cpus))
                for rnd in range(args.rounds):
                    convs = real_chat.conversations(
                        args.conversations, args.turns,
                        system_sentences=args.system_sentences,
                        start_window_s=args.start_window_s, think_s=args.think_s,
                        seed=args.seed + rnd)
                    order = args.arms[rnd % len(args.arms):] + args.arms[:rnd % len(args.arms)]
                    for arm in order:
                        run = Run(pressure, rnd, arm.name)
                        try:
                            bench.run(arm, urls, convs, run)
                        except RuntimeError as exc:
                            run.error, failed = str(exc)[:2000], True
                        runs.append(run)
                        print(f"  round {rnd} {arm.label}: hit "
                              f"{_num((run.hit_rate or 0) * 100, 1)}%, "
                              f"{len(run.ttft_ms)} ok, {run.failed} failed, moved "
                              f"{NA if run.moved is None else run.moved}, TTFT mean "
                              f"{_num(statistics.fmean(run.ttft_ms) if run.ttft_ms else None)}"
                              f" ms (router's first byte {_engine_ms([run], 'router')}, "
                              f"engine {_engine_ms([run], 'ttft')}: queue "
                              f"{_engine_ms([run], 'queue')}; loop lag "
                              f"{_engine_ms([run], 'lag', 1)} ms, {_slow_loop([run])} "
                              f"> 10 ms; {_per_replica(run)}{_kv(run)}){_error(run)}",
                              flush=True)
                stop_all(bench.services)
        finally:
            stop_all(bench.services)
    report(runs, args.arms)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
