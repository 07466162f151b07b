"""`dpserve finetune`: check everything that can be checked, then hand over to torchrun.

Before a single worker starts, the launcher loads the tokenizer, parses every
line of the data (a malformed line is reported as FILE:LINE), and makes sure
the output directory is writable and holds no checkpoints it would clash with.
Then it runs torch's elastic launcher (`python -m torch.distributed.run`) on
`dpserve.finetune.train`: standalone on one node, c10d rendezvous across nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

from dpserve import checkpoint as ckpt
from dpserve.config import ConfigError
from dpserve.finetune import resume
from dpserve.finetune.config import FinetuneConfig, lora_targets, training_argv
from dpserve.finetune.progress import fmt_duration
from dpserve.replicas.launcher import visible_gpus

DEFAULT_CPU_PROCS = 2


class PreflightError(RuntimeError):
    """The run cannot start; the message says why and what to do."""


def preflight(cfg: FinetuneConfig, world_size: int) -> None:
    """What can be refused without the tokenizer first (importing transformers takes
    ~8 s here): the model and output paths, every line of the data, the resume."""
    from dpserve.records import read_records

    model = Path(cfg.model)
    if model.exists() and not (model / "config.json").is_file():
        raise PreflightError(f"model: {model} is not a Hugging Face model directory "
                             "(no config.json)")
    if not model.exists() and (cfg.model.startswith((".", "/", "~")) or cfg.model.count("/") > 1):
        raise PreflightError(f"model: directory {cfg.model} does not exist")
    data = [Path(p) for p in filter(None, (cfg.data, cfg.eval_data))]
    for path in data:
        read_records(path)  # raises DataError naming FILE:LINE
    _refuse_existing(Path(cfg.output), resume=cfg.resume)
    if cfg.resume:
        resume.check(cfg, world_size)

    from transformers import AutoTokenizer

    from dpserve.finetune.data import load_dataset

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    except (OSError, ValueError) as exc:
        raise PreflightError(f"model: cannot load the tokenizer of {cfg.model}: {exc}") from None
    if cfg.lora_rank is not None:
        from dpserve.finetune.lora import LoraError, check_targets

        try:
            check_targets(cfg.model, lora_targets(cfg))
        except LoraError as exc:
            raise PreflightError(str(exc)) from None
    for path in data:
        load_dataset(path, tokenizer, max_seq_len=cfg.max_seq_len)  # raises DataError
    _check_writable(Path(cfg.output))


def _refuse_existing(output: Path, *, resume: bool) -> None:
    if not output.is_dir():
        return
    existing = ckpt.list_checkpoints(output)
    if existing and not resume:
        raise PreflightError(
            f"output: {output} already holds checkpoints ({existing[-1][1].name} is the "
            "newest); pass --resume to continue from it, or choose a new --output")


def _check_writable(output: Path) -> None:
    try:
        output.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output, prefix=".write-probe-"):
            pass
    except OSError as exc:
        raise PreflightError(f"output: cannot write to {output}: {exc.strerror}") from None


def torchrun_argv(cfg: FinetuneConfig, nproc: int) -> list[str]:
    argv = ["--nproc-per-node", str(nproc), "--max-restarts", str(cfg.max_restarts)]
    if cfg.nnodes == 1 and cfg.rdzv_endpoint is None:
        argv += ["--standalone"]
    else:
        argv += ["--nnodes", str(cfg.nnodes), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", str(cfg.rdzv_endpoint), "--rdzv-id", cfg.rdzv_id]
        if cfg.node_rank is not None:
            argv += ["--node-rank", str(cfg.node_rank)]
    return [*argv, "--module", "dpserve.finetune.train", *training_argv(cfg)]


def run_finetune(cfg: FinetuneConfig, given: Collection[str] = ()) -> int:
    """Check, then train. `given`: the settings given a value (flag, env or file), which
    a resume does not take from its run (`dpserve.finetune.resume`)."""
    from dpserve.records import DataError

    started = time.monotonic()

    if Path(cfg.model).is_dir():  # checkpoints name their base: absolute, valid anywhere
        cfg = dataclasses.replace(cfg, model=str(Path(cfg.model).absolute()))
    nproc = cfg.nproc_per_node or len(visible_gpus()) or DEFAULT_CPU_PROCS
    if nproc < 1:
        raise ConfigError("nproc_per_node: must be >= 1")
    try:
        if cfg.resume:
            taken = resume.take_run_settings(cfg, given, nproc * cfg.nnodes)
            cfg = taken.cfg
            if taken.settings:
                print(f"dpserve finetune: resuming {taken.checkpoint} with the run's "
                      f"settings: {', '.join(taken.settings)}", flush=True)
        preflight(cfg, nproc * cfg.nnodes)
    except (PreflightError, resume.ResumeError, DataError, ckpt.CheckpointError) as exc:
        print(f"dpserve finetune: {exc}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_argv(cfg, nproc)]
    print(f"dpserve finetune: {' '.join(cmd[1:])}", flush=True)
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    env = {"OMP_NUM_THREADS": str(threads), **os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env)
    stopper = _GracefulStop(proc)
    previous = {s: signal.signal(s, stopper.handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
        took = fmt_duration(time.monotonic() - started)
        print(f"dpserve finetune: finished in {took} (wall time, start-up included)"
              if code == 0 else f"dpserve finetune: failed after {took} (exit code {code})",
              file=sys.stdout if code == 0 else sys.stderr, flush=True)
        return code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(10)


class _GracefulStop:
    """First SIGTERM/SIGINT: ask the *workers* to stop. They agree on it at the next
    step boundary, save a checkpoint and exit 0, so the elastic agent ends cleanly.
    (Signalling the agent instead makes it kill the workers and exit with an error.)
    A second signal goes to the agent: stop now."""

    def __init__(self, agent: subprocess.Popen[bytes]) -> None:
        self._agent = agent
        self._asked = False

    def handle(self, signum: int, frame: object) -> None:
        import psutil

        if self._asked:
            self._agent.send_signal(signum)
            return
        self._asked = True
        print("dpserve finetune: stopping at the next step boundary (signal again to abort)",
              file=sys.stderr, flush=True)
        try:
            workers = psutil.Process(self._agent.pid).children()
        except psutil.NoSuchProcess:
            return
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.send_signal(signal.SIGTERM)
