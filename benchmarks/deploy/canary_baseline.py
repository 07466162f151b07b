"""How often a deploy's canary comparison rolls back a healthy checkpoint: judged against
its baseline (dpserve: a replica on the current version, its prefix cache reset as the
canary's window opens, given the canary's share of traffic) against the way it was
judged before, against the rest of the fleet.

A fleet of `--replicas` real vLLM CPU replicas of the tiny model (default 4: on 2 cores
each core then runs two replicas' workers, the canary's and the baseline's alike), routed by
prefix affinity, serves a chat-like load: `--conversations` long shared prefixes (a
system prompt and history, `--prefix-tokens` each) followed by a short new turn, from
`--clients` clients back to back. Every deploy (`--deploys`, alternating two
checkpoints whose weights differ by noise: the same speed) is healthy, so every
rollback is a false alarm. Each deploy's record holds the canary's, the baseline's and
the others' samples from the same window; both verdicts are the threshold rule the
canary used before its verdict had intervals (`threshold_rule`) on them.
`canary_trials.py` measures the verdict deploys use now.

    python -m benchmarks.deploy.canary_baseline [--replicas 4] [--deploys 4] [--weight 25]
        [--duration-s 20] [--conversations 48] [--prefix-tokens 900] [--clients 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.fleet import fleet
from benchmarks.deploy.rollout import make_checkpoints
from dpserve.rollout.progress import DeployOptions
from dpserve.router.routing.canary import CanarySplit, Sample
from dpserve.tinymodel import TINY_MODEL_NAME, build_tiny_model
from loadtest.arrivals import arrival_offsets
from loadtest.client import ENDPOINT_PATHS, Payload
from loadtest.runner import LoadPlan, run_load

MAX_TOKENS = 4
STEADY_S = 8.0
"""Load before the first deploy and between deploys: every prefix gets a home."""


def payloads(model: Path, conversations: int, prefix_tokens: int, turns: int = 8,
             seed: int = 0) -> list[Payload]:
    """`conversations` x `turns` prompts of token ids: a long prefix per conversation and
    a short turn of its own; shuffled, so each conversation recurs all through the run."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(model)).vocab_size
    rng = random.Random(seed)
    out = []
    for _ in range(conversations):
        prefix = [rng.randrange(10, vocab) for _ in range(prefix_tokens)]
        for _ in range(turns):
            prompt = prefix + [rng.randrange(10, vocab) for _ in range(16)]
            body = {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            out.append(Payload(body=json.dumps(body).encode(), prompt_len=len(prompt),
                               output_len=MAX_TOKENS))
    rng.shuffle(out)
    return out


def threshold_rule(canary: Sample, ref: Sample) -> bool:
    """The rule before the verdict had intervals (`canary_verdict`): fail if the canary
    served fewer than 10 requests, its error rate is over the reference's by more than 1
    point, or its TTFT p50 or p90 is over 1.5x the reference's and 20 ms more. True:
    passed."""
    return threshold_failure(canary, ref) is None


def threshold_failure(canary: Sample, ref: Sample) -> str | None:
    if canary.requests < 10:
        return "fewer than 10 requests"
    if canary.error_rate - ref.error_rate > 0.01:
        return "error rate"
    for p in (50, 90):
        mine, theirs = canary.percentile_ms(p), ref.percentile_ms(p)
        if mine is not None and theirs and mine > 1.5 * theirs and mine - theirs > 20:
            return f"p{p} {mine / theirs:.1f}x"
    return None


def verdicts(split: CanarySplit) -> tuple[str, str]:
    """The threshold rule on the window's samples: against the baseline (when it served
    10 requests), and against the warm others alone (what it judged before that)."""
    ref = split.baseline if split.baseline.requests >= 10 else split.others
    return (threshold_failure(split.canary, ref) or "pass",
            threshold_failure(split.canary, split.others) or "pass")


async def capture_split(traffic: Any, found: list[CanarySplit]) -> None:
    """Keep the deploy's split (the dispatcher drops it when the window closes)."""
    while True:
        if traffic.canary is not None and (not found or found[-1] is not traffic.canary):
            found.append(traffic.canary)
        await asyncio.sleep(0.05)


async def main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="canary-baseline-"))
    model = build_tiny_model(Path(args.model))
    checkpoints = make_checkpoints(model, work / "checkpoints")
    options = DeployOptions(canary_weight=args.weight, canary_duration_s=args.duration_s)
    rows = []
    async with fleet(model, work, args.replicas, checkpoint_root=work) as f:
        stop = asyncio.Event()
        plan = LoadPlan(url=f.url + ENDPOINT_PATHS["completions"],
                        payloads=payloads(model, args.conversations, args.prefix_tokens),
                        offsets=arrival_offsets(1_000_000, request_rate=float("inf"), seed=0),
                        max_concurrency=args.clients, stop=stop,
                        request_id_prefix="canary-bench-")
        loading = asyncio.create_task(run_load(plan))
        splits: list[CanarySplit] = []
        watching = asyncio.create_task(capture_split(f.rollout.traffic, splits))
        try:
            for i in range(args.deploys):
                await asyncio.sleep(STEADY_S)
                t0 = time.monotonic()
                progress = await f.rollout.start(str(checkpoints[i % 2]), options)
                await f.rollout.wait()
                c = progress.canary
                if not c or "canary" not in c or not splits:
                    print(f"deploy {i + 1}: no canary phase ({progress.error})", flush=True)
                    continue
                vs_baseline, vs_others = verdicts(splits.pop())
                row = {"deploy": i + 1, "state": progress.state.value,
                       "took_s": round(time.monotonic() - t0, 1), "canary": c["canary"],
                       "baseline": c.get("baseline"), "others": c["others"],
                       "vs_baseline": vs_baseline, "vs_others": vs_others}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            watching.cancel()
            stop.set()
            outcome = await loading
    failed = sum(not r.ok for r in outcome.records)
    if failed:
        reasons = sorted({f"{r.status} {r.detail[:80]}" for r in outcome.records if not r.ok})
        print(f"WARNING: {failed} requests failed, so the samples are not what a healthy "
              f"load gives (the tiny model serves 1024 tokens at most): {reasons[:3]}")
    print(f"\n{len(outcome.records)} requests, {failed} failed; threshold rule: 1.5x and "
          "20 ms at p50 or p90, 0.01 error-rate points\n")
    print("| deploy | canary p50/p90 ms (n) | baseline p50/p90 ms (n) | others p50/p90 ms (n) "
          "| vs baseline | vs others |")
    print("|---|---|---|---|---|---|")

    def side(s: dict | None) -> str:
        return "-" if not s else f"{s['ttft_p50_ms']}/{s['ttft_p90_ms']} ({s['requests']})"

    for r in rows:
        print(f"| {r['deploy']} | {side(r['canary'])} | {side(r['baseline'])} | "
              f"{side(r['others'])} | {r['vs_baseline'].split(' (')[0]} | "
              f"{r['vs_others'].split(' (')[0]} |")
    false_b = sum(r["vs_baseline"] != "pass" for r in rows)
    false_o = sum(r["vs_others"] != "pass" for r in rows)
    print(f"\nhealthy deploys rolled back: against the baseline {false_b}/{len(rows)}, "
          f"against the others {false_o}/{len(rows)}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="build/tiny-llama", help="tiny model dir (built if missing)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--deploys", type=int, default=4)
    p.add_argument("--weight", type=float, default=25.0)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--prefix-tokens", type=int, default=900)
    p.add_argument("--clients", type=int, default=6)
    sys.exit(asyncio.run(main(p.parse_args())))
