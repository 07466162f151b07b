"""Soak test of `dpserve finetune`'s exit code: loop short 2-rank runs, count failures.

Each round trains the tiny model for one step with an eval and stops (saving),
then resumes to the end: the paths where ranks save, gather and tear down. A
successful run must exit 0 every time, or a `finetune -> deploy` script cannot
trust it. `--burn N` keeps N busy processes beside it (CI machines are loaded).

    python -m benchmarks.finetune.teardown [--rounds 20] [--burn 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def run(model: Path, data: Path, output: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpserve", "finetune", "--model", str(model), "--data",
         str(data), "--eval-data", str(data), "--eval-every", "1", "--output", str(output),
         "--nproc-per-node", "2", "--threads-per-rank", "1", "--micro-batch-size", "2",
         "--max-steps", "2", "--save-every", "0", "--log-every", "1", *flags],
        capture_output=True, text=True, timeout=600)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/tiny-llama")
    p.add_argument("--rounds", type=int, default=20, help="stop + resume pairs")
    p.add_argument("--burn", type=int, default=2, help="busy processes running beside")
    args = p.parse_args()

    from dpserve.tinymodel import build_tiny_model

    model = build_tiny_model(Path(args.model))
    burners = [multiprocessing.Process(target=_burn, args=(3600,), daemon=True)
               for _ in range(args.burn)]
    for b in burners:
        b.start()
    failures, runs = [], 0
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="dpserve-teardown-") as tmp:
            data = Path(tmp) / "train.jsonl"
            data.write_text("".join(json.dumps({"prompt": f"Note {i}:", "completion":
                                                f" the river was quiet {i}"}) + "\n"
                                    for i in range(16)))
            for i in range(args.rounds):
                out = Path(tmp) / f"run-{i}"
                for flags in (("--stop-after-steps", "1"), ("--resume",)):
                    done = run(model, data, out, *flags)
                    runs += 1
                    if done.returncode != 0:
                        tail = (done.stderr.strip().splitlines() or [""])[-1]
                        failures.append(f"round {i} {flags[0]}: exit {done.returncode}: {tail}")
    finally:
        for b in burners:
            b.terminate()
    for line in failures:
        print(line)
    print(f"{len(failures)}/{runs} runs failed ({args.burn} busy processes beside, "
          f"{time.perf_counter() - t0:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
