"""What a checkpoint is, and reading one defensively: names, `dpserve.json`, listing
and verification (the rolling deploy's side; `dpserve.checkpoint.writer` is the
fine-tune's).

A directory is a checkpoint only if it is named `step-NNNNNN` for the step its
valid `dpserve.json` records.

Reading is defensive: a checkpoint directory may be written by others (the
fine-tune job, anyone with the shared volume). Files are opened without
following symbolic links and without blocking (a FIFO named like a file must
not hang a reader), must be regular files, and metadata is read with a size cap.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any

from dpserve.fsutil import children, is_real_dir

META_FILE = "dpserve.json"
FORMAT_VERSION = 1
STATE_DIR = "train-state"
STATE_MARKER = "complete"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""What a LoRA adapter checkpoint (kind lora) holds besides dpserve.json: peft's files,
as vLLM's `--enable-lora` loads them."""

MAX_META_BYTES = 16 * 1024 * 1024
"""Largest dpserve.json (or other JSON metadata) read; a real one is a few KiB."""

_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(Exception):
    """A directory is not a valid checkpoint, or cannot be written as one; the message
    names the path and what is wrong."""


def step_name(step: int) -> str:
    """`step-000120`: six digits, more past 999,999, so names sort by step in practice."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"step-{step:06d}"


@dataclass(frozen=True)
class CheckpointMeta:
    """Contents of `dpserve.json`."""

    format_version: int
    """`FORMAT_VERSION` of the writer; a reader refuses any other."""
    step: int
    """Optimizer steps taken; the directory is named `step_name(step)`."""
    base_model: str
    """What fine-tuning started from (a path or a hub id), as given to the trainer."""
    files: dict[str, str]
    """Relative POSIX path -> sha256 hex of every file in the directory but dpserve.json."""
    loss: float | None
    """Training loss at the last step (may be NaN if training diverged), None if unknown."""
    created_at: str
    """When the checkpoint was written, ISO 8601 in UTC."""
    world_size: int
    """Data-parallel ranks that trained it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form, JSON-serialisable facts (lr, epoch, tokens seen)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: Path | None = None) -> CheckpointMeta:
        """Validate parsed `dpserve.json`; CheckpointError names `where` and the field.
        Unknown keys are ignored: a newer writer adding fields bumps nothing."""
        at = f"{where / META_FILE if where is not None else META_FILE}"
        if not isinstance(data, dict):
            raise CheckpointError(f"{at}: must hold a JSON object")
        types: dict[str, tuple[type, ...]] = {
            "format_version": (int,), "step": (int,), "base_model": (str,), "files": (dict,),
            "loss": (int, float, type(None)), "created_at": (str,), "world_size": (int,),
            "extra": (dict,),
        }
        for name, allowed in types.items():
            if name not in data:
                raise CheckpointError(f"{at}: lacks '{name}'")
            value = data[name]
            if not isinstance(value, allowed) or isinstance(value, bool):
                raise CheckpointError(f"{at}: field '{name}' has the wrong type "
                                      f"({type(value).__name__})")
        if data["format_version"] != FORMAT_VERSION:
            raise CheckpointError(f"{at}: field 'format_version' is {data['format_version']}, "
                                  f"this dpserve reads {FORMAT_VERSION}")
        if data["step"] < 0:
            raise CheckpointError(f"{at}: field 'step' is negative")
        if data["world_size"] < 1:
            raise CheckpointError(f"{at}: field 'world_size' must be >= 1")
        try:
            datetime.fromisoformat(data["created_at"])
        except ValueError:
            raise CheckpointError(f"{at}: field 'created_at' is not ISO 8601") from None
        for rel, digest in data["files"].items():
            if not _is_plain_relative(rel) or rel == META_FILE:
                raise CheckpointError(f"{at}: field 'files' lists a bad path {rel!r}")
            if not isinstance(digest, str) or not _SHA256.match(digest):
                raise CheckpointError(f"{at}: field 'files' has a bad sha256 for {rel}")
        loss = data["loss"]
        return cls(**{name: data[name] for name in types}
                   | {"loss": None if loss is None else float(loss)})


def checkpoint_kind(meta: CheckpointMeta) -> str:
    """What the directory holds: `full` (weights vLLM serves; also every checkpoint written
    before kinds existed) or `lora` (an adapter: `dpserve.finetune.lora`), from extra["kind"]."""
    return str(meta.extra.get("kind", "full"))


def open_regular(path: Path, *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of `path`, which must be a regular file: never follows a
    symbolic link (in its last component), never blocks on a FIFO or device, and checks
    the file type on the open descriptor (what is read), not only on the name."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: symbolic links are not allowed in a checkpoint"
                                  ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: only regular files belong in a checkpoint")
    return fd


def read_capped(path: Path, limit: int = MAX_META_BYTES, *, dir_fd: int | None = None) -> bytes:
    """The bytes of a small regular file (see `open_regular`); CheckpointError past `limit`."""
    fd = open_regular(path, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path}: larger than {limit} bytes; not checkpoint metadata")
    return data


def sha256_file(path: Path) -> str:
    """sha256 hex of a regular file's bytes, read in chunks."""
    with os.fdopen(open_regular(path), "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def base_fingerprint(model_dir: str | Path) -> str:
    """sha256 hex over, in this order, config.json and every *.safetensors file directly
    in `model_dir` sorted by name, each contributing `name NUL sha256hex(content)`:
    an adapter only fits the exact weights it was trained on. Files are hashed in
    chunks (memory stays flat); the cost is one read of the weights, ~1 s per GB.
    A hub id (no local directory) is fingerprinted by its name."""
    base = Path(model_dir)
    if not base.is_dir():
        return hashlib.sha256(f"hub:{model_dir}".encode()).hexdigest()
    paths = [base / "config.json", *base.glob("*.safetensors")]
    return fingerprint_of({p.name: sha256_file(p) for p in paths if p.is_file()})


def fingerprint_of(files: dict[str, str]) -> str:
    """`base_fingerprint` from known hashes (relative path -> sha256 hex, as a manifest's
    `files`), without reading a byte: what it would be for a directory holding exactly
    those files, already checked against them (a deploy's snapshot)."""
    digest = hashlib.sha256()
    weights = sorted(n for n in files if "/" not in n and n.endswith(".safetensors"))
    for name in ["config.json", *weights] if "config.json" in files else weights:
        digest.update(name.encode() + b"\0" + files[name].encode())
    return digest.hexdigest()


def train_state_dir(output_dir: Path, step: int) -> Path | None:
    """The training state saved for `step`, or None unless its marker says it is complete."""
    path = Path(output_dir) / STATE_DIR / step_name(step)
    return path if (path / STATE_MARKER).is_file() else None


def read_meta(ckpt_dir: Path) -> CheckpointMeta:
    """Parse and validate `ckpt_dir/dpserve.json` (cheap: no hashing). Missing, unreadable
    or invalid metadata is a CheckpointError: such a directory is not a checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    return parse_meta(read_meta_bytes(ckpt_dir), ckpt_dir)


def parse_meta(raw: bytes, ckpt_dir: Path) -> CheckpointMeta:
    """Validate the bytes of `ckpt_dir/dpserve.json` (see `read_meta`)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{ckpt_dir}: cannot read {META_FILE}: "
                              f"{exc if not isinstance(exc, RecursionError) else 'too deep'}"
                              ) from None
    return CheckpointMeta.from_json(data, ckpt_dir)


def read_meta_bytes(ckpt_dir: Path, *, dir_fd: int | None = None) -> bytes:
    where = META_FILE if dir_fd is not None else ckpt_dir / META_FILE
    try:
        return read_capped(Path(where), dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir}: no {META_FILE}, so not a complete checkpoint"
                              ) from None
    except OSError as exc:
        raise CheckpointError(f"{ckpt_dir}: cannot read {META_FILE}: {exc.strerror}") from None


def verify_checkpoint(ckpt_dir: Path) -> CheckpointMeta:
    """`read_meta`, and: the directory is named for its step, every listed file is present
    with its sha256, and nothing else is there (an extra file means a half-copy or
    tampering). Reads every byte; call it before loading, not when listing."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    if ckpt_dir.name != step_name(meta.step):
        raise CheckpointError(f"{ckpt_dir}: {META_FILE} says step {meta.step}, so the "
                              f"directory should be named {step_name(meta.step)}")
    present = {p.relative_to(ckpt_dir).as_posix() for p in regular_tree(ckpt_dir)[0]} - {META_FILE}
    for missing in sorted(set(meta.files) - present):
        raise CheckpointError(f"{ckpt_dir}: {missing} is listed but missing")
    for extra in sorted(present - set(meta.files)):
        raise CheckpointError(f"{ckpt_dir}: {extra} is not listed in {META_FILE}")
    for rel, digest in sorted(meta.files.items()):
        if sha256_file(ckpt_dir / rel) != digest:
            raise CheckpointError(f"{ckpt_dir}: {rel} does not match its sha256")
    return meta


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first. A directory counts if it is named
    for the step its readable dpserve.json records; temporary directories, directories
    without metadata, symlinks and other names are ignored. A missing `output_dir` is empty."""
    found = []
    for path in step_dirs(Path(output_dir)):
        try:
            meta = read_meta(path)
        except CheckpointError:
            continue
        if path.name == step_name(meta.step):
            found.append((meta.step, path))
    return sorted(found)


def latest_checkpoint(output_dir: Path, *, with_train_state: bool = False) -> Path | None:
    """The newest complete checkpoint; with `with_train_state`, the newest whose training
    state is complete too (what a resume needs). None if there is none."""
    for step, path in reversed(list_checkpoints(output_dir)):
        if not with_train_state or train_state_dir(output_dir, step) is not None:
            return path
    return None


# -- helpers -------------------------------------------------------------------------------


def regular_tree(root: Path) -> tuple[list[Path], list[Path]]:
    """Regular files and directories under `root`, sorted; a symbolic link or a special
    file is a CheckpointError."""
    files, dirs = [], []
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            raise CheckpointError(f"{path}: symbolic links are not allowed in a checkpoint")
        if stat.S_ISDIR(mode):
            dirs.append(path)
        elif stat.S_ISREG(mode):
            files.append(path)
        else:
            raise CheckpointError(f"{path}: only regular files belong in a checkpoint")
    return files, dirs


def step_dirs(root: Path) -> list[Path]:
    """The real directories in `root` named `step-NNNNNN`."""
    return [p for p in children(root) if _STEP_DIR.match(p.name) and is_real_dir(p)]


def _is_plain_relative(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    return (bool(parts) and not rel.startswith("/") and "\\" not in rel
            and PurePosixPath(*parts).as_posix() == rel
            and all(part not in (".", "..") for part in parts))
