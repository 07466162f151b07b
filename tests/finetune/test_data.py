from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dpserve.finetune.data import (
    IGNORE_INDEX,
    DataError,
    Example,
    ExampleDataset,
    collate,
    load_dataset,
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "And the sea?"},
    {"role": "assistant", "content": "It is wide."},
]
GOOD = {"prompt": "a", "completion": " b"}


def _load_tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return _load_tokenizer(tiny_model)


def jsonl(tmp_path: Path, *records: object, raw: str = "") -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + raw, encoding="utf-8")
    return path


def learned(tokenizer: Any, ex: Example) -> str:
    return tokenizer.decode([t for t, label in zip(ex.input_ids, ex.labels, strict=True)
                             if label != IGNORE_INDEX])


def test_prompt_completion_learns_only_the_completion_and_its_eos(tokenizer, tmp_path):
    (ex,), stats = load_dataset(jsonl(tmp_path, {"prompt": "Question:", "completion":
                                                 " the answer"}), tokenizer, max_seq_len=64)
    prompt = tokenizer("Question:").input_ids  # as a completions request encodes it: with bos
    completion = tokenizer(" the answer", add_special_tokens=False).input_ids
    assert prompt[0] == tokenizer.bos_token_id
    assert ex.input_ids == [*prompt, *completion, tokenizer.eos_token_id]
    assert ex.labels == [IGNORE_INDEX] * len(prompt) + [*completion, tokenizer.eos_token_id]
    assert learned(tokenizer, ex) == " the answer" + tokenizer.eos_token
    assert (stats.tokens, stats.loss_tokens) == (len(ex.input_ids), len(completion) + 1)


def test_prompt_gets_no_bos_when_the_tokenizer_adds_none(tiny_model, tmp_path):
    from tokenizers import processors

    tokenizer = _load_tokenizer(tiny_model)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A", pair="$A $B")
    (ex,), _ = load_dataset(jsonl(tmp_path, GOOD), tokenizer, max_seq_len=64)
    assert tokenizer.bos_token_id not in ex.input_ids
    assert ex.input_ids == [*tokenizer("a").input_ids, *tokenizer(" b").input_ids,
                            tokenizer.eos_token_id]


def test_chat_learns_only_the_assistant_contents_and_their_eos(tokenizer, tmp_path):
    (ex,), stats = load_dataset(jsonl(tmp_path, {"messages": CONVERSATION}), tokenizer,
                                max_seq_len=256)
    eos = tokenizer.eos_token
    assert learned(tokenizer, ex) == f"Hello.{eos}It is wide.{eos}"
    # The whole conversation is what vLLM's chat endpoint would render and encode.
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert ex.input_ids == tokenizer(rendered, add_special_tokens=False).input_ids
    assert stats.loss_tokens == sum(label != IGNORE_INDEX for label in ex.labels)


def test_chat_drops_messages_after_the_last_assistant_turn(tokenizer, tmp_path):
    (ex,), _ = load_dataset(
        jsonl(tmp_path, {"messages": [*CONVERSATION, {"role": "user", "content": "Bye"}]}),
        tokenizer, max_seq_len=256)
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert ex.input_ids == tokenizer(rendered, add_special_tokens=False).input_ids


@pytest.mark.parametrize(("template", "message"), [
    ("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
     "not prefix-stable at messages[2]"),
    ("{{ raise_exception('roles must alternate') }}",
     "the chat template rejected this conversation: roles must alternate"),
])
def test_a_template_that_cannot_be_split_into_turns_is_a_clear_error(
        tiny_model, tmp_path, template, message):
    tokenizer = _load_tokenizer(tiny_model)
    tokenizer.chat_template = template
    path = jsonl(tmp_path, GOOD, {"messages": CONVERSATION})
    with pytest.raises(DataError, match=r"^" + str(path) + ":2: ") as exc:
        load_dataset(path, tokenizer, max_seq_len=256)
    assert message in str(exc.value)


def test_long_examples_are_truncated_and_ones_left_without_loss_are_skipped(
        tokenizer, tmp_path):
    long_prompt = {"prompt": "word " * 50, "completion": " end"}
    long_completion = {"prompt": "Short:", "completion": " reply" * 20}
    examples, stats = load_dataset(jsonl(tmp_path, long_prompt, long_completion, GOOD),
                                   tokenizer, max_seq_len=16)
    assert (stats.examples, stats.skipped_empty, stats.truncated) == (2, 1, 1)
    cut, whole = examples
    full = tokenizer("Short:").input_ids + tokenizer(" reply" * 20,
                                                     add_special_tokens=False).input_ids
    assert cut.input_ids == full[:16]
    assert learned(tokenizer, cut).startswith(" reply reply")
    assert whole.input_ids[-1] == tokenizer.eos_token_id


def test_a_truncated_conversation_keeps_the_replies_that_fit(tokenizer, tmp_path):
    (whole,), _ = load_dataset(jsonl(tmp_path, {"messages": CONVERSATION}), tokenizer,
                               max_seq_len=256)
    second_reply = whole.labels.index(IGNORE_INDEX, whole.labels.index(
        tokenizer.eos_token_id)) + 3  # just inside the second user turn
    (cut,), stats = load_dataset(jsonl(tmp_path, {"messages": CONVERSATION}), tokenizer,
                                 max_seq_len=second_reply)
    assert stats.truncated == 1
    assert learned(tokenizer, cut) == f"Hello.{tokenizer.eos_token}"


def test_all_examples_without_loss_after_truncation_is_an_error(tokenizer, tmp_path):
    path = jsonl(tmp_path, {"prompt": "word " * 50, "completion": " end"})
    with pytest.raises(DataError, match=r"no example keeps a learned token within max_seq_len 16"):
        load_dataset(path, tokenizer, max_seq_len=16)


def _bad(messages: list[dict[str, Any]]) -> str:
    return json.dumps({"messages": messages})


@pytest.mark.parametrize(("bad", "message"), [
    ('{"prompt": "a", ', "not valid JSON (Expecting property name enclosed in double quotes:"
                         " line 1 column 17)"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"text": "a"}', 'expected either "prompt"+"completion" or "messages"'),
    ('{"prompt": "a", "completion": "b", "messages": []}', 'or "messages", not both'),
    ('{"prompt": "a", "completion": ""}', '"completion" must be a non-empty string'),
    ('{"prompt": "a"}', '"completion" must be a non-empty string'),
    ('{"prompt": 3, "completion": "b"}', '"prompt" must be a string'),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": "hi"}', '"messages" must be a non-empty list'),
    (_bad(["hi"]), "messages[0] must be an object"),
    (_bad([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
           {"role": "robot", "content": "z"}]),
     "messages[2].role must be one of system, user, assistant"),
    (_bad([{"role": "user", "content": 1}]), "messages[0].content must be a string"),
    (_bad([{"role": "assistant", "content": "x"}]), "messages[0] must be a system or user"),
    (_bad([{"role": "user", "content": "x"}]), "no assistant message"),
])
def test_a_malformed_line_late_in_the_file_is_reported_with_file_and_line(
        tokenizer, tmp_path, bad, message):
    path = jsonl(tmp_path, GOOD, {"messages": CONVERSATION},
                 raw="\n" + bad + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(DataError) as exc:
        load_dataset(path, tokenizer, max_seq_len=64)
    assert str(exc.value).startswith(f"{path}:4: ")  # blank line 3 is skipped, still counted
    assert message in str(exc.value)


def test_unknown_keys_blank_lines_and_a_byte_order_mark_are_fine(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({**GOOD, "id": 7}).encode() + b"\r\n\n  \n"
                     + json.dumps({"messages": CONVERSATION, "source": "x"}).encode())
    examples, _ = load_dataset(path, tokenizer, max_seq_len=64)
    assert len(examples) == 2


def test_a_line_that_is_not_utf8_is_reported_with_its_line(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b'\n{"prompt": "\xff", "completion": "b"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:2: not UTF-8"):
        load_dataset(path, tokenizer, max_seq_len=64)


def test_missing_and_empty_files_are_errors_naming_the_file(tokenizer, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"^{missing}: no such file"):
        load_dataset(missing, tokenizer, max_seq_len=8)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=f"^{empty}: no examples"):
        load_dataset(empty, tokenizer, max_seq_len=8)


def test_collate_pads_right_and_masks_padding_out_of_attention_and_loss():
    examples = [Example([1, 5, 6], [IGNORE_INDEX, 5, 6]), Example([1, 7], [IGNORE_INDEX, 7])]
    batch = collate(examples, pad_id=3)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 5, 6], [IGNORE_INDEX, 7, IGNORE_INDEX]]
    assert {t.dtype for t in batch.values()} == {torch.long}


def test_a_dataset_of_examples_batches_through_a_distributed_sampler():
    from functools import partial

    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    dataset = ExampleDataset([Example([1, i], [IGNORE_INDEX, i]) for i in range(10, 14)])
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler,
                        collate_fn=partial(collate, pad_id=3))
    (batch,) = list(loader)
    assert batch["input_ids"].tolist() == [[1, 11], [1, 13]]
