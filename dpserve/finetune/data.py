"""Training data: JSONL in, token ids and loss labels out.

One example per line, either

    {"prompt": "...", "completion": "..."}          loss on the completion and its eos
    {"messages": [{"role": ..., "content": ...}]}   chat template; loss on assistant turns

Labels follow the Hugging Face causal-LM convention: `labels[i] == input_ids[i]`
where the token is learned, -100 elsewhere (the model shifts). Every line is
validated before anything is tokenized, and an error names `FILE:LINE`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

IGNORE = -100
ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """Unusable training data; the message starts with `FILE:LINE:` where it can."""


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]


@dataclass(frozen=True)
class DataStats:
    examples: int
    skipped_empty: int
    """Examples whose learned tokens were all cut by max_seq_len."""
    truncated: int
    tokens: int
    loss_tokens: int


def read_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line, each one validated."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{path}:{number}: not valid JSON ({exc})") from None
        _validate(record, f"{path}:{number}")
        records.append((number, record))
    if not records:
        raise DataError(f"{path}: no examples (the file is empty)")
    return records


def _validate(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: \"messages\" must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise DataError(f"{where}: messages[{i}] must be an object")
            if m.get("role") not in ROLES:
                raise DataError(f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}")
            if not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{i}].content must be a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message, so nothing to learn")
        return
    if "prompt" in record or "completion" in record:
        if not isinstance(record.get("prompt"), str):
            raise DataError(f"{where}: \"prompt\" must be a string")
        if not isinstance(record.get("completion"), str) or not record["completion"]:
            raise DataError(f"{where}: \"completion\" must be a non-empty string")
        return
    raise DataError(f"{where}: expected either \"prompt\"+\"completion\" or \"messages\"")


def encode(record: dict[str, Any], tokenizer: Any, where: str) -> Example:
    if "messages" in record:
        return _encode_chat(record["messages"], tokenizer, where)
    prompt = tokenizer(record["prompt"]).input_ids  # with the tokenizer's bos, if any
    completion = tokenizer(record["completion"], add_special_tokens=False).input_ids
    completion = [*completion, tokenizer.eos_token_id]
    return Example(prompt + completion, [IGNORE] * len(prompt) + completion)


def _encode_chat(messages: list[dict[str, str]], tokenizer: Any, where: str) -> Example:
    """Render the conversation turn by turn; learn only what the assistant says.

    Each assistant turn is the difference between the conversation rendered up to
    it (with the generation prompt) and rendered through it; the template must be
    prefix-stable for that to hold, which is checked.
    """
    def render(msgs: list[dict[str, str]], generation_prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=generation_prompt))

    ids: list[int] = []
    labels: list[int] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = render(messages[:i], True)
        full = render(messages[: i + 1], False)
        if not head.startswith(done) or not full.startswith(head):
            raise DataError(f"{where}: the chat template does not render turns as a prefix "
                            "of the conversation; cannot tell assistant tokens apart")
        context = tokenizer(head[len(done):], add_special_tokens=False).input_ids
        turn = tokenizer(full[len(head):], add_special_tokens=False).input_ids
        # Learn the reply through its end-of-turn token, not the template's filler after it.
        end = turn.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in turn else len(
            turn)
        ids += context + turn
        labels += [IGNORE] * len(context) + turn[:end] + [IGNORE] * (len(turn) - end)
        done = full
    return Example(ids, labels)


def load_dataset(path: Path, tokenizer: Any, *, max_seq_len: int) -> tuple[list[Example],
                                                                          DataStats]:
    records = read_records(Path(path))
    examples: list[Example] = []
    skipped = truncated = 0
    for number, record in records:
        ex = encode(record, tokenizer, f"{path}:{number}")
        if len(ex.input_ids) > max_seq_len:
            truncated += 1
            ex = Example(ex.input_ids[:max_seq_len], ex.labels[:max_seq_len])
        if sum(1 for label in ex.labels[1:] if label != IGNORE) == 0:
            skipped += 1  # nothing left to learn after truncation
            continue
        examples.append(ex)
    if not examples:
        raise DataError(f"{path}: no example keeps a learned token within max_seq_len "
                        f"{max_seq_len}")
    stats = DataStats(
        examples=len(examples), skipped_empty=skipped, truncated=truncated,
        tokens=sum(len(e.input_ids) for e in examples),
        loss_tokens=sum(sum(1 for label in e.labels[1:] if label != IGNORE) for e in examples),
    )
    return examples, stats


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: ids with `pad_id`, labels with -100, mask 0."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class ExampleDataset(Dataset[Example]):
    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]
