"""Tools the benchmark needs but the project does not: a throwaway venv under build/.

``vllm-router`` (the Rust router, as the PyPI wheel) and ``py-spy`` are installed
with pip into ``build/bench-venv`` — never into the project's venv, whose
dependencies they would change, and never committed (``build/`` is ignored).
A tool already on PATH is used as it is. ``export_ref`` and ``vllm_router_argv`` give
the routers a benchmark compares: dpserve as committed at a ref, and vllm-router's
command line.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.services import HOST

REPO = Path(__file__).resolve().parents[2]
BENCH_VENV = REPO / "build" / "bench-venv"
VLLM_ROUTER_SPEC = "vllm-router==0.1.17"
PY_SPY_SPEC = "py-spy"
INSTALL_TIMEOUT_S = 600


def ensure_tool(command: str, spec: str, venv: Path = BENCH_VENV) -> str:
    """Path of ``command``: on PATH, in ``venv``, or pip-installed there from ``spec``.

    Raises RuntimeError, with pip's output, when it cannot be installed.
    """
    found = shutil.which(command)
    if found:
        return found
    candidate = venv / "bin" / command
    if candidate.exists():
        return str(candidate)
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating the benchmark's throwaway venv {venv} ...", flush=True)
        _run([sys.executable, "-m", "venv", str(venv)], f"could not create {venv}")
    print(f"installing {spec} into {venv} ...", flush=True)
    _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          *spec.split()],
         f"`pip install {spec}` into {venv} failed")
    if not candidate.exists():
        raise RuntimeError(f"{spec} installed into {venv} but {candidate} is missing")
    return str(candidate)


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[-1] if text else "?"


def vllm_router_version(vllm_router: str) -> str:
    """The installed wheel's version, read from the venv next to the executable (or this
    Python's path, for a wheel installed with `pip --target`)."""
    python = Path(vllm_router).with_name("python")
    if not python.exists():
        python = Path(sys.executable)
    return tool_version([str(python), "-c",
                         "import importlib.metadata as m; print(m.version('vllm-router'))"])


def _run(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what}: no result within {INSTALL_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{what}:\n{(proc.stdout + proc.stderr).strip()[-2000:]}")


def export_ref(ref: str, work_dir: Path) -> Path:
    """The ``dpserve`` package as committed at ``ref``, extracted under ``work_dir``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref, "dpserve"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {ref} failed: {archive.stderr.decode().strip()}")
    dest = work_dir / "dpserve-ref"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def vllm_router_argv(
    binary: str, replicas: Sequence[str], port: int, metrics_port: int, policy: str
) -> list[str]:
    return [binary, "--host", HOST, "--port", str(port), "--worker-urls", *replicas,
            "--policy", policy, "--log-level", "warning", "--prometheus-host", HOST,
            "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1"]


def vllm_router_kv_args(replicas: Sequence[str], sources: Sequence[dict[str, Any]], *,
                        block_size: int, model: str) -> list[str]:
    """vllm-router's ``kv_aware`` flags: each replica's static event sources, from its
    ``GET /kv_event_sources`` body (rank 0's ``tcp://*:PORT``, reached on the replica's
    host as vLLM means a wildcard bind), and the block size and model name that HTTP
    workers cannot tell it."""
    argv = ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    for url, body in zip(replicas, sources, strict=True):
        host = url.split("//", 1)[1].rsplit(":", 1)[0]
        rank = body["0"]
        for flag, key in (("--kv-event-source", "endpoint"),
                          ("--kv-event-replay-source", "replay_endpoint")):
            argv += [flag, f"{url}={rank[key].replace('*', host)}"]
    return argv
