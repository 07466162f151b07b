"""DDP scaling of `dpserve finetune`: samples/s at world size 1 and 2, same global batch,
the share of the step blocked in collectives, and a gradient bucket-size sweep.

Both runs train the tiny model (built if missing) on the same synthetic data
with one CPU thread per rank, so world size 2 has twice the compute of world
size 1; scaling efficiency = throughput(2) / (2 x throughput(1)). Throughput is
read from the trainer's own progress lines, skipping the first window (start-up
and warm-up); the comm share from its summary line (time blocked in collectives
/ step time, over the whole run). `--buckets` reruns world size 2 with each DDP
`--bucket-cap-mb`. When a GPU is visible, a single-GPU run (NCCL backend, bf16
autocast) reports step time and tokens/s as well.

    python -m benchmarks.finetune.scaling [--steps 40] [--global-batch 16] [--seq-words 60]
                                          [--buckets 0.25,1,25] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LINE = re.compile(r"step\s+(\d+)/\d+\s+loss \S+\s+lr \S+\s+([\d,.]+) tok/s\s+([\d,.]+) samples/s")
COMM = re.compile(r"\((\d+)% comm\)")


def write_data(path: Path, n: int, words: int) -> None:
    vocab = ("river lamp market sister road rain baker boat quiet morning evening light "
             "stone window garden letter").split()
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(words))
            f.write(json.dumps({"prompt": f"Note {i}:", "completion": " " + text}) + "\n")


def run(model: Path, data: Path, *, nproc: int, micro: int, steps: int, log_every: int,
        extra: tuple[str, ...] = ()) -> tuple[float, float, float, float]:
    """(samples/s, tokens/s, wall seconds, comm share %) of one run, past its first
    log window (the comm share is over the whole run)."""
    with tempfile.TemporaryDirectory(prefix="dpserve-ft-bench-") as out:
        cmd = [sys.executable, "-m", "dpserve", "finetune", "--model", str(model),
               "--data", str(data), "--output", out, "--nproc-per-node", str(nproc),
               "--threads-per-rank", "1", "--micro-batch-size", str(micro),
               "--max-steps", str(steps), "--log-every", str(log_every), "--save-every", "0",
               "--max-seq-len", "512", *extra]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"finetune failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    windows = [(float(m[3].replace(",", "")), float(m[2].replace(",", "")))
               for m in LINE.finditer(done.stdout)][1:]
    if not windows:
        raise SystemExit(f"no progress lines after the first window:\n{done.stdout[-2000:]}")
    samples = sum(w[0] for w in windows) / len(windows)
    tokens = sum(w[1] for w in windows) / len(windows)
    comm = COMM.search(done.stdout)
    return samples, tokens, wall, float(comm[1]) if comm else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/tiny-llama")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-words", type=int, default=60, help="words per completion")
    p.add_argument("--buckets", default="0.25,1,25",
                   help="comma-separated --bucket-cap-mb values for the world-2 sweep ('' skips)")
    args = p.parse_args()
    if args.global_batch % 2:
        p.error("--global-batch must be even (it is split over 2 ranks)")

    from dpserve.tinymodel import build_tiny_model

    model = Path(args.model)
    if not (model / "config.json").is_file():
        model = build_tiny_model(model)
    log_every = max(1, args.steps // 5)
    with tempfile.TemporaryDirectory(prefix="dpserve-ft-data-") as tmp:
        data = Path(tmp) / "train.jsonl"
        write_data(data, n=args.global_batch * (args.steps + 2), words=args.seq_words)
        print(f"{model.name}, global batch {args.global_batch}, {args.steps} steps, "
              f"1 CPU thread per rank, gloo\n")
        w1 = run(model, data, nproc=1, micro=args.global_batch, steps=args.steps,
                 log_every=log_every)
        w2 = run(model, data, nproc=2, micro=args.global_batch // 2, steps=args.steps,
                 log_every=log_every)
        print(f"{'world size':<12}{'samples/s':>12}{'tokens/s':>12}{'wall s':>9}{'comm %':>8}")
        for name, (smp, tok, wall, comm) in (("1 (cpu)", w1), ("2 (cpu)", w2)):
            print(f"{name:<12}{smp:>12.1f}{tok:>12,.0f}{wall:>9.1f}{comm:>8.0f}")
        speedup = w2[0] / w1[0]
        print(f"\nspeed-up 2 vs 1: {speedup:.2f}x; scaling efficiency {speedup / 2:.0%} "
              "(2 ranks on a 2-core machine also share memory bandwidth with each other)")
        buckets = [float(b) for b in args.buckets.split(",") if b.strip()]
        if buckets:
            print(f"\nbucket sweep, world size 2 (ratio: samples/s against the default 25 MiB, "
                  f"{w2[0]:.1f})")
            print(f"{'bucket MiB':<12}{'samples/s':>12}{'comm %':>8}{'ratio':>8}")
            for mb in buckets:
                smp, _, _, comm = run(model, data, nproc=2, micro=args.global_batch // 2,
                                      steps=args.steps, log_every=log_every,
                                      extra=("--bucket-cap-mb", str(mb)))
                print(f"{mb:<12g}{smp:>12.1f}{comm:>8.0f}{smp / w2[0]:>8.2f}")

        import torch

        if torch.cuda.is_available():
            smp, tok, wall, _ = run(model, data, nproc=1, micro=args.global_batch,
                                 steps=args.steps, log_every=log_every)
            print(f"\n1 GPU ({torch.cuda.get_device_name(0)}, nccl, bf16 autocast): "
                  f"{smp:.1f} samples/s, {tok:,.0f} tokens/s, "
                  f"step time {1000 * args.global_batch / smp:.1f} ms")
        else:
            print("\nno GPU visible: the single-GPU NCCL measurement is skipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
