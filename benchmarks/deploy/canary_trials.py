"""How often a deploy's canary verdict is wrong, over many trials: healthy canaries rolled
back, bad ones let through, with intervals, how long a verdict took, and the rule used
before (a threshold on p50/p90 TTFT) on the same windows.

A fleet of `--replicas` real vLLM CPU replicas of the tiny model (default 4, two per
core on this machine), routed by prefix affinity, serves a chat-like load (48
conversations, each a `--prefix-tokens` prefix and a 16-token turn): **steady** (6 clients back
to back) or **bursty** (open loop, gamma arrivals of burstiness 0.25 at
`--bursty-rate` req/s, at most 16 in flight). The canary is r0, its baseline the
replica `pick_baseline` picks (r2, on r0's core), both prefix caches reset as the
window opens, `--weight`% of new requests each. Kinds of trial:

- **same**: r0 on the weights it serves (labelled a new version for the window): the
  same checkpoint judged against itself;
- **retrained**: a real deploy (`Rollout.start`, canary options) of one of two
  checkpoints whose weights differ by noise (equal quality and speed): the one not
  served;
- **slow**: r0's engine process group stopped 0.1 s of every 0.2 s for the window
  (SIGSTOP/SIGCONT, `--stall`, half its compute): its TTFT about twice the
  baseline's here (the verdict's own estimate is in each row);
- **failing**: every replica behind `benchmarks.common.fault_proxy`, r0's answering 5%
  of its API requests 500 for the window.

same, slow and failing windows run here as a deploy's would (`canary_phase.window`:
looks every quarter of `--duration-s`, up to twice it), but always to the end, with the
samples kept at each look: the verdict is `canary_verdict.judge` at each look, the
first sure one winning (what `run_canary` does), and the rule used before is applied
to the samples at `--duration-s`. Retrained trials run the product's own canary
phase; the rule before is applied to the samples its window ended with.

    python -m benchmarks.deploy.canary_trials [--trials 20] [--kinds same,slow,failing,retrained]
        [--loads steady,bursty] [--duration-s 20] [--weight 25] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common.fleet import Fleet, fleet
from benchmarks.deploy.canary_baseline import payloads, threshold_rule
from benchmarks.deploy.rollout import make_checkpoints
from dpserve.replicas.launcher import free_port
from dpserve.rollout.canary_phase import pick_baseline, window
from dpserve.rollout.deployed import weights_for
from dpserve.rollout.engine_admin import EngineAdmin
from dpserve.rollout.progress import DeployOptions
from dpserve.router.fleet.breaker import Outcome
from dpserve.router.routing.canary import CanarySplit, Sample, baseline_weight
from dpserve.router.routing.canary_verdict import NOT_WORSE, judge
from dpserve.router.routing.dispatch import Dispatcher, Slot
from dpserve.tinymodel import build_tiny_model
from loadtest.arrivals import arrival_offsets
from loadtest.client import ENDPOINT_PATHS
from loadtest.runner import LoadPlan, run_load

STEADY_S = 2.0
"""Load between trials."""
SETTLE_S = 15.0
"""Load after a slow or failing trial, before the next: r0 works off what queued there."""
BAD = {"slow", "failing"}


_record = CanarySplit.record
_enter, _finished = Slot.__enter__, Dispatcher._finished
_depths: dict[int, int] = {}
"""In flight on its replica (from this router) when each slot was taken, by id(slot)."""
_attempt: list[tuple[int | None, float | None]] = [(None, None)]
"""The slot being recorded now: its depth, and seconds from taking it to leaving it."""


def _recording(self: CanarySplit, replica_id: str, outcome: Outcome,
               first_byte_s: float | None, size: int = 0, prefill: int | None = None
               ) -> None:
    """Every attempt a split records, kept raw (`raw`) so that a window can be judged
    again later at any look, by any rule (`--replay`); with what the product does not
    record (yet): how many requests were in flight on the replica when it was sent,
    and how long the attempt took to its last byte."""
    raw = self.__dict__.setdefault("raw", [])
    depth, took = _attempt[0]
    raw.append([round(time.monotonic() - self.opened, 4), replica_id, outcome.value,
                first_byte_s, size, prefill, depth,
                None if took is None else round(took, 4)])
    _record(self, replica_id, outcome, first_byte_s, size, prefill)


def _entering(self: Slot) -> Slot:
    _depths[id(self)] = self.replica.in_flight
    return _enter(self)


def _finishing(self: Dispatcher, slot: Slot) -> None:
    _attempt[0] = (_depths.pop(id(slot), None), time.monotonic() - slot.started)
    try:
        _finished(self, slot)
    finally:
        _attempt[0] = (None, None)


CanarySplit.record = _recording  # type: ignore[method-assign]
Slot.__enter__ = _entering  # type: ignore[method-assign]
Dispatcher._finished = _finishing  # type: ignore[method-assign]


def replay(raw: list[list[Any]], spec: dict[str, Any], until_s: float) -> CanarySplit:
    """The split as it stood `until_s` into its window, rebuilt from its raw attempts."""
    clock = [0.0]
    split = CanarySplit(spec["replica"], spec["weight"], baseline_id=spec["baseline"],
                        baseline_weight_pct=spec["baseline_weight"], opened=0.0,
                        clock=lambda: clock[0])
    for at, replica_id, outcome, first_byte_s, size, *more in raw:  # older rows: 5-7
        if at > until_s:
            break
        clock[0] = at
        _record(split, replica_id, Outcome(outcome), first_byte_s, size, *more[:1])
    return split


def decide(raw: list[list[Any]], spec: dict[str, Any], options: DeployOptions,
           ran_s: float) -> dict[str, Any]:
    """Both rules on a window's raw attempts: the verdict at each look (the first sure one
    wins; still unsure at the longest, inconclusive), the threshold rule at the
    duration. Looks past what the window ran are not taken."""
    plan = window(options)
    new, decided, verdict = "inconclusive", None, None
    for look in range(1, plan.rule.looks + 1):
        if look * plan.every_s > ran_s + 0.5:
            new = "truncated"
            break
        verdict = judge(replay(raw, spec, look * plan.every_s), plan.rule)
        if verdict.outcome != "unsure":
            new = "passed" if verdict.outcome == NOT_WORSE else "failed"
            decided = round(look * plan.every_s, 1)
            break
    fixed = replay(raw, spec, min(options.canary_duration_s, ran_s))
    old = threshold_rule(fixed.canary, old_reference(fixed))
    return {"new": new, "decided_s": decided, "old": "passed" if old else "failed",
            "verdict": None if verdict is None else verdict.to_json()}


def old_reference(split: CanarySplit) -> Sample:
    if split.baseline_id is not None and split.baseline.requests >= 10:
        return split.baseline
    merged = Sample()
    merged.add(split.others)
    merged.add(split.baseline)
    return merged


def with_samples(split: CanarySplit, samples: dict[str, Sample]) -> CanarySplit:
    out = CanarySplit(split.replica_id, split.weight_pct, baseline_id=split.baseline_id,
                      baseline_weight_pct=split.baseline_weight_pct)
    out.canary, out.baseline, out.others = (samples["canary"], samples["baseline"],
                                            samples["others"])
    return out


class Stalled:
    """A process group stopped `stop_s` of every `stop_s + run_s` until closed."""

    def __init__(self, pgid: int, stop_s: float, run_s: float) -> None:
        self._stop = threading.Event()

        def cycle() -> None:
            while not self._stop.is_set():
                os.killpg(pgid, signal.SIGSTOP)
                self._stop.wait(stop_s)
                os.killpg(pgid, signal.SIGCONT)
                self._stop.wait(run_s)

        self._thread = threading.Thread(target=cycle, daemon=True)
        self._thread.start()
        self._pgid = pgid

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        os.killpg(self._pgid, signal.SIGCONT)


async def window_trial(f: Fleet, client: httpx.AsyncClient, options: DeployOptions,
                       kind: str, proxies: dict[str, str],
                       stall: tuple[float, float], baseline_id: str | None) -> dict[str, Any]:
    plan = window(options)
    ready = f.pool.ready()
    canary = next(r for r in ready if r.id == "r0")
    version = canary.weight_version
    canary.weight_version = "trial"  # a new version for the window's sake
    try:
        baseline = (pick_baseline(ready, canary) if baseline_id is None
                    else next(r for r in ready if r.id == baseline_id))
        assert baseline is not None
        for r in (canary, baseline):
            await EngineAdmin(client, r.url).reset_prefix_cache()
        assert options.canary_weight is not None
        split = CanarySplit(canary.id, options.canary_weight, baseline_id=baseline.id,
                            baseline_weight_pct=baseline_weight(options.canary_weight,
                                                                len(ready)))
        fault = None
        if kind == "slow":
            fault = Stalled(f.supervisor.pids["r0"], *stall)
        elif kind == "failing":
            await client.post(proxies["r0"] + "/__fault/0.05")
        traffic = f.rollout.traffic
        assert traffic is not None
        traffic.canary = split
        t0 = time.monotonic()
        try:
            for look in range(1, plan.rule.looks + 1):
                await asyncio.sleep(max(0.0, t0 + look * plan.every_s - time.monotonic()))
                # Once both rules have judged (a replay by another rule may then find
                # the window too short: `--replay` says how many).
                if (look * plan.every_s >= options.canary_duration_s
                        and judge(split, plan.rule).outcome != "unsure"):
                    break
        finally:
            traffic.canary = None
            ran = time.monotonic() - t0
            if fault is not None:
                fault.close()
            if kind == "failing":
                await client.post(proxies["r0"] + "/__fault/0")
    finally:
        canary.weight_version = version
    raw = split.__dict__.get("raw", [])
    return {**decide(raw, split.spec(), options, ran), "ran_s": round(ran, 1),
            "canary": split.canary.to_json(), "baseline": split.baseline.to_json(),
            "spec": split.spec(), "raw": raw}


async def deploy_trial(f: Fleet, options: DeployOptions, checkpoint: Path,
                       found: list[CanarySplit]) -> dict[str, Any]:
    progress = await f.rollout.start(str(checkpoint), options)
    await f.rollout.wait()
    c = progress.canary
    if not c or "outcome" not in c or not found:
        return {"new": "none", "error": progress.error}
    split = found.pop()
    raw = split.__dict__.get("raw", [])
    replayed = decide(raw, split.spec(), options, c["elapsed_s"])
    return {"new": c["outcome"], "decided_s": c["elapsed_s"], "state": progress.state.value,
            "old": replayed["old"], "verdict": c.get("verdict"), "ran_s": c["elapsed_s"],
            "canary": c["canary"], "baseline": c.get("baseline"), "reason": c.get("reason"),
            "spec": split.spec(), "raw": raw}


async def capture(traffic: Any, found: list[CanarySplit]) -> None:
    while True:
        if traffic.canary is not None and (not found or found[-1] is not traffic.canary):
            found.append(traffic.canary)
        await asyncio.sleep(0.05)


def start_proxies(f: Fleet) -> tuple[dict[str, str], list[subprocess.Popen[bytes]]]:
    """A fault proxy in front of r0 and of the baseline a deploy picks for it, so that
    both sides of the comparison pay the same extra hop."""
    canary = next(r for r in f.pool if r.id == "r0")
    twin = next((r for r in f.pool if r is not canary and r.device == canary.device),
                next(r for r in f.pool if r is not canary))  # as `pick_baseline` picks
    urls, procs = {}, []
    for r in f.pool:
        if r is not canary and r is not twin:
            continue
        port = free_port()
        upstream = r.url.removeprefix("http://").rstrip("/")
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.common.fault_proxy",
                                       "--port", str(port), "--upstream", upstream],
                                      preexec_fn=_die_with_parent))
        urls[r.id] = f"http://127.0.0.1:{port}"
    return urls, procs


def _die_with_parent() -> None:
    """In a fault proxy before exec: SIGTERM when this benchmark dies, however it ends."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG


def wilson(k: int, n: int, z: float = 1.96) -> str:
    if not n:
        return "-"
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return f"{max(0, c - h):.0%}-{min(1, c + h):.0%}"


def summary(rows: list[dict[str, Any]]) -> None:
    print("\n| load | kind | trials | new rule: wrong | 95% interval | inconclusive | "
          "decided after s (median, max) | rule before: wrong | 95% interval |")
    print("|---|---|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["load"], r["kind"]), []).append(r)
    for (load, kind), rs in sorted(groups.items()):
        rs = [r for r in rs if r["new"] != "none"]
        right = "failed" if kind in BAD else "passed"
        wrong = sum(r["new"] != right and not (r["new"] == "inconclusive" and right == "failed")
                    for r in rs)  # inconclusive rolls back by default
        old_wrong = sum(r["old"] != right for r in rs)
        times = sorted(r["decided_s"] for r in rs if r.get("decided_s") is not None)
        when = f"{times[len(times) // 2]:g}, {times[-1]:g}" if times else "-"
        print(f"| {load} | {kind} | {len(rs)} | {wrong}/{len(rs)} | {wilson(wrong, len(rs))} | "
              f"{sum(r['new'] == 'inconclusive' for r in rs)} | {when} | "
              f"{old_wrong}/{len(rs)} | {wilson(old_wrong, len(rs))} |")


def replay_file(path: str, options: DeployOptions) -> None:
    """Judge recorded windows again with this code's rule and `options`."""
    rows = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if "raw" not in row:
            continue
        rows.append({**row, **decide(row["raw"], row["spec"], options, row["ran_s"])})
    summary([r for r in rows if r["new"] != "truncated"])
    print(f"({sum(r['new'] == 'truncated' for r in rows)} windows too short for this rule)")


async def main(args: argparse.Namespace) -> int:
    main_task = asyncio.current_task()
    assert main_task is not None  # SIGTERM: cancelled, so the fleet and proxies are stopped
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    work = Path(tempfile.mkdtemp(prefix="canary-trials-"))
    model = build_tiny_model(Path(args.model))
    checkpoints = make_checkpoints(model, work / "checkpoints")
    options = DeployOptions(canary_weight=args.weight, canary_duration_s=args.duration_s)
    kinds = args.kinds.split(",")
    rows: list[dict[str, Any]] = []
    async with fleet(model, work, args.replicas, checkpoint_root=work) as f, \
            httpx.AsyncClient(timeout=60) as client:
        proxies: dict[str, str] = {}
        procs: list[subprocess.Popen[bytes]] = []
        if "failing" in kinds:
            proxies, procs = start_proxies(f)
            await asyncio.sleep(1.0)
            for r in f.pool:
                r.url = proxies.get(r.id, r.url)
        found: list[CanarySplit] = []
        watching = asyncio.create_task(capture(f.rollout.traffic, found))
        try:
            for load in args.loads.split(","):
                stop = asyncio.Event()
                bursty = load == "bursty"
                plan = LoadPlan(
                    url=f.url + ENDPOINT_PATHS["completions"],
                    payloads=payloads(model, 48, args.prefix_tokens),
                    offsets=arrival_offsets(1_000_000, request_rate=args.bursty_rate
                                            if bursty else float("inf"),
                                            burstiness=0.25 if bursty else 1.0, seed=1),
                    max_concurrency=16 if bursty else 6, stop=stop,
                    request_id_prefix="canary-trials-")
                loading = asyncio.create_task(run_load(plan))
                last = ""
                try:
                    for trial in range(args.trials):
                        for kind in kinds:
                            await asyncio.sleep(SETTLE_S if last in BAD else STEADY_S)
                            last = kind
                            if kind == "retrained":  # the one not served (after a
                                # rollback, the one deployed before stays served)
                                served = f.rollout.deployed_version()
                                fresh = [c for c in checkpoints
                                         if weights_for(str(c)).version != served]
                                row = await deploy_trial(f, options, fresh[0], found)
                            else:
                                row = await window_trial(f, client, options, kind, proxies,
                                                         args.stall, args.baseline)
                            row = {"load": load, "kind": kind, "trial": trial + 1, **row}
                            rows.append(row)
                            print(json.dumps({k: v for k, v in row.items() if k != "raw"}),
                                  flush=True)
                            if args.out:
                                with Path(args.out).open("a") as out:  # noqa: ASYNC230
                                    out.write(json.dumps(row) + "\n")
                finally:
                    stop.set()
                    outcome = await loading
                failed = sum(not r.ok for r in outcome.records)
                print(f"{load}: {len(outcome.records)} requests, {failed} failed", flush=True)
        finally:
            watching.cancel()
            for p in procs:
                p.terminate()
    summary(rows)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/tiny-llama", help="tiny model dir (built if missing)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--kinds", default="same,slow,failing,retrained")
    p.add_argument("--loads", default="steady,bursty")
    p.add_argument("--weight", type=float, default=25.0)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--bursty-rate", type=float, default=12.0)
    p.add_argument("--prefix-tokens", type=int, default=300)
    p.add_argument("--stall", type=lambda v: tuple(float(x) for x in v.split("/")),
                   default=(0.1, 0.1), help="slow: seconds stopped/running (default 0.1/0.1)")
    p.add_argument("--out", help="append each trial's row (JSON) to this file")
    p.add_argument("--baseline", metavar="ID",
                   help="the baseline replica of same, slow and failing windows (default: "
                        "the one a deploy picks)")
    p.add_argument("--replay", metavar="RESULTS.jsonl",
                   help="start nothing: judge the windows recorded there again (with "
                        "--duration-s and the rule of this code)")
    args = p.parse_args()
    if args.replay:
        replay_file(args.replay, DeployOptions(canary_weight=args.weight,
                                               canary_duration_s=args.duration_s))
        sys.exit(0)
    sys.exit(asyncio.run(main(args)))
