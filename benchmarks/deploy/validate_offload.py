"""Where a deploy's checkpoint checks should run: a thread of the router, or a child.

```sh
.venv/bin/python -m benchmarks.deploy.validate_offload [--model build/llama-150m] [--rounds 3]
    [--busy-tasks 64]
```

A deploy snapshots the checkpoint (copy + sha256 of every file) and reads every
tensor again for NaN/inf (`dpserve.rollout.validate_proc.check_full_checkpoint`).
This runs that check, on a copy of `--model` published as a checkpoint, two ways:
in a thread of this process (`asyncio.to_thread`) or in the router's child process
(`Checker`, started beforehand as `dpserve serve` starts it), while this process's
event loop is either idle or busy with `--busy-tasks` coroutines that each do a
router-sized slice of Python work (a JSON round trip of a completion-sized body) and
yield, as a relaying router's loop does.
Printed per case, medians of interleaved rounds: the check's wall time, how late a
5 ms ticker on the loop ran (the loop's lag: what every request relayed meanwhile
waits), and the busy work's rate during the check against the same loop's rate
before it. Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common.tools import REPO
from dpserve.checkpoint import write_checkpoint
from dpserve.rollout.validate_proc import Checker, Job, check_full_checkpoint

BODY = {"id": "cmpl-1", "object": "text_completion", "model": "m",
        "choices": [{"index": 0, "text": "word " * 16, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}}
TICK_S = 0.005


@dataclass
class Result:
    check_s: float
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    busy_ratio: float | None


def publish(model: Path, out: Path) -> Path:
    def fill(tmp: Path) -> None:
        for f in model.iterdir():
            if f.is_file() and not f.name.startswith(".") and f.name != "dpserve.json":
                shutil.copyfile(f, tmp / f.name)
    return write_checkpoint(out, 1, fill, base_model=str(model), loss=None, world_size=1)


async def measure(job: Job, how: str, busy_tasks: int) -> Result:
    done = 0
    stop = asyncio.Event()

    async def busy() -> None:
        nonlocal done
        while not stop.is_set():
            json.loads(json.dumps(BODY))
            done += 1
            await asyncio.sleep(0)

    lags: list[float] = []

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append(time.perf_counter() - t - TICK_S)

    workers = [asyncio.create_task(busy()) for _ in range(busy_tasks)]
    await asyncio.sleep(1.0)  # the busy loop's own rate, before the check
    before, t0 = done, time.perf_counter()
    await asyncio.sleep(1.0)
    rate_before = (done - before) / (time.perf_counter() - t0)
    checker = Checker()
    if how == "child":
        await checker.start()
    tick = asyncio.create_task(ticker())
    start_done, t0 = done, time.perf_counter()
    try:
        if how == "thread":
            await asyncio.to_thread(check_full_checkpoint, job)
        else:
            await checker.check(job)
        check_s = time.perf_counter() - t0
    finally:
        await checker.aclose()
    rate_during = (done - start_done) / check_s
    stop.set()
    await asyncio.gather(tick, *workers)
    lags.sort()
    ms = [1000 * x for x in lags] or [0.0]
    return Result(check_s, ms[len(ms) // 2], ms[min(len(ms) - 1, int(0.99 * len(ms)))],
                  ms[-1], rate_during / rate_before if busy_tasks else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "build" / "llama-150m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy-tasks", type=int, default=64)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dpserve-validate-bench-"))
    try:
        ckpt = publish(args.model.resolve(), work / "ckpts")
        size = sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20
        cases = [(how, load) for load in ("idle", "busy") for how in ("thread", "child")]
        results: dict[tuple[str, str], list[Result]] = {c: [] for c in cases}
        for r in range(args.rounds):
            for how, load in cases:
                store = work / f"store-{r}-{how}-{load}"  # fresh: a snapshot is reused
                job = Job(checkpoint=str(ckpt), within=str(work / "ckpts"),
                          base=str(args.model.resolve()), store=str(store))
                results[how, load].append(asyncio.run(
                    measure(job, how, args.busy_tasks if load == "busy" else 0)))
                shutil.rmtree(store)
        print(f"checkpoint {args.model.name}: {size:.0f} MiB; medians of {args.rounds} "
              f"interleaved rounds; busy loop: {args.busy_tasks} tasks")
        print(f"{'loop':6} {'where':7} {'check s':>8} {'lag p50 ms':>11} {'lag p99 ms':>11} "
              f"{'lag max ms':>11} {'busy work during/before':>24}")
        for how, load in cases:
            rs = results[how, load]

            def med(attr: str, rs: list[Result] = rs) -> float:
                return statistics.median(getattr(x, attr) for x in rs)
            busy = "-" if load == "idle" else f"{med('busy_ratio'):.2f}x"
            print(f"{load:6} {how:7} {med('check_s'):8.2f} {med('lag_p50_ms'):11.2f} "
                  f"{med('lag_p99_ms'):11.2f} {med('lag_max_ms'):11.2f} {busy:>24}")
        for load in ("idle", "busy"):
            t = statistics.median(x.check_s for x in results["thread", load])
            c = statistics.median(x.check_s for x in results["child", load])
            print(f"{load} loop: the child's check takes {c / t:.2f}x the thread's")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
