"""Rolling out a new checkpoint under load: what clients see while it runs, and (with
`--restart`) hot-loading against restarting each replica.

For each load shape (`--load closed`: `--clients` requests back to back; `open`: Poisson
arrivals at `--rate` req/s, at most `--clients` in flight; default both), two fresh
fleets of N real vLLM CPU replicas of the tiny model (default 2), started as `make demo`
starts them (`--enforce-eager --dtype float32`), each rolled twice by hot-load
(`dpserve deploy`'s path: validate, then per replica canary on the old weights, drain,
pause, reload, reset the prefix cache, resume, canary, re-admit):

- **warm** — dpserve as it runs: a replica answers a warm-up request (the canary's
  shape: greedy, with logprobs) before it first enters rotation;
- **cold** — the baseline: replicas enter rotation on their health checks alone, so the
  engine's one-time set-up of the logprobs path (seconds) is paid by the first deploy's
  canary while the replica serves, and by every request batched beside it.

Per fleet: `--steady-s` of load, the **first** deploy after the engines start, then
`--later` more deploys, each after `--steady-s` of load. With `--restart`, the last
fleet then rolls by restarting each replica in turn (drain, wait for in-flight requests,
stop, start on the new checkpoint, wait until healthy, re-admit).

Requests are streamed completions (random 32-token prompts, 16 output tokens) sent and
timed by loadtest's client (TTFT as vLLM's benchmark times it). Per deploy: wall time,
each replica's time out of rotation, failed and aborted requests while it ran, TTFT
p50/p99 of the requests waiting for a first token at any moment of it against the steady
window just before (see `windows`), and completed req/s over the rolling window
(the deploy, or `--window-s` from its start if longer) against the steady window.
Targets (issue: rollouts users don't notice): rolling p99 TTFT <= 2x steady p99,
throughput >= 0.9x the offered rate (open loop; closed loop: the steady rate), 0 failed,
0 aborted.

    python -m benchmarks.deploy.rollout [--load closed|open|both] [--replicas 2] [--clients 8]
                                 [--rate 8] [--steady-s 10] [--later 3] [--window-s 10]
                                 [--admission warm|cold|both] [--fleets 1] [--restart]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common.fleet import Fleet, fleet, wait_until
from benchmarks.deploy.windows import Deploy, Window, ms, percentile_ms, window
from dpserve.replicas.supervisor import Supervisor
from dpserve.rollout.deployed import Deployed, weights_for
from dpserve.rollout.progress import DeployOptions
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.tinymodel import TINY_MODEL_NAME, build_tiny_model
from loadtest.arrivals import arrival_offsets
from loadtest.client import ENDPOINT_PATHS, RequestRecord
from loadtest.config import RunConfig
from loadtest.harness import build_workload
from loadtest.runner import LoadPlan, run_load

PROMPTS = 200
LOAD_FOR_AT_MOST_S = 3600
P99_RATIO_TARGET = 2.0
THROUGHPUT_TARGET = 0.9
RollResult = tuple[list[float], dict[str, float], list[str]]
"""What a roll returns: seconds out of rotation per replica, the slowest replica's step
times, the deploy record's timed events."""


@dataclass(frozen=True)
class Rolled:
    load: str
    admission: str
    """warm | cold"""
    deploy: Deploy
    window: Window
    rate: float
    """Completed req/s over the rolling window."""
    steady_rate: float
    offered: float | None
    """Open loop: requests due in the rolling window, per second."""


def make_checkpoints(model: Path, out: Path) -> list[Path]:
    """Two checkpoints of the model (weights moved, as fine-tuning would), written with
    the real checkpoint writer. How they were trained does not change rollout speed."""
    import torch
    from safetensors.torch import load_file, save_file

    from dpserve import checkpoint as ckpt

    made = []
    for step in (1, 2):
        def fill(tmp: Path, step: int = step) -> None:
            for f in model.iterdir():
                if f.is_file() and not f.name.startswith("."):
                    (tmp / f.name).write_bytes(f.read_bytes())
            g = torch.Generator().manual_seed(step)
            tensors = {k: v + 0.02 * torch.randn(v.shape, generator=g)
                       for k, v in load_file(str(model / "model.safetensors")).items()}
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        made.append(ckpt.write_checkpoint(out, step, fill, base_model=str(model), loss=None,
                                          world_size=1))
    return made


def load_plan(url: str, model: Path, shape: str, args: argparse.Namespace,
              stop: asyncio.Event) -> LoadPlan:
    config = RunConfig(base_url=url, tokenizer=model, num_prompts=PROMPTS,
                       random_input_len=32, random_output_len=args.max_tokens)
    rate = args.rate if shape == "open" else float("inf")
    count = int(args.rate * LOAD_FOR_AT_MOST_S) if shape == "open" else 1_000_000
    return LoadPlan(url=url + ENDPOINT_PATHS["completions"],
                    payloads=build_workload(config, TINY_MODEL_NAME).payloads,
                    offsets=arrival_offsets(count, request_rate=rate, seed=0),
                    max_concurrency=args.clients, stop=stop,
                    request_id_prefix=f"rollout-bench-{shape}-")


async def hot_load(f: Fleet, checkpoint: Path) -> RollResult:
    progress = await f.rollout.start(str(checkpoint), DeployOptions())
    await f.rollout.wait()
    if progress.state.value != "succeeded":
        raise RuntimeError(f"hot-load deploy {progress.state.value}: {progress.error}")
    steps: dict[str, float] = {}
    for r in progress.replicas:
        for name, took in r.steps.items():
            steps[name] = max(steps.get(name, 0.0), took)
    return [r.seconds or 0.0 for r in progress.replicas], steps, list(progress.events)


async def restart_each(pool: ReplicaPool, supervisor: Supervisor, deployed: Deployed,
                       checkpoint: Path, startup_s: float) -> RollResult:
    deployed.current = weights_for(str(checkpoint))  # what restarted replicas load
    took = []
    for replica in pool:
        def drained(r: Replica = replica) -> bool:
            return r.in_flight == 0

        def back(r: Replica = replica) -> bool:
            return (r.state is ReplicaState.READY
                    and r.weight_version == deployed.current.version)

        t0 = time.perf_counter()
        pool.set_state(replica, ReplicaState.DRAINING, "rolling restart")
        await wait_until(drained, 600, "drained replica")
        await supervisor.restart(replica.id, "rolling restart onto the new checkpoint")
        await wait_until(back, startup_s, "restarted replica")
        took.append(time.perf_counter() - t0)
    return took, {}, []


Roll = Callable[[], Awaitable[RollResult]]


async def measure(label: str, roll: Roll, args: argparse.Namespace) -> Deploy:
    """`--steady-s` of load, then `roll`; returns once the rolling window is over."""
    t_steady = time.perf_counter()
    await asyncio.sleep(args.steady_s)
    t0 = time.perf_counter()
    per_replica, steps, events = await roll()
    t_done = time.perf_counter()
    await asyncio.sleep(max(0.0, t0 + args.window_s - t_done))
    print(f"  {label}: {t_done - t0:.2f} s", flush=True)
    return Deploy(label=label, kind="full", round=label, t_steady=t_steady, t0=t0,
                  t_started=t0, t_done=t_done, t_end=t_done, per_replica=per_replica,
                  steps=steps, events=events)


def offered_rate(records: list[RequestRecord], t_base: float, t0: float, t1: float) -> float:
    """Open loop: requests due in [t0, t1) per second (the Poisson draw itself, not the
    nominal rate: a 10 s window of 8 req/s holds 80 +- 9)."""
    due = sum(1 for r in records if t0 <= t_base + r.scheduled_s < t1)
    return due / max(t1 - t0, 1e-9)


def completed_rate(records: list[RequestRecord], t_base: float, t0: float, t1: float) -> float:
    done = sum(1 for r in records if r.ok and t0 <= t_base + r.end_s < t1)
    return done / max(t1 - t0, 1e-9)


async def one_fleet(model: Path, work: Path, checkpoints: list[Path], shape: str, warm: bool,
                    restart: bool, args: argparse.Namespace, k: int = 0) -> list[Rolled]:
    admission = "warm" if warm else "cold"
    print(f"{shape} loop, {admission} admission, fleet {k + 1}:", flush=True)
    async with fleet(model, work / f"{shape}-{admission}-{k}", args.replicas, warm_up=warm,
                     checkpoint_root=work) as f:
        stop = asyncio.Event()
        loading = asyncio.create_task(run_load(load_plan(f.url, model, shape, args, stop)))
        try:
            await asyncio.sleep(2.0)  # the load's own start-up, not measured
            deploys = [await measure("first deploy", lambda: hot_load(f, checkpoints[0]), args)]
            for i in range(args.later):
                target = checkpoints[(i + 1) % 2]
                deploys.append(await measure(f"later deploy {i + 1}",
                                             lambda t=target: hot_load(f, t), args))
            if restart:
                deploys.append(await measure("restart each", lambda: restart_each(
                    f.pool, f.supervisor, f.deployed, checkpoints[0],
                    f.cfg.startup_timeout_s), args))
        finally:
            stop.set()
            outcome = await loading
    records, t_base = outcome.records, outcome.started_perf_s
    rolled = []
    for d in deploys:
        t1 = max(d.t_done, d.t0 + args.window_s)
        rolled.append(Rolled(shape, admission, d, window(d, records, t_base),
                             completed_rate(records, t_base, d.t0, t1),
                             completed_rate(records, t_base, d.t_steady or d.t0, d.t0),
                             offered_rate(records, t_base, d.t0, t1) if shape == "open"
                             else None))
    return rolled


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def verdict(shape: str, which: str, rows: list[Rolled]) -> None:
    """The targets, on `rows` pooled (TTFT samples together, throughput ratios averaged).
    Closed loop has no offered rate: its throughput is against the steady state, which
    a saturating closed loop cannot keep with a replica out of rotation."""
    if not rows:
        return
    steady = [t for r in rows for t in r.window.steady_ttft_s]
    during = [t for r in rows for t in r.window.ttft_s]
    failed = [why for r in rows for why in r.window.failed]
    aborted = sum(r.window.aborted for r in rows)
    p99, p99_steady = percentile_ms(during, 99), percentile_ms(steady, 99)
    kept = [r.rate / (r.offered if r.offered is not None else r.steady_rate)
            for r in rows if (r.offered if r.offered is not None else r.steady_rate)]
    throughput = sum(kept) / len(kept) if kept else None
    met = {
        f"p99 {ms(during, 99)} ms <= 2x steady {ms(steady, 99)} ms":
            p99 is not None and p99_steady is not None and p99 <= P99_RATIO_TARGET * p99_steady,
        f"throughput {'-' if throughput is None else f'{throughput:.2f}'}x of "
        + ("offered" if shape == "open" else "steady") + f" >= {THROUGHPUT_TARGET}x":
            throughput is not None and throughput >= THROUGHPUT_TARGET,
        f"{len(failed)} failed": not failed, f"{aborted} aborted": not aborted}
    print(f"{shape} loop, {which} deploy{'s' if len(rows) > 1 else ''} ({len(rows)}, "
          f"{len(during)} requests during): " + ", ".join(
              f"{name} {'met' if ok else 'MISSED'}" for name, ok in met.items())
          + (f" (failed: {dict(Counter(failed))})" if failed else ""))


def report(results: list[Rolled], args: argparse.Namespace) -> None:
    rows = [("load", "admission", "deploy", "time", "per replica", "failed", "aborted",
             "TTFT p50 ms", "TTFT p99 ms", "p99 ratio", "req/s", "throughput", "requests")]
    for r in results:
        d, w = r.deploy, r.window
        base = r.offered if r.offered is not None else r.steady_rate
        rows.append((
            r.load, r.admission, d.label, f"{d.seconds:.2f} s",
            " / ".join(f"{s:.2f}" for s in d.per_replica) + " s",
            str(len(w.failed)), str(w.aborted),
            f"{ms(w.steady_ttft_s, 50)} -> {ms(w.ttft_s, 50)}",
            f"{ms(w.steady_ttft_s, 99)} -> {ms(w.ttft_s, 99)}",
            ratio(percentile_ms(w.ttft_s, 99), percentile_ms(w.steady_ttft_s, 99)),
            f"{r.steady_rate:.1f} -> {r.rate:.1f}",
            ratio(r.rate, base) + (" of offered" if r.offered is not None else " of steady"),
            f"{len(w.steady_ttft_s)} / {len(w.ttft_s)}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print("(time: deploy request to the last replica back; per replica: out of rotation; "
          "TTFT: steady window -> requests waiting for a first token during the deploy; "
          "req/s: completed, steady -> rolling window)")
    for r in results:
        if r.deploy.steps:
            print(f"{r.load} {r.admission} {r.deploy.label} steps, slowest replica: "
                  + ", ".join(f"{step} {took:.3f} s" for step, took in r.deploy.steps.items()))
    for r in results:  # where the time went in a deploy that missed a target
        p99, steady = percentile_ms(r.window.ttft_s, 99), percentile_ms(r.window.steady_ttft_s, 99)
        base = r.offered if r.offered is not None else r.steady_rate
        missed = (p99 is not None and steady and p99 > P99_RATIO_TARGET * steady) or (
            base and r.rate < THROUGHPUT_TARGET * base)
        if (missed or args.events) and r.deploy.events:
            print(f"{r.load} {r.admission} {r.deploy.label}"
                  f"{' (missed a target)' if missed else ''}, its events:")
            for event in r.deploy.events:
                print(f"    {event}")
    print()
    for shape in dict.fromkeys(r.load for r in results):
        for which in ("first", "later"):
            verdict(shape, which, [r for r in results if r.load == shape
                                   and r.admission == "warm"
                                   and r.deploy.label.startswith(which)])
    hot = [r for r in results if r.admission == "warm" and r.deploy.label != "restart each"]
    restarts = [r for r in results if r.deploy.label == "restart each"]
    if restarts and hot:
        slowest = max(r.deploy.seconds for r in hot)
        print(f"restarting each replica took {restarts[0].deploy.seconds:.1f} s: "
              f"{restarts[0].deploy.seconds / slowest:.0f}x the slowest hot-load")


async def run(args: argparse.Namespace) -> list[Rolled]:
    model = build_tiny_model(Path(args.model))
    work = Path(tempfile.mkdtemp(prefix="dpserve-rollout-bench-"))
    checkpoints = make_checkpoints(model, work / "out")
    shapes = ["closed", "open"] if args.load == "both" else [args.load]
    results: list[Rolled] = []
    admissions = {"both": (False, True), "warm": (True,), "cold": (False,)}[args.admission]
    for i, shape in enumerate(shapes):
        for warm in admissions:
            for k in range(args.fleets):
                last = i == len(shapes) - 1 and warm is admissions[-1] and k == args.fleets - 1
                results += await one_fleet(model, work, checkpoints, shape, warm,
                                           args.restart and last, args, k)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/tiny-llama", help="tiny model dir (built if missing)")
    p.add_argument("--load", choices=("closed", "open", "both"), default="both")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=8,
                   help="closed loop: clients; open loop: most requests in flight")
    p.add_argument("--rate", type=float, default=8.0, help="open loop: Poisson req/s")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--steady-s", type=float, default=10.0,
                   help="seconds of load measured before each deploy")
    p.add_argument("--later", type=int, default=3, help="deploys after the first, per fleet")
    p.add_argument("--window-s", type=float, default=10.0,
                   help="throughput is measured over the deploy or this long, if longer")
    p.add_argument("--admission", choices=("warm", "cold", "both"), default="both",
                   help="warm: dpserve as it runs; cold: the baseline without the warm-up")
    p.add_argument("--fleets", type=int, default=1,
                   help="fresh fleets per load shape and admission (each has one first "
                        "deploy; the verdicts pool them)")
    p.add_argument("--events", action="store_true",
                   help="print every deploy's timed events (default: those that missed a target)")
    p.add_argument("--restart", action="store_true",
                   help="the last fleet also rolls by restarting each replica (minutes here)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    import uvloop

    try:
        results = uvloop.run(run(args))
    except KeyboardInterrupt:
        return 130
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
