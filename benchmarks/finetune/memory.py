"""Per-rank memory and throughput of `dpserve finetune` for each strategy, side by side.

Trains a ~150M-parameter Llama (the tiny-model recipe at `--size 150m`, built if
missing) at world size 2 on CPU with the same global batch under `ddp` (the
baseline), `zero1`, `fsdp` (ZeRO-3), `fsdp --no-reshard-after-forward` (ZeRO-2) and
`ddp` + LoRA, and prints, per rank:

- weights, gradients and optimizer state: bytes the rank holds after its first
  update (summed over its tensors, so sharding shows exactly), from the trainer's
  `memory.json`;
- activations: bytes saved for the backward by the first micro-batch;
- process peak RSS (includes torch, the data and the allocator's slack);
- samples/s past the first progress window, and the share of the step blocked in
  collectives (the trainer's summary).

Then the ratios the strategies exist for, against ddp measured in the same run:
fsdp weights+grads+optimizer (ideal 1/world), zero1 optimizer (ideal 1/world),
LoRA trainable+optimizer state, fsdp throughput.

    python -m benchmarks.finetune.memory [--steps 8] [--global-batch 8] [--seq-words 40]
                                         [--lora-rank 8] [--model build/llama-150m]
                                         [--only ddp,fsdp,...]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LINE = re.compile(r"step\s+\d+/\d+\s+loss \S+\s+lr \S+\s+[\d,.]+ tok/s\s+([\d,.]+) samples/s")
COMM = re.compile(r"\((\d+)% comm\)")
MIB = 2**20


def write_data(path: Path, n: int, words: int) -> None:
    vocab = ("river lamp market sister road rain baker boat quiet morning evening light "
             "stone window garden letter").split()
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(vocab[(i * 5 + j * 3) % len(vocab)] for j in range(words))
            f.write(json.dumps({"prompt": f"Note {i}:", "completion": " " + text}) + "\n")


def run(model: Path, data: Path, flags: list[str], *, micro: int, steps: int
        ) -> tuple[dict[str, object], float, float]:
    """(memory.json, samples/s past the first step, comm share %) of one 2-rank run."""
    with tempfile.TemporaryDirectory(prefix="dpserve-ft-mem-") as out:
        cmd = [sys.executable, "-m", "dpserve", "finetune", "--model", str(model),
               "--data", str(data), "--output", out, "--nproc-per-node", "2",
               "--threads-per-rank", "1", "--micro-batch-size", str(micro),
               "--max-steps", str(steps), "--log-every", "1", "--save-every", "0",
               "--max-seq-len", "256", "--warmup-steps", "1", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(flags)}: finetune failed:\n{done.stdout[-2000:]}\n"
                             f"{done.stderr[-2000:]}")
        memory = json.loads((Path(out) / "memory.json").read_text())
    rates = [float(m[1].replace(",", "")) for m in LINE.finditer(done.stdout)][1:]
    comm = COMM.search(done.stdout)
    return (memory, sum(rates) / len(rates) if rates else float("nan"),
            float(comm[1]) if comm else float("nan"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/llama-150m")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-words", type=int, default=40, help="words per completion")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--only", default="", help="comma-separated cases (default: all)")
    args = p.parse_args()
    if args.global_batch % 2:
        p.error("--global-batch must be even (it is split over 2 ranks)")

    from dpserve.tinymodel import build_tiny_model

    model = build_tiny_model(Path(args.model), size="150m")
    cases = {"ddp": [], "zero1": ["--strategy", "zero1"], "fsdp": ["--strategy", "fsdp"],
             "fsdp zero2": ["--strategy", "fsdp", "--no-reshard-after-forward"],
             f"ddp+lora r{args.lora_rank}": ["--lora-rank", str(args.lora_rank)]}
    if args.only:
        cases = {k: v for k, v in cases.items() if k in args.only.split(",")}
    results = {}
    with tempfile.TemporaryDirectory(prefix="dpserve-ft-data-") as tmp:
        data = Path(tmp) / "train.jsonl"
        write_data(data, n=args.global_batch * (args.steps + 2), words=args.seq_words)
        print(f"{model.name}: world size 2 on CPU (gloo, 1 thread per rank), global batch "
              f"{args.global_batch}, {args.steps} steps; MiB per rank (rank 0 | rank 1)\n")
        for name, flags in cases.items():
            results[name] = run(model, data, flags, micro=args.global_batch // 2,
                                steps=args.steps)
            print(f"  {name}: done", flush=True)

    def both(mem: dict[str, object], key: str) -> str:
        ranks = mem["ranks"]
        assert isinstance(ranks, list)
        return " | ".join(f"{r[key] / MIB:,.0f}" for r in ranks)

    cols = ("weights", "grads", "optimizer", "activations", "peak_rss")
    print(f"\n{'strategy':<18}" + "".join(f"{c:>20}" for c in cols)
          + f"{'samples/s':>11}{'comm %':>8}")
    for name, (mem, rate, comm) in results.items():
        print(f"{name:<18}" + "".join(f"{both(mem, c):>20}" for c in cols)
              + f"{rate:>11.2f}{comm:>8.0f}")

    def rank0(name: str, *keys: str) -> float:
        ranks = results[name][0]["ranks"]
        assert isinstance(ranks, list)
        return float(sum(ranks[0][k] for k in keys))

    lora = f"ddp+lora r{args.lora_rank}"
    state = ("weights", "grads", "optimizer")
    ratios = [
        ("fsdp weights+grads+optimizer / ddp", "fsdp", state, state, "<= 0.6 (ideal 0.5)"),
        ("zero1 optimizer / ddp", "zero1", ("optimizer",), ("optimizer",),
         "<= 0.6 (ideal 0.5)"),
        ("LoRA grads+optimizer / ddp grads+optimizer", lora, ("grads", "optimizer"),
         ("grads", "optimizer"), "<= 0.02"),
    ]
    print()
    if "ddp" not in results:
        return 0
    for label, name, keys, base, target in ratios:
        if name in results:
            print(f"{label:<44}{rank0(name, *keys) / rank0('ddp', *base):>8.3f}   {target}")
    for name in results:
        if name != "ddp":
            rate = results[name][1] / results["ddp"][1]
            print(f"{name + ' samples/s / ddp':<44}{rate:>8.3f}   "
                  f"{'>= 0.7' if name == 'fsdp' else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
