from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpserve.finetune.data import IGNORE, DataError, Example, collate, load_dataset


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def jsonl(tmp_path: Path, *records: object, raw: str = "") -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + raw)
    return path


def learned(tokenizer, ex: Example) -> str:
    return tokenizer.decode([t for t, label in zip(ex.input_ids, ex.labels, strict=True)
                             if label != IGNORE])


def test_prompt_completion_learns_only_the_completion_and_its_end(tokenizer, tmp_path):
    (ex,), stats = load_dataset(jsonl(tmp_path, {"prompt": "Question:", "completion":
                                                 " the answer"}), tokenizer, max_seq_len=64)
    assert learned(tokenizer, ex) == " the answer" + tokenizer.eos_token
    assert ex.input_ids[0] == tokenizer.bos_token_id
    assert ex.labels[: len(tokenizer("Question:").input_ids)] == [IGNORE] * len(
        tokenizer("Question:").input_ids)
    assert stats.loss_tokens == sum(1 for label in ex.labels if label != IGNORE)


def test_chat_learns_only_what_the_assistant_says(tokenizer, tmp_path):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "And the sea?"},
                {"role": "assistant", "content": "It is wide."}]
    (ex,), _ = load_dataset(jsonl(tmp_path, {"messages": messages}), tokenizer, max_seq_len=256)
    eos = tokenizer.eos_token
    assert learned(tokenizer, ex) == f"Hello.{eos}It is wide.{eos}"
    # The whole conversation is exactly what the chat template renders.
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ex.input_ids == tokenizer(rendered, add_special_tokens=False).input_ids


def test_long_examples_are_truncated_and_empty_ones_skipped(tokenizer, tmp_path):
    path = jsonl(tmp_path, {"prompt": "word " * 50, "completion": " end"},
                 {"prompt": "Short:", "completion": " reply " * 20})
    examples, stats = load_dataset(path, tokenizer, max_seq_len=16)
    assert (stats.examples, stats.skipped_empty, stats.truncated) == (1, 1, 2)
    assert len(examples[0].input_ids) == 16
    with pytest.raises(DataError, match="no example keeps a learned token"):
        load_dataset(jsonl(tmp_path, {"prompt": "word " * 50, "completion": " end"}),
                     tokenizer, max_seq_len=16)


GOOD = {"prompt": "a", "completion": " b"}


@pytest.mark.parametrize(("bad", "message"), [
    ('{"prompt": "a", ', "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"text": "a"}', 'expected either "prompt"+"completion" or "messages"'),
    ('{"prompt": "a", "completion": ""}', '"completion" must be a non-empty string'),
    ('{"prompt": 3, "completion": "b"}', '"prompt" must be a string'),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role must be one of"),
    ('{"messages": [{"role": "user", "content": 1}]}', "messages[0].content must be a string"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
])
def test_a_malformed_line_is_reported_with_file_and_line(tokenizer, tmp_path, bad, message):
    path = jsonl(tmp_path, GOOD, GOOD, raw="\n" + bad + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(DataError) as exc:
        load_dataset(path, tokenizer, max_seq_len=64)
    assert str(exc.value).startswith(f"{path}:4: ")  # blank line 3 is skipped, still counted
    assert message in str(exc.value)


def test_missing_and_empty_files_are_clear_errors(tokenizer, tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_dataset(tmp_path / "nope.jsonl", tokenizer, max_seq_len=8)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no examples"):
        load_dataset(tmp_path / "empty.jsonl", tokenizer, max_seq_len=8)


def test_collate_pads_right_and_masks_padding():
    batch = collate([Example([1, 5, 6], [IGNORE, 5, 6]), Example([1, 7], [IGNORE, 7])], pad_id=3)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 5, 6], [IGNORE, 7, IGNORE]]
    assert batch["input_ids"].dtype == torch.long
