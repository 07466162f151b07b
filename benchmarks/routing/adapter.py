"""Adapter-aware routing against round robin and adapter-blind prefix affinity.

Each arm starts its own fleet: N real vLLM CPU replicas of the tiny model (default
2) with `--enable-lora --max-loras 1 --max-cpu-loras 8`, composed in this process as
`dpserve serve` composes them, and deploys the same K adapters (default 4, written
by one short real `dpserve finetune --lora-rank 8`, a checkpoint every 10 steps)
under the names `a0`..`a3`. Arms, in this order in every round:

- **round-robin**: `--policy round-robin --no-lora-affinity`;
- **prefix**: `--policy prefix-affinity --no-lora-affinity`: the default policy,
  blind to adapters (keys by model and prompt start);
- **lora+prefix**: `--policy prefix-affinity` with adapter affinity: the default.

Workload, the same requests in the same order for every arm: streamed completions,
`--base-share` of them (default 0.2) for the base model, the rest for the adapters
with popularity 4:3:2:1 (a0 the hottest); each adapter's prompts start with its own
system prompt (a tenant's), then random text from the model's vocabulary
(`--input-len` tokens, `--max-tokens` out, ignore_eos). Closed loop: `--concurrency`
requests in flight (default 8), the next sent when one ends, for `--duration` s after
`--warmup` requests.

Per arm: completed req/s and output tok/s, TTFT p50/p99 (loadtest's client, timed as
vLLM's benchmark times it), failed requests, and the engines' adapter swaps: lines
"Activating LoRA" that vLLM's `vllm.lora.model_manager` logs at debug level each time
it moves an adapter into a slot, counted in the replicas' logs over the measured
window (the engines log that one module at debug level, the rest at info). Ends with
each arm's throughput and p99 TTFT against round robin's and prefix's.

    python -m benchmarks.routing.adapter [--replicas 2] [--adapters 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common.fleet import fleet, train_adapters
from dpserve.demo.run import OFFLINE_ENV
from dpserve.rollout.progress import DeployOptions, DeployState
from dpserve.tinymodel import TINY_MODEL_NAME, build_tiny_model
from loadtest import datasets
from loadtest.client import ENDPOINT_PATHS, Payload, build_body
from loadtest.metrics import summarize
from loadtest.runner import LoadPlan, run_load

LORA_RANK = 8
SWAP_LINE = b"Activating LoRA"
ARMS = {
    "round-robin": {"policy": "round-robin", "lora_affinity": False},
    "prefix": {"policy": "prefix-affinity", "lora_affinity": False},
    "lora+prefix": {"policy": "prefix-affinity", "lora_affinity": True},
}
LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain",
                         "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
                "vllm.lora.model_manager": {"level": "DEBUG"}},
}


@dataclass
class Arm:
    name: str
    round: int
    req_s: float
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    failed: int
    swaps: int
    completed: int


def workload(model: Path, names: list[str], args: argparse.Namespace) -> list[Payload]:
    """The mixed requests, in a fixed order (seeded)."""
    rng = random.Random(args.seed)
    tokenizer = datasets.load_tokenizer(model)
    count = args.prompts
    prompts = datasets.random_prompts(tokenizer, num_prompts=count, input_len=args.input_len,
                                      output_len=args.max_tokens, range_ratio=0.0,
                                      prefix_len=0, seed=args.seed)
    weights = [len(names) - i for i in range(len(names))]  # 4:3:2:1
    payloads = []
    for p in prompts:
        if rng.random() < args.base_share:
            model_name, system = TINY_MODEL_NAME, ""
        else:
            model_name = rng.choices(names, weights)[0]
            system = f"You are the {model_name} assistant of tenant {model_name}. " * 4
        body = build_body("completions", model=model_name, prompt=system + p.text,
                          max_tokens=args.max_tokens, stream=True, ignore_eos=True,
                          extra_body={})
        payloads.append(Payload(body, p.prompt_len, args.max_tokens))
    return payloads


def swaps(logs: list[Path]) -> int:
    return sum(p.read_bytes().count(SWAP_LINE) for p in logs if p.exists())


async def run_arm(name: str, round_: int, model: Path, work: Path, adapters: list[Path],
                  payloads: list[Payload], args: argparse.Namespace) -> Arm:
    names = [f"a{i}" for i in range(len(adapters))]
    arm_dir = work / f"{name}-{round_}"
    async with fleet(model, arm_dir, args.replicas, enable_lora=True, max_loras=1,
                     max_lora_rank=LORA_RANK, max_cpu_loras=max(8, 2 * len(adapters)),
                     checkpoint_root=work, **ARMS[name]) as f:
        for adapter, adapter_name in zip(adapters, names, strict=True):
            progress = await f.rollout.start(str(adapter), DeployOptions(), name=adapter_name)
            await f.rollout.wait()
            if progress.state is not DeployState.SUCCEEDED:
                raise RuntimeError(f"deploy of {adapter_name}: {progress.error}")
        url = f.url + ENDPOINT_PATHS["completions"]
        plan = LoadPlan(url=url, payloads=payloads, offsets=[0.0] * len(payloads),
                        max_concurrency=args.concurrency, duration_s=args.duration,
                        num_warmups=args.warmup, request_id_prefix=f"{name}-")
        logs = [arm_dir / "runs" / f"replica-r{i}.log" for i in range(args.replicas)]
        before = swaps(logs)
        outcome = await run_load(plan)
        swapped = swaps(logs) - before
    m = summarize(outcome.records, outcome.duration_s, percentiles=(50, 99))
    arm = Arm(name, round_, m.request_throughput, m.output_throughput,
              m.ttft_ms.percentiles["p50"] or 0.0, m.ttft_ms.percentiles["p99"] or 0.0,
              m.failed, swapped,
              m.completed)
    print(f"  {name} (round {round_}): {arm.req_s:.2f} req/s, TTFT p99 "
          f"{arm.ttft_p99_ms:.0f} ms, {arm.swaps} swaps, {arm.failed} failed", flush=True)
    return arm


def report(arms: list[Arm], args: argparse.Namespace) -> None:
    print(f"\n{args.replicas} replicas, --max-loras 1, {args.adapters} adapters (4:3:2:1), "
          f"{args.base_share:.0%} base; {args.concurrency} in flight, {args.duration:g} s "
          f"per arm, {args.rounds} round(s); medians over rounds\n")
    head = (f"{'arm':<12} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'swaps':>6} {'swaps/req':>9} {'failed':>6}")
    print(head)
    print("-" * len(head))
    med: dict[str, Arm] = {}
    for name in ARMS:
        runs = [a for a in arms if a.name == name]

        def mid(field: str, runs: list[Arm] = runs) -> float:
            return float(statistics.median(getattr(a, field) for a in runs))

        med[name] = Arm(name, 0, mid("req_s"), mid("tok_s"), mid("ttft_p50_ms"),
                        mid("ttft_p99_ms"), sum(a.failed for a in runs), round(mid("swaps")),
                        round(mid("completed")))
        a = med[name]
        print(f"{name:<12} {a.req_s:>7.2f} {a.tok_s:>8.1f} {a.ttft_p50_ms:>7.0f}ms "
              f"{a.ttft_p99_ms:>7.0f}ms {a.swaps:>6} {a.swaps / max(a.completed, 1):>9.2f} "
              f"{a.failed:>6}")
    ours = med["lora+prefix"]
    for base in ("round-robin", "prefix"):
        b = med[base]
        print(f"\nlora+prefix / {base}: throughput {ours.req_s / b.req_s:.2f}x, "
              f"p99 TTFT {ours.ttft_p99_ms / b.ttft_p99_ms:.2f}x, "
              f"swaps {ours.swaps / max(b.swaps, 1):.2f}x")


async def run(args: argparse.Namespace, model: Path, work: Path) -> list[Arm]:
    adapters = train_adapters(model, work, versions=args.adapters, rank=LORA_RANK)
    payloads = workload(model, [f"a{i}" for i in range(args.adapters)], args)
    arms = []
    for round_ in range(1, args.rounds + 1):
        for name in ARMS:
            arms.append(await run_arm(name, round_, model, work, adapters, payloads, args))
    return arms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="times each arm runs (medians)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds per arm")
    p.add_argument("--warmup", type=int, default=16, help="unmeasured requests first")
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--base-share", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="tiny model directory (default: built here)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.update(OFFLINE_ENV)
    with tempfile.TemporaryDirectory(prefix="dpserve-adapter-routing-") as tmp:
        work = Path(tmp)
        config = work / "vllm-logging.json"
        config.write_text(json.dumps(LOGGING))
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config)
        model = args.model or build_tiny_model(work / "tiny-llama")
        t0 = time.perf_counter()
        try:
            arms = asyncio.run(run(args, model.resolve(), work))
        except KeyboardInterrupt:
            return 130
        report(arms, args)
        print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
