"""Deploying a fine-tune as a LoRA adapter against hot-loading it merged into full weights.

One fleet: N real vLLM CPU replicas of the tiny model (default 2) started with LoRA
enabled (`--enable-lora --max-loras 2 --max-lora-rank 8`, run-time adapter loading),
behind the router, supervisor and rolling deploy, composed in this process as
`dpserve serve --enable-lora` composes them. A short real `dpserve finetune
--lora-rank 8` (one process, a checkpoint every 10 steps) writes one adapter version
per round plus one for warm-up; `export_merged` (what `dpserve export-merged ADAPTER
OUTPUT` runs) folds each round's adapter into full weights. Each round, under load:

- **adapter** — `dpserve deploy ADAPTER --name NAME`'s path (`Rollout.start(..., name=)`):
  snapshot and check, load the version into the replicas one at a time (nothing
  pauses; new requests avoid the replica loading while another can take them), switch
  NAME to it; the version it replaces is unloaded once its last request has ended;
- **full** — `dpserve deploy MERGED`'s path: the same fine-tune merged, hot-loaded
  replica by replica (drain, pause, reload, reset the prefix cache, resume, canary).

Rounds alternate adapter, full. After each full one the fleet goes back to the base
weights by an unmeasured hot-load of a checkpoint holding the base's own bytes: an
adapter is accepted only on the exact weights it was trained on (409 on merged ones).
Version 0 of the adapter is deployed before the load starts.

Load: the demo's (`dpserve demo`'s load test): Poisson arrivals at 8 req/s, at most 8
in flight, random 32-token prompts, 16 output tokens, streamed completions, sent and
timed by loadtest's client (TTFT as vLLM's benchmark times it), all for the base
model: a full deploy stops serving the adapters (`drop_adapters`: they were trained
on the weights it replaces), so the adapter's name is served only between an
adapter deploy and the next full one. Warm-ups: that
version-0 deploy (no load) and one full hot-load of the base checkpoint (under load)
are printed but not in the medians: the first deploy of each kind after the engines
start pays one-time set-up (vLLM's adapter path; the canary's logprobs, see rollout.py).

Per deploy: wall time from the request to done (`validate`: snapshot and checks, until
`Rollout.start` returns; `apply`: the rest), each replica's time out of rotation (full
only: an adapter's record has none, every replica keeps serving while it loads),
requests that failed or came back aborted while it ran, and TTFT p50/p99 in the deploy
window against the steady window just before it (see `windows`). Ends with
median full time / median adapter time (target >= 10x) and the p99 TTFT each kind of
deploy added (target: none for the adapter).

    python -m benchmarks.deploy.adapter [--replicas 2] [--rounds 5] [--rate 8] [--steady-s 10]
                                        [--size 150m]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common.fleet import Fleet, fleet, train_adapters, wait_until
from benchmarks.deploy.windows import WARM_UP, Deploy, report
from dpserve import checkpoint as ckpt
from dpserve.rollout.progress import DeployOptions, DeployState
from dpserve.tinymodel import TINY_MODEL_NAME, build_tiny_model
from dpserve.tinymodel.build import SIZES
from loadtest.arrivals import arrival_offsets
from loadtest.client import ENDPOINT_PATHS
from loadtest.config import RunConfig
from loadtest.harness import build_workload
from loadtest.runner import LoadPlan, RunOutcome, run_load

LORA_RANK = 8
PROMPTS = 200
LOAD_FOR_AT_MOST_S = 3 * 3600
"""Arrivals are drawn for this long; the load stops when the deploys are done."""
RETIRE_WITHIN_S = 120.0


@dataclass(frozen=True)
class Checkpoints:
    adapters: list[Path]
    """Version 0 (warm-up), then one per round."""
    merged: list[Path]
    """Each round's adapter folded into full weights."""
    base: Path
    """The base model's own files as a deployable checkpoint."""
    export_s: list[float]
    """Seconds each `export_merged` took."""


def prepare(model: Path, work: Path, rounds: int, size: str) -> Checkpoints:
    """Fine-tune the adapters, merge each round's, write the base checkpoint."""
    from transformers.utils import logging as hf_logging

    from dpserve.finetune.lora import export_merged

    hf_logging.disable_progress_bar()  # a bar per export, on loading 21 tensors

    # A 150m step takes seconds on 2 cores: one small step per version is enough (each
    # version only has to differ from the last).
    small = {} if size == "tiny" else {"steps_per_version": 1, "micro_batch_size": 2}
    adapters = train_adapters(model, work, versions=rounds + 1, rank=LORA_RANK, **small)
    merged, export_s = [], []
    for adapter in adapters[1:]:
        t0 = time.perf_counter()
        merged.append(export_merged(adapter, work / "merged"))
        export_s.append(time.perf_counter() - t0)

    def copy_base(tmp: Path) -> None:
        for f in model.iterdir():
            if f.is_file() and not f.name.startswith(".") and f.name != ckpt.META_FILE:
                shutil.copyfile(f, tmp / f.name)

    base = ckpt.write_checkpoint(work / "base", 1, copy_base, base_model=str(model),
                                 loss=None, world_size=1)
    return Checkpoints(adapters, merged, base, export_s)


def load_plan(url: str, model: Path, args: argparse.Namespace,
              stop: asyncio.Event) -> LoadPlan:
    """The demo's load: base-model completions (an adapter's name would be a 404 while
    a full deploy has stopped serving it)."""
    config = RunConfig(base_url=url, tokenizer=model, num_prompts=PROMPTS,
                       random_input_len=args.input_len, random_output_len=args.max_tokens)
    return LoadPlan(url=url + ENDPOINT_PATHS["completions"],
                    payloads=build_workload(config, TINY_MODEL_NAME).payloads,
                    offsets=arrival_offsets(int(args.rate * LOAD_FOR_AT_MOST_S),
                                            request_rate=args.rate, seed=0),
                    max_concurrency=args.max_concurrency, stop=stop,
                    request_id_prefix="adapter-bench-")


async def deploy(f: Fleet, label: str, checkpoint: Path, *, name: str | None = None,
                 steady_s: float, round_: str) -> Deploy:
    """Wait `steady_s` (the steady window), then deploy and wait until done; for an
    adapter, also until the version it replaced is unloaded."""
    t_steady = time.perf_counter()
    await asyncio.sleep(steady_s)
    t0 = time.perf_counter()
    # Full weights replace the base the served adapter was trained on: it stops serving.
    options = DeployOptions(drop_adapters=name is None)
    progress = await f.rollout.start(str(checkpoint), options, name=name)
    t_started = time.perf_counter()
    await f.rollout.wait()
    t_done = time.perf_counter()
    if progress.state is not DeployState.SUCCEEDED:
        raise RuntimeError(f"{label}: deploy {progress.state.value}: {progress.error}")
    replaced = name is not None and progress.previous_version is not None
    if replaced:
        assert f.rollout.adapters is not None
        table, old = f.rollout.adapters.adapters, f"{name}@{progress.previous_version}"
        await wait_until(lambda: table.get(old) is None, RETIRE_WITHIN_S, f"unload of {old}")
    t_end = time.perf_counter()
    steps: dict[str, float] = {}
    for r in progress.replicas:
        for step, took in r.steps.items():
            steps[step] = max(steps.get(step, 0.0), took)
    print(f"  {label}: {t_done - t0:.2f} s", flush=True)
    return Deploy(label=label, kind="adapter" if name else "full", round=round_,
                  t_steady=t_steady if steady_s else None, t0=t0, t_started=t_started,
                  t_done=t_done, t_end=t_end, replaced=replaced,
                  per_replica=[r.seconds for r in progress.replicas if r.seconds is not None],
                  steps=steps)


async def run(args: argparse.Namespace, model: Path, work: Path,
              ckpts: Checkpoints) -> tuple[list[Deploy], RunOutcome]:
    async with fleet(model, work, args.replicas, enable_lora=True, max_loras=2,
                     max_lora_rank=LORA_RANK) as f:
        name = args.name
        deploys = [await deploy(f, f"adapter {ckpts.adapters[0].name}", ckpts.adapters[0],
                                name=name, steady_s=0, round_=WARM_UP)]
        stop = asyncio.Event()
        loading = asyncio.create_task(run_load(load_plan(f.url, model, args, stop)))
        try:
            await asyncio.sleep(args.steady_s)  # the load's own start-up, not measured
            deploys.append(await deploy(f, "full base", ckpts.base, steady_s=args.steady_s,
                                        round_=WARM_UP))
            for i in range(args.rounds):
                if i:  # back to the weights the adapters were trained on (unmeasured)
                    await deploy(f, "full base (restore)", ckpts.base, steady_s=0, round_="")
                adapter, merged = ckpts.adapters[i + 1], ckpts.merged[i]
                deploys.append(await deploy(f, f"adapter {adapter.name}", adapter, name=name,
                                            steady_s=args.steady_s, round_=str(i + 1)))
                deploys.append(await deploy(f, f"full merged {merged.name}", merged,
                                            steady_s=args.steady_s, round_=str(i + 1)))
        finally:
            stop.set()
            outcome = await loading
    return deploys, outcome


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="model dir, built if missing (default build/tiny-llama, or "
                        "build/llama-150m with --size 150m)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny",
                   help="the tiny-model recipe's shape: tiny (2.4 MB) or 150m (625 MB)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="measured deploys of each kind")
    p.add_argument("--name", default="bench-adapter", help="the adapter's model name")
    p.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson arrivals)")
    p.add_argument("--max-concurrency", type=int, default=8, help="most requests in flight")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens")
    p.add_argument("--steady-s", type=float, default=10.0,
                   help="seconds of load measured before each deploy")
    p.add_argument("--keep", action="store_true", help="keep the work dir (else kept on failure)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    import uvloop

    default = "build/tiny-llama" if args.size == "tiny" else f"build/llama-{args.size}"
    model = build_tiny_model(Path(args.model or default), size=args.size)
    work = Path(tempfile.mkdtemp(prefix="dpserve-adapter-bench-"))
    try:
        ckpts = prepare(model, work, args.rounds, args.size)
        deploys, outcome = uvloop.run(run(args, model, work, ckpts))
    except KeyboardInterrupt:
        return 130
    report(deploys, outcome, ckpts.export_s)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
