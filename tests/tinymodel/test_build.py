"""The tiny model builder: deterministic, idempotent, and shaped the way vLLM's CPU backend needs.

Two real builds are shared by the module (a build takes a few seconds, mostly
importing torch). Tests of the directory-replacement rules swap the heavy
writer for a fake one that writes a single file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from dpserve.tinymodel import TINY_MODEL_NAME, build_tiny_model
from dpserve.tinymodel import build as build_module

VLLM_CPU_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256}
EXPECTED_FILES = {
    ".dpserve-tiny-model",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def file_hashes(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(root / "a"), build_tiny_model(root / "b")


@pytest.fixture(scope="module")
def model_dir(builds: tuple[Path, Path]) -> Path:
    return builds[0]


@pytest.fixture
def fake_writer(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the real (slow) model writer by a fake; records where it wrote."""
    calls: list[Path] = []

    def fake_model_files(out: Path, shape: object) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(build_module, "_write_model_files", fake_model_files)
    return calls


def test_served_name_is_stable() -> None:
    assert TINY_MODEL_NAME == "dpserve-tiny-llama"


def test_two_builds_are_byte_identical(builds: tuple[Path, Path]) -> None:
    a, b = builds
    assert set(file_hashes(a)) == EXPECTED_FILES
    assert file_hashes(a) == file_hashes(b)


def test_build_is_readable_by_other_users(model_dir: Path) -> None:
    assert model_dir.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in model_dir.iterdir()} == {0o644}


def test_head_size_is_one_vllm_cpu_accepts(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] in VLLM_CPU_HEAD_SIZES
    assert config["tie_word_embeddings"] is False


def test_model_and_tokenizer_agree_on_vocab_and_special_ids(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert config["vocab_size"] == len(tokenizer) == 1024
    assert (config["bos_token_id"], config["eos_token_id"]) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )


def test_tokenizer_round_trips_text(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "Once upon a time, a café sold 12 loaves of bread.\n  Tabs\tand emoji 🍞 too!"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders_a_generation_prompt(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nBe brief.</s>\n<|user|>\nHello!</s>\n<|assistant|>\n"
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("<|assistant|>\n")
    # Role headers are single tokens.
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    assert ids[-2] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_second_build_without_force_is_a_noop(model_dir: Path, fake_writer: list[Path]) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert build_tiny_model(model_dir) == model_dir
    assert fake_writer == []
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_force_rebuilds_even_a_complete_build(tmp_path: Path, fake_writer: list[Path]) -> None:
    out = build_tiny_model(tmp_path / "m")
    build_tiny_model(out, force=True)
    assert len(fake_writer) == 2
    assert sorted(p.name for p in out.iterdir()) == [".dpserve-tiny-model", "config.json"]


def test_build_of_an_older_recipe_is_replaced(tmp_path: Path, fake_writer: list[Path]) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / ".dpserve-tiny-model").write_text("dpserve-tiny-llama/0\n")
    (out / "stale.bin").write_text("old")
    build_tiny_model(out)
    assert len(fake_writer) == 1
    assert not (out / "stale.bin").exists()


def test_refuses_to_replace_a_directory_it_did_not_build(
    tmp_path: Path, fake_writer: list[Path]
) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_model(out)
    assert (out / "notes.txt").read_text() == "keep me"
    assert fake_writer == []


def test_crashed_build_leaves_nothing_that_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(out: Path, shape: object) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(build_module, "_write_model_files", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        build_tiny_model(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_a_bigger_size_is_another_build_of_the_same_recipe(tmp_path: Path,
                                                           fake_writer: list[Path]) -> None:
    """`--size 150m` (for memory benchmarks) is not mistaken for the tiny build, nor the
    tiny build for it."""
    build_tiny_model(tmp_path / "m")
    assert build_module.is_built(tmp_path / "m") and not build_module.is_built(
        tmp_path / "m", size="150m")
    build_tiny_model(tmp_path / "m", size="150m")
    assert len(fake_writer) == 2 and build_module.is_built(tmp_path / "m", size="150m")
    with pytest.raises(ValueError, match="size must be one of tiny, 150m"):
        build_tiny_model(tmp_path / "m", size="7b")
