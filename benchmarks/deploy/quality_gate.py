"""The quality gate against a fine-tune that learned nothing useful: one trained on the
demo's data with its answers shuffled across questions (numerically sound, so every
other check passes), and the same fine-tune on the real answers.

Two real `dpserve finetune` runs (the demo's recipe: 300 steps, DDP on 2 ranks,
~25 s each here): **good** on `train.jsonl`, **shuffled** on the same conversations
with the assistant turns permuted (seeded). One fleet of 2 real vLLM CPU replicas of
the tiny model (composed as `dpserve serve` composes it) then takes, each with
`--eval heldout.jsonl --gate-vs-current --gate-min-score 0.5`:

1. the shuffled checkpoint: expected rolled back by the gate;
2. the good one: expected to pass and serve;
3. the good recipe trained again with another seed (equal quality), against the good
   one: expected to pass;
4. the shuffled one again, now against the good one as the current version.

Each version is scored `--repeats` times (default 3): the comparison's spread is how
much runs of one version differ.

Per deploy: state, both versions' scores (exact match on the 45 held-out questions and
mean log-probability per token of their answers), the time scoring both took, and the
whole deploy's. The replicas are only scored, under no other load.

    python -m benchmarks.deploy.quality_gate [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.fleet import fleet
from dpserve import demo_data
from dpserve.demo.run import FINETUNE_FLAGS, OFFLINE_ENV
from dpserve.rollout.progress import DeployOptions
from dpserve.tinymodel import build_tiny_model


def shuffled_answers(src: Path, dst: Path, seed: int = 0) -> Path:
    """The conversations of `src` with their assistant turns permuted."""
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    answers = [r["messages"][-1]["content"] for r in rows]
    random.Random(seed).shuffle(answers)
    with dst.open("w") as f:
        for row, answer in zip(rows, answers, strict=True):
            row["messages"][-1]["content"] = answer
            f.write(json.dumps(row) + "\n")
    return dst


def finetune(model: Path, data: Path, out: Path, steps: int, seed: int = 0) -> Path:
    flags = list(FINETUNE_FLAGS)
    flags[flags.index("--seed") + 1] = str(seed)
    cmd = [sys.executable, "-m", "dpserve", "finetune", "--model", str(model), "--data",
           str(data), "--output", str(out), "--nproc-per-node", "2", "--max-steps", str(steps),
           *flags]
    t0 = time.perf_counter()
    with (out.parent / f"{out.name}.log").open("wb") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1200,
                              env={**os.environ, **OFFLINE_ENV})
    made = sorted(out.glob("step-*"))
    if done.returncode != 0 or not made:
        raise RuntimeError(f"dpserve finetune failed (code {done.returncode}); see "
                           f"{out.parent / f'{out.name}.log'}")
    print(f"fine-tuned {out.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return made[-1]


async def run(args: argparse.Namespace, model: Path, work: Path) -> list[tuple[str, dict]]:
    train = demo_data.path(demo_data.TRAIN_FILE)
    good = finetune(model, train, work / "good", args.steps)
    bad = finetune(model, shuffled_answers(train, work / "shuffled.jsonl"), work / "shuffled",
                   args.steps)
    again = finetune(model, train, work / "good-seed1", args.steps, seed=1)
    heldout = shutil.copyfile(demo_data.path(demo_data.HELDOUT_FILE), work / "heldout.jsonl")
    options = DeployOptions(eval_data=str(heldout), gate_vs_current=True, gate_min_score=0.5,
                            gate_repeats=args.repeats)
    results = []
    async with fleet(model, work, 2) as f:
        for label, ckpt in (("shuffled", bad), ("good", good), ("good again vs good", again),
                            ("shuffled vs good", bad)):
            t0 = time.perf_counter()
            progress = await f.rollout.start(str(ckpt), options)
            await f.rollout.wait()
            record = progress.to_json()
            record["seconds"] = time.perf_counter() - t0
            print(f"  {label}: {record['state']} in {record['seconds']:.1f} s", flush=True)
            results.append((label, record))
    return results


def report(results: list[tuple[str, dict]]) -> None:
    print("\ndeploy            state        new: exact  mean logprob   current: exact  "
          "mean logprob   scoring    total")
    for label, r in results:
        q = r["quality"] or {}
        new, cur = q.get("candidate") or {}, q.get("current") or {}
        print(f"{label:<17} {r['state']:<12} {new.get('exact_match', 0):>10.0%}  "
              f"{new.get('mean_logprob', float('nan')):>12.3f}   "
              f"{cur.get('exact_match', 0):>14.0%}  {cur.get('mean_logprob', float('nan')):>12.3f}"
              f"   {q.get('seconds', float('nan')):>7.2f} s  {r['seconds']:>5.1f} s")
    print("\ncomparisons against the current version (candidate minus current, per example; "
          "spread: largest difference between two runs of one version):")
    for label, r in results:
        c = (r["quality"] or {}).get("comparison")
        if c:
            print(f"  {label}: {c['difference']:+.4f} (95% {c['low']:+.4f}..{c['high']:+.4f}), "
                  f"spread {c['spread']:.4f} over {c['repeats']} runs, sure {c['sure']}")
    verdicts = {label: r["state"] for label, r in results}
    ok = (verdicts["shuffled"] == "rolled_back" and verdicts["good"] == "succeeded"
          and verdicts["good again vs good"] == "succeeded"
          and verdicts["shuffled vs good"] == "rolled_back")
    print(f"\nthe gate {'held' if ok else 'DID NOT hold'}: shuffled rolled back twice, "
          "good and good retrained promoted" if ok else f"\nunexpected outcomes: {verdicts}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/tiny-llama", help="tiny model dir (built if missing)")
    p.add_argument("--steps", type=int, default=300, help="fine-tuning steps of each run")
    p.add_argument("--repeats", type=int, default=3, help="runs of the eval set per version")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    model = build_tiny_model(Path(args.model))
    work = Path(tempfile.mkdtemp(prefix="dpserve-gate-bench-"))
    import uvloop

    try:
        results = uvloop.run(run(args, model, work))
    except KeyboardInterrupt:
        return 130
    report(results)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
