"""The on-disk checkpoint format shared by `dpserve finetune` (writer) and the
rolling deploy (reader, validator).

Layout of a fine-tune output directory::

    OUTPUT/step-000120/              what vLLM loads: HF layout (config, safetensors, tokenizer)
    OUTPUT/step-000120/dpserve.json  written last: step, base model, sha256 of every file, ...
    OUTPUT/train-state/step-000120/  optimizer, scheduler, RNG for --resume; `complete` last
    OUTPUT/.step-000120.tmp-XXXX/    a save in progress (or one killed midway)

A directory is a checkpoint only if it holds a valid `dpserve.json`. Every save
writes into a temporary directory, fsyncs each file, writes the metadata,
fsyncs, and renames the directory into place: a process killed at any moment
never leaves something that looks complete. Checkpoints are never overwritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

META_FILE = "dpserve.json"
FORMAT_VERSION = 1
STATE_DIR = "train-state"
STATE_MARKER = "complete"

_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_TEMP_DIR = re.compile(r"^\.step-\d{6,}\.tmp-")


class CheckpointError(Exception):
    """A directory is not a (valid) checkpoint; the message names it and the problem."""


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:06d}"


@dataclass(frozen=True)
class CheckpointMeta:
    """Contents of `dpserve.json`."""

    format_version: int
    step: int
    base_model: str
    files: dict[str, str]
    """Relative path -> sha256 of every file in the checkpoint except dpserve.json."""
    loss: float | None
    created_at: str
    world_size: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: Path) -> CheckpointMeta:
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: {META_FILE} must hold a JSON object")
        types: dict[str, tuple[type, ...]] = {
            "format_version": (int,), "step": (int,), "base_model": (str,), "files": (dict,),
            "loss": (int, float, type(None)), "created_at": (str,), "world_size": (int,),
            "extra": (dict,),
        }
        for name, allowed in types.items():
            if name not in data:
                raise CheckpointError(f"{where}: {META_FILE} lacks '{name}'")
            if not isinstance(data[name], allowed) or isinstance(data[name], bool):
                raise CheckpointError(f"{where}: {META_FILE} field '{name}' has the wrong type")
        if data["format_version"] != FORMAT_VERSION:
            raise CheckpointError(f"{where}: format version {data['format_version']} is not "
                                  f"{FORMAT_VERSION}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["files"].items()):
            raise CheckpointError(f"{where}: {META_FILE} 'files' must map names to sha256")
        return cls(**{name: data[name] for name in types})


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


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
    """Save a checkpoint: `write_files(tmp)` fills a temporary directory with what vLLM
    loads; hashes and `dpserve.json` follow, then an atomic rename to `step-NNNNNN`."""
    output_dir = Path(output_dir)
    final = output_dir / step_name(step)
    if final.exists():
        raise CheckpointError(f"{final} already exists; checkpoints are never overwritten")

    def finish(tmp: Path) -> None:
        write_files(tmp)
        files = {}
        for path in sorted(_files(tmp)):
            rel = path.relative_to(tmp).as_posix()
            if rel == META_FILE:
                raise CheckpointError(f"{tmp}: the writer must not create {META_FILE}")
            files[rel] = sha256_file(path)
            _fsync(path)
        meta = CheckpointMeta(
            format_version=FORMAT_VERSION, step=step, base_model=base_model, files=files,
            loss=loss, created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            world_size=world_size, extra=dict(extra or {}),
        )
        (tmp / META_FILE).write_text(json.dumps(meta.to_json(), indent=2) + "\n")

    _publish(output_dir, final, finish)
    return final


def write_train_state(output_dir: Path, step: int, write_files: Callable[[Path], object]) -> Path:
    """Save resume state to `train-state/step-NNNNNN/`, marker last, rename into place."""
    state_root = Path(output_dir) / STATE_DIR
    final = state_root / step_name(step)
    if final.exists():  # left by a run that died before its checkpoint was published
        shutil.rmtree(final)

    def finish(tmp: Path) -> None:
        write_files(tmp)
        for path in _files(tmp):
            _fsync(path)
        (tmp / STATE_MARKER).write_text(f"{step}\n")

    _publish(state_root, final, finish)
    return final


def train_state_dir(output_dir: Path, step: int) -> Path | None:
    path = Path(output_dir) / STATE_DIR / step_name(step)
    return path if (path / STATE_MARKER).is_file() else None


def read_meta(ckpt_dir: Path) -> CheckpointMeta:
    ckpt_dir = Path(ckpt_dir)
    try:
        data = json.loads((ckpt_dir / META_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir}: no {META_FILE}, so not a complete checkpoint"
                              ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{ckpt_dir}: cannot read {META_FILE}: {exc}") from None
    return CheckpointMeta.from_json(data, ckpt_dir)


def verify_checkpoint(ckpt_dir: Path) -> CheckpointMeta:
    """read_meta, and every file present, unchanged (sha256), nothing unlisted."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    match = _STEP_DIR.match(ckpt_dir.name)
    if match and int(match[1]) != meta.step:
        raise CheckpointError(f"{ckpt_dir}: {META_FILE} says step {meta.step}")
    present = {p.relative_to(ckpt_dir).as_posix() for p in _files(ckpt_dir)} - {META_FILE}
    for missing in sorted(set(meta.files) - present):
        raise CheckpointError(f"{ckpt_dir}: {missing} is listed but missing")
    for extra in sorted(present - set(meta.files)):
        raise CheckpointError(f"{ckpt_dir}: {extra} is not listed in {META_FILE}")
    for rel, digest in sorted(meta.files.items()):
        if sha256_file(ckpt_dir / rel) != digest:
            raise CheckpointError(f"{ckpt_dir}: {rel} does not match its sha256")
    return meta


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (readable metadata) as (step, path), oldest first."""
    found = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for path in Path(output_dir).iterdir():
            match = _STEP_DIR.match(path.name)
            if not match or not path.is_dir():
                continue
            try:
                meta = read_meta(path)
            except CheckpointError:
                continue
            if meta.step == int(match[1]):
                found.append((meta.step, path))
    return sorted(found)


def latest_checkpoint(output_dir: Path, *, with_train_state: bool = False) -> Path | None:
    for step, path in reversed(list_checkpoints(output_dir)):
        if not with_train_state or train_state_dir(output_dir, step) is not None:
            return path
    return None


def prune_checkpoints(output_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (and their train state), and
    temporary directories left by interrupted saves. Only the writer calls this."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    output_dir = Path(output_dir)
    doomed = [path for _, path in list_checkpoints(output_dir)[:-keep_last]]
    doomed += [output_dir / STATE_DIR / p.name for p in doomed]
    for root in (output_dir, output_dir / STATE_DIR):
        with contextlib.suppress(FileNotFoundError):
            doomed += [p for p in root.iterdir() if _TEMP_DIR.match(p.name)]
    deleted = []
    for path in doomed:
        if path.exists():
            shutil.rmtree(path)
            deleted.append(path)
    return deleted


def _publish(parent: Path, final: Path, finish: Callable[[Path], None]) -> None:
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    try:
        finish(tmp)
        for path in [tmp, *tmp.rglob("*")]:  # a vLLM under another user must read them
            path.chmod(0o755 if path.is_dir() else 0o644)
        _fsync(tmp)
        os.rename(tmp, final)
        _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _files(root: Path) -> list[Path]:
    files = []
    for path in root.rglob("*"):
        if path.is_symlink():
            raise CheckpointError(f"{path}: symbolic links are not allowed in a checkpoint")
        if path.is_file():
            files.append(path)
    return files


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
