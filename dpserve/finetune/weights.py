"""Writing the served half of a checkpoint: weights in the base model's dtype,
the base model's config and tokenizer files unchanged.

Fine-tuning changes weights only. Copying config and tokenizer byte for byte
from the base model keeps the checkpoint loadable into a running vLLM that
serves the base (same architecture, same tokenizer), which the rolling deploy
verifies before it touches a replica.

Weights are written the way Hugging Face shards them: `model.safetensors` when
they fit one file, else `model-0000i-of-0000N.safetensors` of at most
`MAX_SHARD_BYTES` each plus `model.safetensors.index.json`. The files are planned
from the tensors' shapes first, then filled one file at a time from a stream of
tensors, so the writer holds at most one file's worth (under fsdp the stream
gathers one tensor at a time).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

MAX_SHARD_BYTES = 5 * 1024**3
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Files that describe the model rather than its weights, copied from a local base.
_CONFIG_FILES = ("config.json", "generation_config.json")
_TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt",
                    "*.tiktoken", "chat_template*", "added_tokens.json")


def plan_files(sizes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
               max_bytes: int = MAX_SHARD_BYTES) -> dict[str, str]:
    """Tensor name -> file name, in order, starting a new file when the next tensor
    would push the current one past `max_bytes` (a tensor larger than that gets a
    file of its own)."""
    item = torch.empty((), dtype=dtype).element_size()
    groups: list[list[str]] = [[]]
    used = 0
    for name, shape in sizes:
        nbytes = item * int(torch.Size(shape).numel())
        if groups[-1] and used + nbytes > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    if len(groups) == 1:
        return dict.fromkeys(groups[0], SINGLE_FILE)
    n = len(groups)
    return {name: f"model-{i:05d}-of-{n:05d}.safetensors"
            for i, group in enumerate(groups, 1) for name in group}


def write_weights(out_dir: Path, files: dict[str, str],
                  tensors: Iterable[tuple[str, torch.Tensor | None]], dtype: torch.dtype,
                  *, write: bool) -> None:
    """Consume `tensors` (in `files`' order) and, when `write`, fill the planned files
    in `dtype`. Ranks that do not write must still consume the stream (it may gather)."""
    pending: dict[str, torch.Tensor] = {}
    current: str | None = None
    total = 0
    for name, tensor in tensors:
        target = files[name]
        if write and current is not None and target != current:
            save_file(pending, str(out_dir / current), metadata={"format": "pt"})
            pending = {}
        current = target
        if write:
            assert tensor is not None
            pending[name] = tensor.to(dtype=dtype).contiguous()
            total += pending[name].numel() * pending[name].element_size()
    if not write:
        return
    if current is not None:
        save_file(pending, str(out_dir / current), metadata={"format": "pt"})
    if set(files.values()) != {SINGLE_FILE}:
        index = {"metadata": {"total_size": total}, "weight_map": files}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_config(model: torch.nn.Module, out_dir: Path, dtype: torch.dtype) -> None:
    """The model's config, saying the tensors are stored in `dtype`."""
    config: Any = model.config
    previous = config.dtype
    config.dtype = dtype
    try:
        config.save_pretrained(out_dir)
    finally:
        config.dtype = previous


def copy_tokenizer_files(base_model: str, out_dir: Path, tokenizer: Any) -> None:
    """Tokenizer (and config) files from a local base model, else the tokenizer's own save."""
    base = Path(base_model)
    if not base.is_dir():
        tokenizer.save_pretrained(out_dir)
        return
    for name in _CONFIG_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out_dir / name)
    for pattern in _TOKENIZER_GLOBS:
        for f in base.glob(pattern):
            if f.is_file():
                shutil.copyfile(f, out_dir / f.name)


def save_weights(model: torch.nn.Module, out_dir: Path, dtype: torch.dtype) -> None:
    """A plain (unsharded, unwrapped) model's weights and config into `out_dir`."""
    from dpserve.finetune.strategy import full_tensors, tensor_sizes

    files = plan_files(tensor_sizes(model), dtype)
    write_weights(out_dir, files, full_tensors(model, master=True), dtype, write=True)
    write_config(model, out_dir, dtype)
