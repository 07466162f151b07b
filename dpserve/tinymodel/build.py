"""Build the bundled tiny Llama model: offline, deterministic, idempotent.

dpserve needs a model that any machine can serve and fine-tune without a
download: tests, the demo and CI run against it. The model is random-weight
and tiny (2 layers, hidden 128, ~0.6 M parameters), so its text is noise, but
its shapes, tokenizer and chat template exercise every path that a real
Llama does in vLLM, the router and the fine-tune loop.

Contract of a build directory (Hugging Face layout, loadable by vLLM and
``AutoTokenizer`` / ``AutoModelForCausalLM``)::

    config.json  generation_config.json  model.safetensors
    tokenizer.json  tokenizer_config.json  special_tokens_map.json
    .dpserve-tiny-model      <- written last; holds RECIPE_VERSION

A directory counts as built only when the marker holds the current
``RECIPE_VERSION``. The build happens in a staging directory beside the
target and is renamed into place, so a crash never leaves a directory that
looks complete. Two builds with the same library versions give byte-identical
files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

TINY_MODEL_NAME = "dpserve-tiny-llama"
"""The name the tiny model is served under (vLLM ``--served-model-name``)."""

RECIPE_VERSION = "dpserve-tiny-llama/1"
"""Bump whenever anything below changes the files; old builds are then rebuilt."""

MARKER_NAME = ".dpserve-tiny-model"

VOCAB_SIZE = 1024
# Fixed ids 0..6, Llama-style (bos=1, eos=2). The role tokens make every chat
# turn header one token, so the template costs little context.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")
UNK, BOS, EOS, PAD = SPECIAL_TOKENS[:4]
MAX_POSITIONS = 2048

# Each message is "<|role|>\ncontent</s>\n"; the model's turn ends with </s>,
# which is also eos, so generation stops at the end of the assistant's turn.
# vLLM renders chat prompts with add_special_tokens=False, hence the explicit bos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Head size = hidden / heads = 64: vLLM's CPU attention accepts only
# 32, 64, 80, 96, 112, 128, ... (16 fails at the first request).
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": MAX_POSITIONS,
}

# Bigger builds of the same recipe (same tokenizer), for measurements that need a
# model whose weights, not its activations, dominate memory: ~153M parameters.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": MODEL_SHAPE,
    "150m": {**MODEL_SHAPE, "hidden_size": 1024, "intermediate_size": 2816,
             "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 16},
}


def build_tiny_model(output_dir: Path, *, force: bool = False, size: str = "tiny") -> Path:
    """Build the tiny model (or a bigger `SIZES` shape) into ``output_dir`` and return its
    absolute path.

    Returns at once if ``output_dir`` already holds a build of this recipe,
    unless ``force``. An older recipe's build is replaced. A non-empty
    directory that is not a tiny-model build is never deleted without
    ``force`` (raises ``FileExistsError``): it may be someone's data.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    output_dir = Path(output_dir).absolute()
    if not force and is_built(output_dir, size=size):
        return output_dir
    if not force and _is_foreign(output_dir):
        raise FileExistsError(
            f"{output_dir} exists and is not a tiny-model build (no {MARKER_NAME});"
            " refusing to replace it without force"
        )
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.building-", dir=output_dir.parent))
    try:
        _write_model_files(staging, SIZES[size])
        (staging / MARKER_NAME).write_text(_marker(size) + "\n", encoding="utf-8")
        _publishable(staging)
        # A concurrent builder may have finished first; its files equal ours.
        if not force and is_built(output_dir, size=size):
            return output_dir
        _replace_dir(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename
    return output_dir


def is_built(model_dir: Path, *, size: str = "tiny") -> bool:
    """True if ``model_dir`` holds a complete build of the current recipe and size."""
    try:
        marker = (Path(model_dir) / MARKER_NAME).read_text(encoding="utf-8")
    except OSError:
        return False
    return marker.strip() == _marker(size)


def _marker(size: str) -> str:
    return RECIPE_VERSION if size == "tiny" else f"{RECIPE_VERSION} {size}"


def _is_foreign(path: Path) -> bool:
    """A non-empty directory (or a file) without our marker: not ours to delete."""
    if not path.exists():
        return False
    if not path.is_dir():
        return True
    return not (path / MARKER_NAME).exists() and any(path.iterdir())


def _replace_dir(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is moved aside, then deleted."""
    old = None
    if target.exists() or target.is_symlink():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        target.rename(old)
    try:
        staging.rename(target)
    except OSError:
        if old is not None and not target.exists():
            old.rename(target)  # put the previous build back
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def _publishable(root: Path) -> None:
    """World-readable modes and durable data before the rename publishes ``root``.

    mkdtemp makes the directory 0700 and safetensors writes 0600, which a
    vLLM running as another user (a container) could not read; fixed modes
    also keep builds identical whatever the umask.
    """
    root.chmod(0o755)
    for path in sorted(root.iterdir()):
        path.chmod(0o644)
        with path.open("rb") as f:
            os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_model_files(out: Path, shape: dict[str, Any]) -> None:
    tokenizer = _train_tokenizer(_read_corpus())
    _save_tokenizer(tokenizer, out)
    _save_model(out, vocab_size=tokenizer.get_vocab_size(), shape=shape)


def _read_corpus() -> str:
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def _train_tokenizer(corpus: str) -> Any:
    """Byte-level BPE: every byte string encodes (no <unk> in practice) and decodes back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    paragraphs = [p for p in corpus.split("\n\n") if p.strip()]
    tokenizer.train_from_iterator(paragraphs, trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # Like Llama: encode(text) starts with <s>; completions prompts get it from here.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    """Write the tokenizer as ``PreTrainedTokenizerFast`` files.

    The two small JSON files are written by hand rather than by
    ``save_pretrained``: transformers 5 would name its own backend class and
    drop special_tokens_map.json, which transformers 4 (used by some vLLM
    builds) cannot read. ``PreTrainedTokenizerFast`` loads in both.
    """
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": MAX_POSITIONS,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def _save_model(out: Path, *, vocab_size: int, shape: dict[str, Any]) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    # float32: vLLM's CPU backend runs it as is, and fp32 keeps logprobs
    # comparable across fine-tune and serving.
    config = LlamaConfig(
        vocab_size=vocab_size,
        **shape,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        tie_word_embeddings=False,
        dtype="float32",
    )
    with _seeded(0):
        model = LlamaForCausalLM(config).float()
    # Only token ids: vLLM would take any sampling field here as the
    # server's default and override what clients ask for.
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    with _quiet_progress_bars():
        model.save_pretrained(out, safe_serialization=True)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """No "Writing model shards" bar for a 2 MB file; restore the caller's setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch for the weight init without disturbing the caller's RNG state."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """``python -m dpserve.tinymodel.build --output DIR [--force]``; prints the model path."""
    parser = argparse.ArgumentParser(
        prog="python -m dpserve.tinymodel.build", description="Build the tiny Llama model."
    )
    parser.add_argument("--output", required=True, type=Path, help="directory to build into")
    parser.add_argument("--force", action="store_true", help="rebuild even if already built")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model shape")
    args = parser.parse_args(argv)
    try:
        print(build_tiny_model(args.output, force=args.force, size=args.size))
    except FileExistsError as exc:
        parser.error(str(exc))  # exits 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
