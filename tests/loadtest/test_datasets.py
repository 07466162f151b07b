import hashlib
import json

import pytest

from loadtest.datasets import (
    Prompt,
    count_tokens,
    jsonl_prompts,
    load_tokenizer,
    random_prompts,
    sharegpt_prompts,
)
from loadtest.errors import DatasetError


def test_random_prompts_equal_vllms_random_dataset(tokenizer):
    """Reference values from vllm.benchmarks.datasets.RandomDataset (vLLM 0.32) on the
    tiny model's tokenizer, seed 0, 20 requests, input 32, output 8, range ratio 0.5,
    prefix 4: same prompt texts, prompt lengths and output lengths."""
    prompts = random_prompts(tokenizer, num_prompts=20, input_len=32, output_len=8,
                             range_ratio=0.5, prefix_len=4, seed=0)
    assert [p.prompt_len for p in prompts[:6]] == [47, 40, 35, 28, 29, 20]
    assert [p.output_len for p in prompts[:6]] == [6, 11, 10, 4, 7, 11]
    digest = hashlib.sha256("\x00".join(p.text for p in prompts).encode()).hexdigest()
    assert digest.startswith("292a0b1add18e06c")


def test_random_prompts_have_the_asked_lengths_counted_by_the_models_tokenizer(tokenizer):
    prompts = random_prompts(tokenizer, num_prompts=30, input_len=64, output_len=16, seed=0)
    assert {p.output_len for p in prompts} == {16}
    # 63 text tokens + the BOS the server adds = 64; a decode/encode round trip may
    # leave a prompt a token off, as in vLLM.
    exact = [count_tokens(tokenizer, p.text) == 64 for p in prompts]
    assert sum(exact) >= 25
    assert all(count_tokens(tokenizer, p.text) == p.prompt_len + 1 for p in prompts)


def test_random_prompts_are_reproducible_from_the_seed(tokenizer):
    def make(seed):
        return random_prompts(tokenizer, num_prompts=5, input_len=20, output_len=4,
                              range_ratio=0.5, seed=seed)
    assert make(1) == make(1)
    assert make(1) != make(2)


def test_range_ratio_spreads_lengths_within_bounds(tokenizer):
    prompts = random_prompts(tokenizer, num_prompts=200, input_len=40, output_len=20,
                             range_ratio=0.5, seed=0)
    outputs = {p.output_len for p in prompts}
    assert min(outputs) >= 10 and max(outputs) <= 30 and len(outputs) > 10


def test_a_shared_prefix_starts_every_random_prompt(tokenizer):
    prompts = random_prompts(tokenizer, num_prompts=10, input_len=40, output_len=5,
                             prefix_len=8, seed=1)
    starts = {tuple(tokenizer.encode(p.text, add_special_tokens=False)[:8]) for p in prompts}
    assert len(starts) == 1
    assert len({p.text for p in prompts}) == 10


def test_random_prompts_refuse_a_bad_range_ratio(tokenizer):
    with pytest.raises(DatasetError, match="range-ratio"):
        random_prompts(tokenizer, num_prompts=1, input_len=8, output_len=1, range_ratio=1.0)


def conversation(prompt, answer, *, turns=2):
    return {"conversations": [{"from": "human", "value": prompt},
                              {"from": "gpt", "value": answer}][:turns]}


@pytest.fixture
def sharegpt_file(tmp_path):
    long = "word " * 1100
    data = [
        conversation("tell me a story about a fox please", "once upon a time a fox ran"),
        conversation("only one turn here for sure", "", turns=1),          # < 2 turns
        conversation("a", "a fine long answer with many words"),            # prompt < 4
        conversation("what is the capital of france then", "no"),           # output < 4
        conversation(long, "an answer that is long enough"),                 # prompt > 1024
        conversation("why is the sky blue during the day", "because of rayleigh scattering"),
        {"id": "no conversations at all"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_keeps_only_pairs_vllm_keeps(tokenizer, sharegpt_file):
    prompts = sharegpt_prompts(sharegpt_file, tokenizer, num_prompts=2, seed=0)
    assert sorted(p.text for p in prompts) == ["tell me a story about a fox please",
                                               "why is the sky blue during the day"]
    fox = next(p for p in prompts if "fox" in p.text)
    assert fox.prompt_len == count_tokens(tokenizer, fox.text)
    assert fox.output_len == count_tokens(tokenizer, "once upon a time a fox ran")


def test_sharegpt_with_a_fixed_output_length_skips_no_short_answers(tokenizer, sharegpt_file):
    prompts = sharegpt_prompts(sharegpt_file, tokenizer, num_prompts=3, output_len=12, seed=0)
    assert any("capital of france" in p.text for p in prompts)
    assert {p.output_len for p in prompts} == {12}


def test_a_small_file_is_oversampled_reproducibly(tokenizer, sharegpt_file):
    a = sharegpt_prompts(sharegpt_file, tokenizer, num_prompts=7, seed=4)
    assert len(a) == 7 and len({p.text for p in a}) == 2
    assert a == sharegpt_prompts(sharegpt_file, tokenizer, num_prompts=7, seed=4)


def test_jsonl_prompts_take_output_tokens_per_line_or_the_override(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one", "output_tokens": 5}\n\n{"prompt": "two"}\n')
    by_text = {p.text: p for p in jsonl_prompts(path, num_prompts=2, shuffle=False)}
    assert by_text == {"one": Prompt("one", 0, 5), "two": Prompt("two", 0, 256)}
    fixed = jsonl_prompts(path, num_prompts=2, output_len=9)
    assert {p.output_len for p in fixed} == {9}


def test_jsonl_prompts_are_counted_with_a_tokenizer(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "the quick brown fox"}\n')
    [p] = jsonl_prompts(path, num_prompts=1, tokenizer=tokenizer)
    assert p.prompt_len == count_tokens(tokenizer, "the quick brown fox")


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "ok"}\nnot json\n', "prompts.jsonl:2: not JSON"),
    ('{"text": "no prompt key"}\n', 'prompts.jsonl:1: expected an object with a "prompt"'),
    ('{"prompt": "x", "output_tokens": 0}\n', "output_tokens must be a positive integer"),
    ("\n", "no usable prompts"),
])
def test_a_bad_jsonl_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        jsonl_prompts(path, num_prompts=1)


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="No such file"):
        jsonl_prompts(tmp_path / "absent.jsonl", num_prompts=1)


def test_a_tokenizer_must_be_a_local_directory(tmp_path):
    with pytest.raises(DatasetError, match="not a directory"):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(DatasetError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)
