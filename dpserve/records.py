"""The JSONL records of fine-tuning data, read and checked without tokenizing them (no
torch, no transformers): what `dpserve finetune` trains on and what a deploy's quality
gate (`dpserve deploy --eval`) scores a checkpoint with. One example per line (blank
lines skipped, unknown keys ignored):

    {"prompt": "...", "completion": "..."}
    {"messages": [{"role": ..., "content": ...}]}     (at least one assistant turn)

Data is read from regular files only: a file is opened without blocking and its type
is checked on the open descriptor, so a FIFO, device or directory named as data is a
`DataError` at once, never a reader stuck in `open` or `read` (a deploy's eval file is
named by an admin request: `dpserve.rollout.quality`).

Every problem is a `DataError` whose message starts with `FILE:LINE:`.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class DataError(ValueError):
    """Unusable training data. The message starts with `FILE:LINE:` for a bad line,
    or `FILE:` for a problem with the whole file."""


def read_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line of the regular file `path`, each
    validated. A symbolic link to one is followed and the size is not capped: training
    data is named by its own user, on its own machine, and may be large."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise open_error(path, exc) from None
    return parse_records(read_regular(fd, path), path)


def open_error(path: Path, exc: OSError) -> DataError:
    """The DataError for a failed open(2) of data file `path`."""
    if exc.errno == errno.ENOENT:
        return DataError(f"{path}: no such file")
    if exc.errno == errno.ENXIO:  # a socket, or a device with no driver behind it
        return DataError(f"{path}: not a regular file; data is read from regular files only")
    return DataError(f"{path}: cannot read ({exc.strerror})")


def read_regular(fd: int, path: Path, *, max_bytes: int | None = None) -> bytes:
    """The bytes of `fd`, a descriptor of data file `path`, which it closes: DataError
    unless it is a regular file (checked on the descriptor, so on what is read) of at
    most `max_bytes` (checked on its size first: a huge sparse file costs no read)."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _KINDS if test(info.st_mode)), "a special file")
            raise DataError(f"{path}: {kind}, not a regular file; data is read from regular "
                            "files only")
        if max_bytes is not None and info.st_size > max_bytes:
            raise DataError(f"{path}: {info.st_size} bytes, larger than the "
                            f"{_size(max_bytes)} this reads")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        try:  # one byte past the cap: a file still growing is caught too
            raw = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    if max_bytes is not None and len(raw) > max_bytes:
        raise DataError(f"{path}: larger than the {_size(max_bytes)} this reads")
    return raw


def parse_records(raw: bytes, path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line of `raw`, the bytes of `path`,
    each validated; DataError naming `FILE:LINE` for the first bad one."""
    records = []
    # Split on "\n" only: str.splitlines would also split inside JSON strings at
    # U+2028 and the like, and the line numbers would disagree with an editor's.
    for number, data in enumerate(raw.removeprefix(codecs.BOM_UTF8).split(b"\n"), start=1):
        where = f"{path}:{number}"
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg}: line {exc.lineno} "
                            f"column {exc.colno})") from None
        except RecursionError:
            raise DataError(f"{where}: not valid JSON (nested too deeply)") from None
        _validate(record, where)
        records.append((number, record))
    if not records:
        raise DataError(f"{path}: no examples (the file is empty)")
    return records


def _size(n: int) -> str:
    mib = 1024 * 1024
    return f"{n // mib} MiB" if n % mib == 0 else f"{n} bytes"


def _validate(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    chat = "messages" in record
    if chat == ("prompt" in record or "completion" in record):
        raise DataError(f'{where}: expected either "prompt"+"completion" or "messages"'
                        + (", not both" if chat else ""))
    if not chat:
        if not isinstance(record.get("prompt"), str):
            raise DataError(f'{where}: "prompt" must be a string')
        if not isinstance(record.get("completion"), str) or not record["completion"]:
            raise DataError(f'{where}: "completion" must be a non-empty string')
        return
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: messages[{i}] must be an object")
        if message.get("role") not in ROLES:
            raise DataError(f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: messages[{i}].content must be a string")
    if messages[0]["role"] == "assistant":
        # Nothing to render as its prompt: chat templates refuse an empty conversation.
        raise DataError(f"{where}: messages[0] must be a system or user message")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message, so nothing to learn")
