"""Writing the served half of a checkpoint: weights in the base model's dtype,
the base model's config and tokenizer files unchanged.

Fine-tuning changes weights only. Copying config and tokenizer byte for byte
from the base model keeps the checkpoint loadable into a running vLLM that
serves the base (same architecture, same tokenizer), which the rolling deploy
verifies before it touches a replica.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

# Files that describe the model rather than its weights, copied from a local base.
_CONFIG_FILES = ("config.json", "generation_config.json")
_TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt",
                    "*.tiktoken", "chat_template*", "added_tokens.json")


def save_weights(model: torch.nn.Module, out_dir: Path, dtype: torch.dtype) -> None:
    """Safetensors in `dtype` (fp32 master weights are cast), plus the model config."""
    state = {k: v.detach().to(dtype=dtype, device="cpu") for k, v in model.state_dict().items()}
    config = model.config
    previous = config.dtype
    config.dtype = dtype  # the config must describe the stored tensors
    try:
        model.save_pretrained(out_dir, state_dict=state,  # type: ignore[operator]
                              safe_serialization=True)
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
