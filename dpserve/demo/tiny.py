"""Serving the tiny model from the demo and the integration tests: one command, one wait."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

# vLLM flags for the tiny model: eager mode starts ~2x faster on CPU and the
# model is too small for graph capture to matter; float32 because vLLM's
# `--dtype auto` would serve the float32 checkpoint in bfloat16.
TINY_VLLM_ARGS = (
    "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "32",
)

# Measured on the demo data, all 45 held-out questions, greedy: 300 steps answer
# 45, 45 and 44 of them right (seeds 0, 1, 2); 240 steps, 45 (seed 0). The loss
# sits near 1.5 for ~100 steps, then drops fast, so far fewer steps learn nothing.
# One step of global batch 32 takes ~50 ms on 2 idle cores.
DEFAULT_STEPS = 300


def serve_command(model_dir: Path, *, replicas: int, port: int, served_name: str,
                  run_dir: Path | None = None, checkpoint_root: Path | None = None
                  ) -> list[str]:
    """`dpserve serve` of the tiny model; deploys accept checkpoints under
    `checkpoint_root` (default: beside the model)."""
    cmd = [
        sys.executable, "-m", "dpserve", "serve",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--replicas", str(replicas), "--port", str(port), "--host", "127.0.0.1",
    ]
    if run_dir is not None:
        cmd += ["--run-dir", str(run_dir)]
    if checkpoint_root is not None:
        cmd += ["--checkpoint-root", str(checkpoint_root)]
    return [*cmd, "--", *TINY_VLLM_ARGS]


def wait_ready(base_url: str, proc: subprocess.Popen[bytes], deadline_s: float) -> float:
    """Poll the router's /ready until every replica is up; return seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"dpserve serve exited with code {proc.returncode}")
        try:
            r = httpx.get(base_url + "/ready", timeout=2.0)
            if r.status_code == 200 and r.json()["replicas_ready"] == r.json()["replicas_total"]:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"router at {base_url} not ready within {deadline_s:g} s")


def printable(text: str) -> str:
    """The tiny model's random weights emit control bytes; keep the terminal sane."""
    return "".join(ch if ch.isprintable() else "·" for ch in text)
