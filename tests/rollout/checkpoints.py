"""Checkpoints of the tiny model for rollout tests, written with the real checkpoint
writer: a fine-tune-like perturbation of the weights, or a deliberately broken variant
(other shapes, dtype, vocabulary, NaN...) made by editing a copy of the tensors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dpserve import checkpoint as ckpt

Tensors = dict[str, torch.Tensor]


def perturbed(scale: float, seed: int) -> Callable[[Tensors], Tensors]:
    """Every weight moved by Gaussian noise: different outputs, same layout."""
    def edit(tensors: Tensors) -> Tensors:
        g = torch.Generator().manual_seed(seed)
        return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)
                for k, v in tensors.items()}
    return edit


def write_variant(base: Path, output: Path, step: int, *,
                  tensors: Callable[[Tensors], Tensors] | None = None,
                  files: Callable[[Path], None] | None = None) -> Path:
    """Publish `output/step-NNNNNN`: the base model's files, its tensors passed through
    `tensors`, then `files(dir)` for any other edit (config, tokenizer)."""
    def fill(tmp: Path) -> None:
        for f in base.iterdir():
            if f.is_file() and not f.name.startswith(".") and f.name != ckpt.META_FILE:
                shutil.copyfile(f, tmp / f.name)
        if tensors is not None:
            edited = tensors(load_file(str(base / "model.safetensors")))
            save_file({k: v.contiguous() for k, v in edited.items()},
                      str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if files is not None:
            files(tmp)

    return ckpt.write_checkpoint(output, step, fill, base_model=str(base), loss=1.0,
                                 world_size=1)


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


def other_vocabulary(tmp: Path) -> None:
    """Same vocabulary size, one token spelled differently: ids now mean other text."""
    def change(tok: dict) -> None:
        vocab = tok["model"]["vocab"]
        name = next(k for k, v in vocab.items() if v == 100)
        vocab[name + "x"] = vocab.pop(name)
    edit_json(tmp / "tokenizer.json", change)
