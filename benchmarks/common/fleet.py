"""A fleet of real vLLM CPU replicas behind the router, composed in the benchmark's
process as `dpserve serve` composes it (pool, supervisor, router, rolling deploy), so a
benchmark can call `Rollout.start` directly and time it without an HTTP hop.

Used by `deploy/rollout.py`, `deploy/adapter.py` and `routing/adapter.py`; `train_adapters`
writes real LoRA adapters for them with a short `dpserve finetune`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from dpserve import demo_data
from dpserve.config import RouterConfig, ServeConfig
from dpserve.demo import TINY_VLLM_ARGS
from dpserve.demo.run import OFFLINE_ENV
from dpserve.replicas.launcher import free_port, plan_replicas, usable_cores
from dpserve.replicas.supervisor import Supervisor
from dpserve.rollout.deployed import Deployed, weights_for
from dpserve.rollout.rollout import Rollout
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.http.app import build_app
from dpserve.router.http.server import bind_socket
from dpserve.serve import compose
from dpserve.tinymodel import TINY_MODEL_NAME

POLL_S = 0.05
READY_WITHIN_S = 120.0
"""How long the replicas may take to start (vLLM on 2 busy cores: about a minute)."""
STEPS_PER_ADAPTER = 10
"""Fine-tuning steps between adapter versions (each takes ~50 ms here)."""


@dataclass(frozen=True)
class Fleet:
    cfg: ServeConfig
    pool: ReplicaPool
    deployed: Deployed
    """What replicas (re)start on; a full-weight deploy moves it."""
    supervisor: Supervisor
    rollout: Rollout
    url: str
    """The router's root URL."""


@contextlib.asynccontextmanager
async def fleet(model: Path, work: Path, replicas: int, *, checkpoint_root: Path | None = None,
                warm_up: bool = True, **router_options: Any) -> AsyncIterator[Fleet]:
    """`replicas` replicas of `model` (served as the tiny model's name), ready on entry;
    deploys accept checkpoints inside `checkpoint_root` (default `work`), snapshots and
    replica logs go to `work`. On exit the rolling deploy is cancelled, the router
    stopped, then the replicas. `router_options`: RouterConfig fields, e.g.
    `enable_lora=True` (every replica starts with `--enable-lora` and run-time adapter
    loading) or `policy="round-robin"`. `warm_up=False`: replicas enter rotation without
    their warm-up request (a baseline)."""
    router_cfg = RouterConfig(port=free_port(), log_level="warning",
                              checkpoint_root=str(checkpoint_root or work),
                              snapshot_dir=str(work / "snapshots"), **router_options)
    enable_lora = router_cfg.enable_lora
    cfg = ServeConfig(model=str(model), served_model_name=TINY_MODEL_NAME, replicas=replicas,
                      vllm_args=list(TINY_VLLM_ARGS), run_dir=str(work / "runs"),
                      router=router_cfg)
    specs = plan_replicas(cfg, gpus=[], cores=usable_cores(), port=lambda _: free_port(),
                          run_dir=work / "runs")
    deployed = Deployed(weights_for(cfg.model))
    pool = ReplicaPool([Replica(id=s.id, url=s.url, device=s.device,
                                weight_version=deployed.current.version) for s in specs])
    supervisor = Supervisor(specs, pool, cfg, deployed=deployed)
    router, rollout = compose(pool, deployed, router_cfg, restarter=supervisor,
                              warm_up=warm_up)
    server = uvicorn.Server(uvicorn.Config(build_app(router), log_level="warning",
                                           lifespan="on", http="httptools"))
    serving = asyncio.create_task(server.serve(sockets=[bind_socket("127.0.0.1",
                                                                     router_cfg.port)]))
    try:
        print(f"starting {replicas} replicas of {model}"
              + (" with LoRA" if enable_lora else "") + f" (logs in {work}/runs)", flush=True)
        await supervisor.start()
        await rollout.prepare()  # as `dpserve serve` does
        await wait_until(lambda: len(pool.ready()) == len(pool), READY_WITHIN_S, "ready fleet")
        yield Fleet(cfg, pool, deployed, supervisor, rollout,
                    f"http://127.0.0.1:{router_cfg.port}")
    finally:
        await rollout.aclose()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await serving
        await supervisor.stop()


async def wait_until(cond: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {within_s:g} s")
        await asyncio.sleep(POLL_S)


def train_adapters(model: Path, work: Path, *, versions: int, rank: int,
                   steps_per_version: int = STEPS_PER_ADAPTER,
                   micro_batch_size: int = 16) -> list[Path]:
    """`versions` LoRA adapter checkpoints of `model`, oldest first, as `dpserve finetune
    --lora-rank RANK` writes them: one short run on the demo's data (one process, ~20 s
    here for the tiny model) saving every `steps_per_version` steps into `work/lora`; its
    log is `work/finetune.log`. Each is a distinct version (another step, other weights)."""
    log_path = work / "finetune.log"
    cmd = [sys.executable, "-m", "dpserve", "finetune", "--model", str(model),
           "--data", str(demo_data.path(demo_data.TRAIN_FILE)), "--output", str(work / "lora"),
           "--nproc-per-node", "1", "--max-steps", str(versions * steps_per_version),
           "--save-every", str(steps_per_version), "--keep-last", str(versions),
           "--lora-rank", str(rank), "--micro-batch-size", str(micro_batch_size),
           "--lr", "3e-3", "--warmup-steps", str(min(5, versions * steps_per_version - 1)),
           "--log-every", str(steps_per_version), "--seed", "0"]
    print(f"fine-tuning {versions} adapter versions (log: {log_path})", flush=True)
    with log_path.open("wb") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=600,
                              env={**os.environ, **OFFLINE_ENV})
    adapters = sorted((work / "lora").glob("step-*"))
    if done.returncode != 0 or len(adapters) != versions:
        raise RuntimeError(f"dpserve finetune exited with code {done.returncode} and wrote "
                           f"{len(adapters)} of {versions} adapters; see {log_path}")
    return adapters
