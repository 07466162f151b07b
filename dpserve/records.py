"""The JSONL records of fine-tuning data, read and checked without tokenizing them (no
torch, no transformers): what `dpserve finetune` trains on and what a deploy's quality
gate (`dpserve deploy --eval`) scores a checkpoint with. One example per line (blank
lines skipped, unknown keys ignored):

    {"prompt": "...", "completion": "..."}
    {"messages": [{"role": ..., "content": ...}]}     (at least one assistant turn)

Every problem is a `DataError` whose message starts with `FILE:LINE:`.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """Unusable training data. The message starts with `FILE:LINE:` for a bad line,
    or `FILE:` for a problem with the whole file."""


def read_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line, each validated."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
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
        _validate(record, where)
        records.append((number, record))
    if not records:
        raise DataError(f"{path}: no examples (the file is empty)")
    return records


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
