"""Which weights the replicas should serve: the base model, or the deployed checkpoint.

One `Deployed` record per serving process, shared by the supervisor and the
rollout. The supervisor starts and restarts every replica on `current`, so a
replica whose engine died never comes back serving stale weights; the rollout
moves `current` to a checkpoint when a deploy starts and back when it rolls
back. A replica's `weight_version` in the pool says what it actually serves;
`current.version` is what it should serve.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import secrets
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from dpserve.checkpoint import CheckpointError, CheckpointMeta, read_meta, step_name
from dpserve.rollout.progress import DeployProgress

_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+-]")


@dataclass(frozen=True)
class Weights:
    """A set of weights a replica can serve."""

    path: str
    """What vLLM loads: `--model` at start, `weights_path` of a hot-load."""
    version: str
    """Names the weights in /admin/replicas, metrics and `x-dpserve-weight-version`.
    ASCII only (it travels in an HTTP header); equal versions mean equal files."""
    step: int | None = None
    """Fine-tuning step of a checkpoint; None for a base model."""


def checkpoint_version(meta: CheckpointMeta) -> str:
    """`step-000120@3f2a9c1b`: the step, and a digest of every file's sha256, so two
    fine-tuning runs that both reach step 120 still get different versions."""
    files = json.dumps(meta.files, sort_keys=True).encode()
    return f"{step_name(meta.step)}@{hashlib.sha256(files).hexdigest()[:8]}"


def checkpoint_weights(ckpt_dir: Path, meta: CheckpointMeta) -> Weights:
    return Weights(str(Path(ckpt_dir).resolve()), checkpoint_version(meta), meta.step)


def weights_for(model: str) -> Weights:
    """The weights of a served model as given to `dpserve serve --model`.

    A dpserve checkpoint is named by its checkpoint version (so a replica started on
    it and one hot-loaded with it report the same version); another local directory
    by `base:NAME`; a hub id by `base:` and the id. Reads metadata only, no weights.
    """
    path = Path(model)
    if not path.is_dir():
        return Weights(model, _ascii(f"base:{model}"))
    resolved = path.resolve()
    try:
        meta = read_meta(resolved)
    except CheckpointError:
        return Weights(str(resolved), _ascii(f"base:{resolved.name}"))
    return checkpoint_weights(resolved, meta)


def _ascii(text: str) -> str:
    return _UNSAFE.sub("_", text)


class Deployed:
    """The weights every replica should serve now (mutable; one owner per process)."""

    def __init__(self, base: Weights) -> None:
        self.base = base
        """What the replicas were launched with; checkpoints are validated against it."""
        self.current = base
        """What a replica (re)started now must load."""

    def __repr__(self) -> str:
        return f"Deployed(current={self.current.version}, base={self.base.version})"


def point_link(link: Path, target: Path) -> None:
    """Make `link` a symlink to `target`, atomically: a reader sees the old target or the
    new one, never no link (a new link is renamed over the old one)."""
    tmp = link.with_name(f".{link.name}.{secrets.token_hex(4)}")
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


async def point_deployed_link(link: Path, target: str, progress: DeployProgress, *,
                              executor: Executor) -> None:
    """`point_link` (run on `executor`: the rollout's admin threads) after a deploy
    succeeded, noted in its record; a failure is logged, not raised: the replicas serve
    the target, only later restarts are affected."""
    try:
        await asyncio.get_running_loop().run_in_executor(executor, point_link, link,
                                                         Path(target))
    except OSError as exc:
        progress.event(f"could not point {link} at {target}: {exc}", level=logging.ERROR)
    else:
        progress.event(f"{link} -> {target}")
