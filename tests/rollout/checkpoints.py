"""Checkpoints of the tiny model for rollout tests, written with the real checkpoint
writer: a fine-tune-like perturbation of the weights, or a deliberately broken variant
(other shapes, dtype, vocabulary, NaN...) made by editing a copy of the tensors; and
LoRA adapter checkpoints as `dpserve finetune --lora-rank` writes them, built from the
tiny model's real linear layer shapes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file as save_arrays
from safetensors.torch import load_file, save_file

from dpserve import checkpoint as ckpt
from dpserve.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from dpserve.rollout.validate import read_safetensors_header

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


Arrays = dict[str, np.ndarray]
RANK = 4
TARGETS = ("q_proj", "down_proj")
PREFIX = "base_model.model."
Q_PROJ = "model.layers.0.self_attn.q_proj"  # [128, 128] in the tiny model
DOWN_PROJ = "model.layers.1.mlp.down_proj"  # [128, 256]


def lora_tensors(base: Path, rank: int, targets: tuple[str, ...]) -> Arrays:
    """lora_A [r, in] and lora_B [out, r] for every linear layer of `base` a target names,
    as peft names them."""
    rng = np.random.default_rng(0)
    tensors = {}
    for name, info in read_safetensors_header(base / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if len(info.shape) == 2 and any(module.endswith("." + t) for t in targets):
            out_dim, in_dim = info.shape
            tensors[f"{PREFIX}{module}.lora_A.weight"] = rng.normal(
                0, 0.02, (rank, in_dim)).astype(np.float32)
            tensors[f"{PREFIX}{module}.lora_B.weight"] = rng.normal(
                0, 0.02, (out_dim, rank)).astype(np.float32)
    return tensors


def write_adapter(base: Path, output: Path, *, rank: int = RANK,
                  targets: tuple[str, ...] = TARGETS, config: dict[str, Any] | None = None,
                  tensors: Callable[[Arrays], Arrays] | None = None,
                  extra: dict[str, Any] | None = None,
                  files: Callable[[Path], None] | None = None) -> tuple[Path, ckpt.CheckpointMeta]:
    """An adapter checkpoint as `dpserve finetune --lora-rank` writes one (step 7), with
    `config` merged into adapter_config.json, `tensors` editing the weights, `extra` merged
    into the manifest (None values removed), `files(dir)` for any other edit."""
    def fill(tmp: Path) -> None:
        settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2.0 * rank,
                    "target_modules": sorted(targets), "bias": "none",
                    "modules_to_save": None, "use_dora": False, "lora_bias": False,
                    "init_lora_weights": True, "rank_pattern": {}, "alpha_pattern": {},
                    "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
                    **(config or {})}
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(settings, indent=2))
        arrays = lora_tensors(base, rank, targets)
        save_arrays(tensors(arrays) if tensors else arrays, str(tmp / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        if files is not None:
            files(tmp)

    manifest = {"kind": "lora", "lora_rank": rank, "lora_alpha": 2.0 * rank,
                "lora_targets": list(targets), "base_fingerprint": ckpt.base_fingerprint(base),
                **(extra or {})}
    path = ckpt.write_checkpoint(output, 7, fill, base_model=str(base), loss=1.0,
                                 world_size=1,
                                 extra={k: v for k, v in manifest.items() if v is not None})
    return path, ckpt.verify_checkpoint(path)
