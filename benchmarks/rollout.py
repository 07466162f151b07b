"""Rolling out a new checkpoint: hot-load versus restarting each replica, under load.

Both strategies roll the same fleet (N real vLLM replicas of the tiny model,
default 2) from one checkpoint to the next while closed-loop clients keep
sending requests through the router, one strategy after the other in the same
run:

- **hot-load** — `dpserve deploy`'s path: validate, then per replica drain,
  pause, reload weights, reset the prefix cache, resume, canary, re-admit;
- **restart** — the usual way without hot-loading: per replica drain, wait for
  its in-flight requests, stop the process, start it on the new checkpoint (the
  supervisor does, from the deployed record), wait until it is healthy,
  re-admit.

Hot-load runs twice: the first deploy after the engines start pays their one-time
set-up of the logprobs path (the canary's, in its pre-check while the replica still
serves), the second shows the steady cost. For each: wall time to roll all
replicas, failed requests, and capacity
(completed req/s) while rolling against the steady state before. Ends with the
speedup (restart time / hot-load time). The fleet runs in this process (router,
supervisor, rollout: what `dpserve serve` composes), the clients too.

    python benchmarks/rollout.py [--replicas 2] [--clients 4] [--max-tokens 16] [--steady-s 8]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import aiohttp
from _fleet import fleet, wait_until

from dpserve.replicas.supervisor import Supervisor
from dpserve.rollout.deployed import Deployed, weights_for
from dpserve.rollout.progress import DeployOptions
from dpserve.rollout.rollout import Rollout
from dpserve.router.pool import Replica, ReplicaPool, ReplicaState
from dpserve.tinymodel import TINY_MODEL_NAME, build_tiny_model


@dataclass
class Load:
    """Closed-loop clients; completion times and failures, by wall clock."""

    url: str
    clients: int
    max_tokens: int
    done_at: list[float] = field(default_factory=list)
    failed_at: list[tuple[float, str]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(self._client(s, i) for i in range(self.clients)))

    async def _client(self, s: aiohttp.ClientSession, c: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            stream = (c + n) % 2 == 0
            body = {"model": TINY_MODEL_NAME, "prompt": f"Client {c} asks about the river {n}",
                    "max_tokens": self.max_tokens, "temperature": 0.7, "stream": stream}
            error = None
            try:
                async with s.post(self.url + "/v1/completions", json=body) as r:
                    text = await r.text()
                    if r.status != 200:
                        error = f"HTTP {r.status}"
                    elif stream and (not text.rstrip().endswith("data: [DONE]")
                                     or '"error"' in text or '"abort"' in text):
                        error = "broken stream"
                    elif not stream and '"abort"' in text:
                        error = "aborted"
            except aiohttp.ClientError as exc:
                error = type(exc).__name__
            if error is None:
                self.done_at.append(time.monotonic())
            else:
                self.failed_at.append((time.monotonic(), error))

    def rate(self, t0: float, t1: float) -> float:
        return sum(t0 <= t < t1 for t in self.done_at) / max(t1 - t0, 1e-9)

    def failures(self, t0: float, t1: float) -> list[str]:
        return [why for t, why in self.failed_at if t0 <= t < t1]


@dataclass
class Result:
    strategy: str
    seconds: float
    per_replica: list[float]
    failed: int
    rate: float
    steady: float
    steps: dict[str, float] = field(default_factory=dict)
    """Hot-load only: the slowest replica's seconds per step."""


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


async def hot_load(rollout: Rollout, checkpoint: Path, steps: dict[str, float]) -> list[float]:
    progress = await rollout.start(str(checkpoint), DeployOptions())
    await rollout.wait()
    if progress.state.value != "succeeded":
        raise RuntimeError(f"hot-load deploy {progress.state.value}: {progress.error}")
    for r in progress.replicas:
        for name, took in r.steps.items():
            steps[name] = max(steps.get(name, 0.0), took)
    return [r.seconds or 0.0 for r in progress.replicas]


async def restart_each(pool: ReplicaPool, supervisor: Supervisor, deployed: Deployed,
                       checkpoint: Path, startup_s: float) -> list[float]:
    deployed.current = weights_for(str(checkpoint))  # what restarted replicas load
    took = []
    for replica in pool:
        def drained(r: Replica = replica) -> bool:
            return r.in_flight == 0

        def back(r: Replica = replica) -> bool:
            return (r.state is ReplicaState.READY
                    and r.weight_version == deployed.current.version)

        t0 = time.monotonic()
        pool.set_state(replica, ReplicaState.DRAINING, "rolling restart")
        await wait_until(drained, 600, "drained replica")
        await supervisor.restart(replica.id, "rolling restart onto the new checkpoint")
        await wait_until(back, startup_s, "restarted replica")
        took.append(time.monotonic() - t0)
    return took


async def measure(strategy: str, load: Load, roll, steady_s: float) -> Result:  # type: ignore[no-untyped-def]
    t_steady = time.monotonic()
    await asyncio.sleep(steady_s)  # steady state just before, same load
    t0 = time.monotonic()
    per_replica = await roll()
    t1 = time.monotonic()
    failures = load.failures(t0, t1)
    if failures:
        print(f"{strategy}: failed requests by reason: {dict(Counter(failures))}", flush=True)
    return Result(strategy, t1 - t0, per_replica, len(failures),
                  load.rate(t0, t1), load.rate(t_steady, t0))


async def run(args: argparse.Namespace) -> list[Result]:
    model = build_tiny_model(Path(args.model))
    work = Path(tempfile.mkdtemp(prefix="dpserve-rollout-bench-"))
    checkpoints = make_checkpoints(model, work / "out")
    async with fleet(model, work, args.replicas) as f:
        load = Load(f.url, args.clients, args.max_tokens)
        loading = asyncio.create_task(load.run())
        try:
            await asyncio.sleep(args.steady_s)  # warm-up, not measured
            results = []
            print("rolling by hot-load (twice)...", flush=True)
            # The first deploy after the engines start pays their one-time set-up of the
            # logprobs path (the canary's) in its pre-check; later ones do not.
            for name, ckpt_dir in (("hot-load", checkpoints[0]),
                                   ("hot-load again", checkpoints[1])):
                steps: dict[str, float] = {}
                results.append(await measure(name, load, partial(
                    hot_load, f.rollout, ckpt_dir, steps), args.steady_s))
                results[-1].steps = steps
            print("rolling by restart...", flush=True)
            results.append(await measure("restart", load, partial(
                restart_each, f.pool, f.supervisor, f.deployed, checkpoints[0],
                f.cfg.startup_timeout_s), args.steady_s))
            return results
        finally:
            load.stop.set()
            await loading


def report(results: list[Result], args: argparse.Namespace) -> None:
    rows = [("strategy", f"time to roll {args.replicas}", "per replica", "failed",
             "req/s rolling", "req/s steady", "capacity kept")]
    for r in results:
        rows.append((r.strategy, f"{r.seconds:.2f} s",
                     " / ".join(f"{s:.2f}" for s in r.per_replica) + " s", str(r.failed),
                     f"{r.rate:.1f}", f"{r.steady:.1f}",
                     f"{100 * r.rate / r.steady:.0f} %" if r.steady else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    hot, again, restart = results
    for r in (hot, again):
        print(f"\n{r.strategy} steps, slowest replica: "
              + ", ".join(f"{name} {took:.3f} s" for name, took in r.steps.items()))
    print("(time to roll: from the deploy request, validation included, to the last "
          "replica back; per replica: out of rotation, from drain to re-admission)")
    print(f"\nhot-load is {restart.seconds / hot.seconds:.1f}x faster than restarting "
          f"({restart.seconds / again.seconds:.1f}x once the engines are warm); target >= 10x "
          f"and 0 failed: {hot.failed + again.failed} failed hot-loading, "
          f"{restart.failed} restarting")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/tiny-llama", help="tiny model dir (built if missing)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="closed-loop clients")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--steady-s", type=float, default=8.0,
                   help="seconds of load measured before each strategy (and of warm-up)")
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
