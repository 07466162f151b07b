"""`dpserve demo`: the whole serving path on the built-in tiny model.

Builds the tiny model if needed, starts `dpserve serve` with CPU (or GPU)
replicas behind the router, talks to it with the official `openai` client —
a completion, a chat, a streamed chat, and a burst spread over the replicas —
then shuts it down with SIGTERM and checks it exited cleanly.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dpserve.replicas.launcher import free_port

# vLLM flags for the tiny model: eager mode starts ~2x faster on CPU and the
# model is too small for graph capture to matter; float32 because vLLM's
# `--dtype auto` would serve the float32 checkpoint in bfloat16.
TINY_VLLM_ARGS = (
    "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "32",
)


def serve_command(model_dir: Path, *, replicas: int, port: int, served_name: str,
                  run_dir: Path | None = None) -> list[str]:
    cmd = [
        sys.executable, "-m", "dpserve", "serve",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--replicas", str(replicas), "--port", str(port), "--host", "127.0.0.1",
    ]
    if run_dir is not None:
        cmd += ["--run-dir", str(run_dir)]
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


def run_demo(*, model_dir: Path, replicas: int = 2, port: int = 0) -> int:
    from openai import OpenAI

    from dpserve.tinymodel import TINY_MODEL_NAME, build_tiny_model

    for noisy in ("httpx", "httpx2"):  # the openai client logs every request at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    model_dir = build_tiny_model(model_dir)
    port = port or free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(model_dir, replicas=replicas, port=port, served_name=TINY_MODEL_NAME)
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        waited = wait_ready(base, proc, deadline_s=900)
        print(f"\n== {replicas} replicas ready after {waited:.0f} s; router on {base}\n",
              flush=True)
        client = OpenAI(base_url=base + "/v1", api_key=os.environ.get("DPSERVE_API_KEY", "none"))

        print("models:", [m.id for m in client.models.list().data])
        c = client.completions.create(model=TINY_MODEL_NAME, prompt="Once upon a time",
                                      max_tokens=24, temperature=0)
        print(f"\ncompletion: Once upon a time|{printable(c.choices[0].text)}")
        chat = client.chat.completions.create(
            model=TINY_MODEL_NAME, max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "Tell me about the sea."}],
        )
        print(f"chat: {printable(chat.choices[0].message.content or '')}")
        print("streamed chat: ", end="", flush=True)
        stream = client.chat.completions.create(
            model=TINY_MODEL_NAME, max_tokens=24, temperature=0.8, stream=True,
            messages=[{"role": "user", "content": "Say something."}],
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(printable(chunk.choices[0].delta.content), end="", flush=True)
        print()

        served_by: collections.Counter[str] = collections.Counter()
        for i in range(8):
            raw = client.completions.with_raw_response.create(
                model=TINY_MODEL_NAME, prompt=f"Request {i}", max_tokens=8)
            served_by[raw.headers.get("x-dpserve-replica", "?")] += 1
        print(f"8 requests served by: {dict(sorted(served_by.items()))}")
    finally:
        print("\n== shutting down (SIGTERM)", flush=True)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    print(f"dpserve serve exited with code {code}")
    return 0 if code == 0 else 1
