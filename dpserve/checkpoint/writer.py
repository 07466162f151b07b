"""Publishing and pruning checkpoints: the writer's side (`dpserve finetune`).

Every save writes into a temporary directory beside its final place, fsyncs each
file, writes the metadata (or the marker) last, fsyncs, and renames the directory
into place, so a process killed at any moment never leaves something that looks
complete. Deletion renames first and removes after, for the same reason.
Checkpoints are never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dpserve.checkpoint.format import (
    FORMAT_VERSION,
    META_FILE,
    STATE_DIR,
    STATE_MARKER,
    CheckpointError,
    CheckpointMeta,
    list_checkpoints,
    regular_tree,
    step_dirs,
    step_name,
)
from dpserve.fsutil import children, is_real_dir, publish, remove_dir, write_durably

_TEMP_DIR = re.compile(r"^\.step-\d{6,}\.tmp-")


def write_checkpoint(
    output_dir: Path,
    step: int,
    write_files: Callable[[Path], object],
    *,
    base_model: str,
    loss: float | None,
    world_size: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Publish `output_dir/step-NNNNNN` and return it.

    `write_files(tmp)` fills a fresh temporary directory inside `output_dir` with what vLLM
    loads (e.g. `model.save_pretrained(tmp)`); it must not create dpserve.json, symlinks or
    special files. Then every file is made world-readable, hashed and fsynced, dpserve.json
    written and fsynced, the directory fsynced and renamed into place. Until that rename
    nothing named `step-*` exists; on any exception the temporary directory is removed and
    the exception propagates. An existing `step-NNNNNN` is a CheckpointError: checkpoints
    are never overwritten in place (a running vLLM may be reading one).
    """
    output_dir = Path(output_dir)
    final = output_dir / step_name(step)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    extra = dict(extra or {})
    try:  # fail before the (long) write, not after it
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra must be JSON-serialisable: {exc}") from None
    if os.path.lexists(final):
        raise CheckpointError(f"{final} already exists; checkpoints are never overwritten")

    def fill(tmp: Path) -> None:
        write_files(tmp)
        files = {}
        for path in _seal_tree(tmp):
            rel = path.relative_to(tmp).as_posix()
            if rel == META_FILE:
                raise CheckpointError(f"{tmp}: the writer must not create {META_FILE}")
            with path.open("rb") as f:
                files[rel] = hashlib.file_digest(f, "sha256").hexdigest()
                os.fsync(f.fileno())
        meta = CheckpointMeta(
            format_version=FORMAT_VERSION, step=step, base_model=base_model, files=files,
            loss=loss, created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            world_size=world_size, extra=extra,
        )
        write_durably(tmp / META_FILE, json.dumps(meta.to_json(), indent=2) + "\n")

    try:
        publish(output_dir, final, fill, replace=False)
    except FileExistsError:
        raise CheckpointError(f"{final} already exists; checkpoints are never overwritten"
                              ) from None
    return final


def write_train_state(output_dir: Path, step: int, write_files: Callable[[Path], object]) -> Path:
    """Publish `output_dir/train-state/step-NNNNNN` (resume state) and return it.

    Same discipline as `write_checkpoint`, with the marker file `complete` written last
    instead of hashes. An existing state for the step (left by a run that died before its
    checkpoint was published) is replaced: moved aside, the new one renamed in, the old
    one removed, so the step never has a half-deleted directory that holds a marker.
    """
    state_root = Path(output_dir) / STATE_DIR
    final = state_root / step_name(step)

    def fill(tmp: Path) -> None:
        write_files(tmp)
        for path in _seal_tree(tmp):
            if path.relative_to(tmp).as_posix() == STATE_MARKER:
                raise CheckpointError(f"{tmp}: the writer must not create {STATE_MARKER}")
            with path.open("rb") as f:
                os.fsync(f.fileno())
        write_durably(tmp / STATE_MARKER, f"{step}\n")

    publish(state_root, final, fill, replace=True)
    return final




def prune_checkpoints(output_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` (>= 1) complete checkpoints, training states
    older than the newest kept checkpoint that belong to no kept one, and every temporary
    directory left by an interrupted save. Returns what was deleted.

    Only the writer calls this (a temporary directory may be a save in progress otherwise).
    Nothing outside the naming scheme is touched. Each directory is renamed to a temporary
    name before it is removed, so an interrupted prune never leaves a half-deleted directory
    that still looks complete; the next prune finishes the job.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    output_dir = Path(output_dir)
    state_root = output_dir / STATE_DIR
    complete = list_checkpoints(output_dir)
    doomed = [path for _, path in complete[:-keep_last]]
    if complete:
        kept = {step for step, _ in complete[-keep_last:]}
        newest = complete[-1][0]
        for path in step_dirs(state_root):
            step = int(path.name.removeprefix("step-"))
            if path.name == step_name(step) and step < newest and step not in kept:
                doomed.append(path)
    deleted = []
    for path in doomed:
        remove_dir(path)
        deleted.append(path)
    for root in (output_dir, state_root):
        for path in children(root):
            if _TEMP_DIR.match(path.name) and is_real_dir(path):
                shutil.rmtree(path)
                deleted.append(path)
    return deleted




def _seal_tree(root: Path) -> list[Path]:
    """Make everything under `root` world-readable; return its regular files, sorted."""
    files, dirs = regular_tree(root)
    for directory in dirs:
        directory.chmod(0o755)
    for path in files:
        path.chmod(0o644)
    return files
