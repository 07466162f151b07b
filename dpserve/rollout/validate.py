"""Is a directory a checkpoint that can be hot-loaded into the served model?

vLLM's in-place reload keeps the engine's config, tokenizer and tensor layout
and only copies new values in: a checkpoint with other shapes makes the engine
die on its next request, another tokenizer silently changes what every token
means, and NaN weights poison the KV cache (a later reload does not clean it).
So every check happens here, before any replica changes, from what can be read
without loading the model:

1. `dpserve.json` is present and valid, every file matches its sha256, nothing
   else is in the directory (`checkpoint.verify_checkpoint`, or the snapshot store
   as it copies the checkpoint: `dpserve.rollout.snapshot`), and its `kind` is
   full weights, not a LoRA adapter (deployed with `--name`, or `--merge`);
2. `config.json` equals the served model's (architecture, sizes, vocab size);
3. tensor names, shapes and dtypes equal the served model's, read from the
   safetensors headers (8-byte length + JSON), not from the tensors; each tensor's
   byte range is exactly its shape's worth, inside the file, overlapping no other;
4. the tokenizer files are byte-identical to the served model's;
5. no floating-point tensor holds NaN or infinity (a diverged run), checked on
   the raw bytes by their exponent bits, a chunk at a time.

`Refused` carries the HTTP status the admin API answers with: 422 for a
directory that is not a sound checkpoint, 409 for one that conflicts with the
served model. Messages name the file, tensor or key that differs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpserve.checkpoint import (
    META_FILE,
    CheckpointError,
    CheckpointMeta,
    checkpoint_kind,
    open_regular,
    read_capped,
    read_meta,
    sha256_file,
    verify_checkpoint,
)

CONFIG_FILE = "config.json"
# Keys that describe how a config was written, not the model.
_CONFIG_IGNORED = frozenset({"_name_or_path", "transformers_version"})
TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt",
                   "*.tiktoken", "chat_template*", "added_tokens.json")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
# Bytes per element of each safetensors dtype: a tensor's data range must be exactly
# its shape's worth, inside the file, and overlap no other tensor's.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E5M2": 1, "F8_E4M3": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
               "BOOL": 1}
MAX_REPORTED = 5
_CHUNK_BYTES = 64 * 1024 * 1024

# safetensors float dtype -> (unsigned view, exponent mask): all exponent bits set means
# infinity or NaN. float8 e4m3 has no infinity; its NaN is S.1111.111.
_FLOAT_BITS: dict[str, tuple[type[np.unsignedinteger[Any]], int]] = {
    "F64": (np.uint64, 0x7FF0000000000000),
    "F32": (np.uint32, 0x7F800000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E5M2": (np.uint8, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F),
}


class Refused(Exception):
    """A checkpoint the rollout will not load; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        """The request field at fault (OpenAI's `param`); None for a conflict with state."""


@contextlib.contextmanager
def named_as(snapshot: Path, ckpt_dir: Path) -> Iterator[None]:
    """Refusals of a snapshot's check name the checkpoint as its deploy did, not the
    snapshot's copy of it (a path the user never wrote)."""
    try:
        yield
    except Refused as exc:
        raise Refused(exc.status, exc.message.replace(str(snapshot), str(ckpt_dir)),
                      param=exc.param) from None


def adapter_as_weights(ckpt_dir: str | Path) -> Refused:
    """The refusal of a LoRA adapter deployed as full weights (without `--name`)."""
    return refused(422, f"{ckpt_dir}: is a LoRA adapter (kind lora), not full weights; "
                        "serve it beside the base with `dpserve deploy CHECKPOINT --name "
                        "NAME` (replicas started with --enable-lora), or fold it into "
                        "full weights with `dpserve deploy CHECKPOINT --merge`")


def is_adapter(ckpt_dir: str | Path) -> bool:
    """Whether `ckpt_dir`'s manifest says it holds a LoRA adapter (cheap: no hashing;
    False for anything unreadable, which validation then names)."""
    try:
        return checkpoint_kind(read_meta(Path(ckpt_dir))) == "lora"
    except (CheckpointError, OSError, ValueError):
        return False


def refused(status: int, message: str) -> Refused:
    """A refusal of the checkpoint itself: its `param` is the request's `checkpoint`."""
    return Refused(status, message, param="checkpoint")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    file: str
    offsets: tuple[int, int]
    """Byte range of the data, counted from the end of the file's header."""


@dataclass(frozen=True)
class ModelFingerprint:
    """What must not change between the served model and a checkpoint of it."""

    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    tokenizer: dict[str, str]
    """Tokenizer file name -> sha256."""


def fingerprint(model_dir: Path) -> ModelFingerprint:
    """Read config, safetensors headers and tokenizer hashes of a local model directory.
    Refused(422) if one cannot be read."""
    model_dir = Path(model_dir)
    try:
        config = json.loads(read_capped(model_dir / CONFIG_FILE).decode("utf-8"))
    except (OSError, ValueError, RecursionError, CheckpointError) as exc:
        raise refused(422, f"{model_dir}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise refused(422, f"{model_dir}/{CONFIG_FILE}: must hold a JSON object")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise refused(422, f"{model_dir}: no *.safetensors files (only safetensors "
                           "weights can be hot-loaded)")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if name in tensors:
                raise refused(422, f"{model_dir}: tensor {name} is in both "
                                   f"{tensors[name].file} and {path.name}")
            tensors[name] = info
    tokenizer = {p.name: sha256_file(p) for pattern in TOKENIZER_GLOBS
                 for p in model_dir.glob(pattern) if p.is_file()}
    return ModelFingerprint(
        config={k: v for k, v in config.items() if k not in _CONFIG_IGNORED},
        tensors=tensors, tokenizer=tokenizer)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes, shapes and data offsets, from the header alone; Refused(422)
    unless every tensor's data is exactly its shape's worth of bytes, inside the file,
    overlapping no other tensor's."""
    try:
        with os.fdopen(open_regular(Path(path)), "rb") as f:
            prefix = f.read(8)
            size = f.seek(0, 2)
            if len(prefix) < 8:
                raise refused(422, f"{path}: not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise refused(422, f"{path}: not a safetensors file (header length {length})")
            f.seek(8)
            header = json.loads(f.read(length))
    except CheckpointError as exc:
        raise refused(422, str(exc)) from None
    except OSError as exc:
        raise refused(422, f"{path}: cannot read: {exc.strerror}") from None
    except (ValueError, RecursionError):
        raise refused(422, f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise refused(422, f"{path}: safetensors header is not a JSON object")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            tensors[name] = TensorInfo(
                dtype=str(entry["dtype"]), shape=tuple(int(d) for d in entry["shape"]),
                file=path.name, offsets=(int(entry["data_offsets"][0]),
                                         int(entry["data_offsets"][1])))
        except (KeyError, TypeError, ValueError, IndexError):
            raise refused(422, f"{path}: malformed header entry for tensor {name}") from None
    _check_layout(path, tensors, data_bytes=size - 8 - length)
    return tensors


def _check_layout(path: Path, tensors: dict[str, TensorInfo], *, data_bytes: int) -> None:
    end_of_last, last = 0, None
    for name, info in sorted(tensors.items(), key=lambda kv: kv[1].offsets):
        begin, end = info.offsets
        width = DTYPE_BYTES.get(info.dtype)
        if width is None:
            raise refused(422, f"{path}: tensor {name} has an unknown dtype {info.dtype!r}")
        if any(d < 0 for d in info.shape):
            raise refused(422, f"{path}: tensor {name} has a negative dimension")
        if not 0 <= begin <= end <= data_bytes:
            raise refused(422, f"{path}: tensor {name}'s data offsets [{begin}, {end}] are "
                               f"reversed or outside the file's {data_bytes} data bytes")
        if end - begin != math.prod(info.shape) * width:
            raise refused(422, f"{path}: tensor {name} holds {end - begin} bytes, but its "
                               f"shape {list(info.shape)} of {info.dtype} needs "
                               f"{math.prod(info.shape) * width}")
        if begin < end_of_last:
            raise refused(422, f"{path}: tensors {last} and {name} overlap")
        end_of_last, last = end, name


def differences(served: ModelFingerprint, candidate: ModelFingerprint) -> list[str]:
    """Every way `candidate` differs from `served`, as messages naming what differs."""
    found: list[str] = []
    for key in sorted(served.config.keys() | candidate.config.keys()):
        ours, theirs = served.config.get(key), candidate.config.get(key)
        if ours != theirs:
            found.append(f"{CONFIG_FILE}: {key} is {_show(theirs)} in the checkpoint, "
                         f"{_show(ours)} in the served model")
    missing = sorted(served.tensors.keys() - candidate.tensors.keys())
    extra = sorted(candidate.tensors.keys() - served.tensors.keys())
    found += [f"tensor {name} is missing from the checkpoint" for name in missing]
    found += [f"tensor {name} is not in the served model" for name in extra]
    for name in sorted(served.tensors.keys() & candidate.tensors.keys()):
        ours_t, theirs_t = served.tensors[name], candidate.tensors[name]
        if ours_t.shape != theirs_t.shape:
            found.append(f"tensor {name} has shape {list(theirs_t.shape)} in the checkpoint, "
                         f"{list(ours_t.shape)} in the served model")
        if ours_t.dtype != theirs_t.dtype:
            found.append(f"tensor {name} has dtype {theirs_t.dtype} in the checkpoint, "
                         f"{ours_t.dtype} in the served model")
    if served.tokenizer != candidate.tokenizer:
        found.append(_tokenizer_difference(served.tokenizer, candidate.tokenizer))
    return found


def _tokenizer_difference(ours: dict[str, str], theirs: dict[str, str]) -> str:
    for name in sorted(ours.keys() | theirs.keys()):
        if name not in theirs:
            return f"tokenizer: {name} is missing from the checkpoint"
        if name not in ours:
            return f"tokenizer: {name} is not in the served model"
        if ours[name] != theirs[name]:
            return f"tokenizer: {name} differs from the served model's (another vocabulary?)"
    return "tokenizer differs"  # unreachable: the dicts differ


def _show(value: Any) -> str:
    return "absent" if value is None else json.dumps(value)


def check_finite(model_dir: Path, tensors: dict[str, TensorInfo]) -> None:
    """Refused(422) naming the first floating-point tensor with a NaN or infinity."""
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].file, kv[1].offsets)):
        bits = _FLOAT_BITS.get(info.dtype)
        if bits is None:
            continue
        view, mask = bits
        path = Path(model_dir) / info.file
        with os.fdopen(open_regular(path), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            start, end = 8 + length + info.offsets[0], 8 + length + info.offsets[1]
            width = np.dtype(view).itemsize
            if (end - start) % width:
                raise refused(422, f"{path}: tensor {name} has a size that is not a "
                                   f"multiple of its {info.dtype} element")
            f.seek(start)
            step = _CHUNK_BYTES - _CHUNK_BYTES % width
            for offset in range(start, end, step):
                chunk = np.frombuffer(f.read(min(step, end - offset)), dtype=view)
                if np.any((chunk & view(mask)) == view(mask)):
                    raise refused(422, f"tensor {name} holds NaN or infinite values "
                                       "(did the fine-tuning diverge?)")


def validate_checkpoint(ckpt_dir: Path, served: ModelFingerprint,
                        meta: CheckpointMeta | None = None) -> CheckpointMeta:
    """All the checks above, cheapest refusal first after integrity; returns the metadata.
    `meta` given: integrity was checked already (a snapshot, hashed as it was copied).
    Reads every byte of the checkpoint: the router runs it in a child process
    (`validate_proc`)."""
    ckpt_dir = Path(ckpt_dir)
    if meta is None:
        if not ckpt_dir.is_dir():
            raise refused(422, f"{ckpt_dir}: no such directory on the router's machine")
        try:
            meta = verify_checkpoint(ckpt_dir)
        except CheckpointError as exc:
            raise refused(422, str(exc)) from None
    kind = checkpoint_kind(meta)
    if kind == "lora":  # before any replica is touched: vLLM cannot hot-load an adapter
        raise adapter_as_weights(ckpt_dir)
    if kind != "full":
        raise refused(422, f"{ckpt_dir}: holds kind {kind!r} (see extra in {META_FILE}), "
                           "not full weights; this dpserve deploys only kind full")
    candidate = fingerprint(ckpt_dir)
    found = differences(served, candidate)
    if found:
        more = f" (and {len(found) - MAX_REPORTED} more)" if len(found) > MAX_REPORTED else ""
        raise refused(409, f"{ckpt_dir} does not match the served model: "
                           + "; ".join(found[:MAX_REPORTED]) + more)
    check_finite(ckpt_dir, candidate.tensors)
    return meta
