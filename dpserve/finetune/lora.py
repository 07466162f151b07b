"""LoRA fine-tuning with peft: the base frozen, low-rank adapters trained.

An adapter checkpoint is what vLLM's `--enable-lora` loads — `adapter_config.json`
and `adapter_model.safetensors` — inside the usual `step-NNNNNN/` with its
`dpserve.json`, whose `extra` records `kind: lora`, the rank, alpha, targets and
the base model's fingerprint. `export_merged` turns one into an ordinary full
checkpoint (base + B·A·alpha/r folded into the weights) that `dpserve deploy`
hot-loads like any other.

Only the adapter's parameters require gradients, so DDP all-reduces only them
and AdamW keeps state only for them (~1% of the model at rank 16).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from dpserve import checkpoint as ckpt
from dpserve.finetune.config import FinetuneConfig, lora_targets

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraError(ValueError):
    """A LoRA setting or an adapter checkpoint is unusable; one line naming which."""


def linear_names(model_dir: str) -> list[str]:
    """The distinct last names of the model's nn.Linear modules (q_proj, lm_head, ...),
    from its config alone (a meta-device model: no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear)})


def check_targets(model_dir: str, targets: list[str]) -> None:
    """LoraError naming every target that is no linear layer of the model."""
    names = linear_names(model_dir)
    missing = [t for t in targets if t not in names]
    if missing:
        raise LoraError(f"lora_targets: {', '.join(missing)} match no linear layer of "
                        f"{model_dir}; its linear layers are {', '.join(names)}")


def lora_config(cfg: FinetuneConfig) -> Any:
    from peft import LoraConfig

    assert cfg.lora_rank is not None
    # peft types lora_alpha as int; it only ever computes alpha / r, a float works.
    return LoraConfig(r=cfg.lora_rank, lora_alpha=alpha(cfg),  # type: ignore[arg-type]
                      lora_dropout=cfg.lora_dropout, target_modules=lora_targets(cfg),
                      bias="none", task_type="CAUSAL_LM")


def alpha(cfg: FinetuneConfig) -> float:
    assert cfg.lora_rank is not None
    return cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank


def apply_lora(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.nn.Module:
    """`model` wrapped by peft; only the adapters require gradients. The adapters'
    initialisation (A random, B zero) is seeded, so every rank and every world size
    starts from the same adapter."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        peft_model: torch.nn.Module = get_peft_model(model, lora_config(cfg))
    return peft_model


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, named as in `adapter_model.safetensors`."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model))


def full_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, whole, on CPU. Under fsdp they are DTensor shards, gathered
    here: a collective, every rank calls it."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu")
            .contiguous() for k, v in adapter_state(model).items()}


def save_adapter(model: torch.nn.Module, out_dir: Path,
                 state: dict[str, torch.Tensor] | None = None) -> None:
    """`adapter_config.json` + `adapter_model.safetensors` (fp32), as vLLM loads them;
    `state` from `full_adapter_state` (gathered by every rank) under fsdp."""
    from safetensors.torch import save_file

    peft_config: Any = model.peft_config["default"]  # type: ignore[index]
    if state is None:
        state = full_adapter_state(model)
    save_file(state, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    peft_config.save_pretrained(str(out_dir))
    # peft writes target_modules from a set: sorted, the file is the same on every save.
    path = out_dir / ADAPTER_CONFIG
    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_adapter_weights(model: torch.nn.Module, adapter_dir: Path) -> None:
    """Put a saved adapter's tensors into a peft model built with the same settings."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ckpt.CheckpointError(f"{path}: no adapter weights")
    saved = load_file(str(path))
    expected = set(adapter_state(model))
    if set(saved) != expected:
        raise ckpt.CheckpointError(f"{path}: holds another adapter (tensor names differ from "
                                   "--lora-rank/--lora-targets)")
    set_peft_model_state_dict(model, saved)


def base_fingerprint(model_dir: str) -> str:
    """sha256 over the base's config.json and every *.safetensors file (name and
    content, sorted by name): an adapter only fits the exact weights it was trained on.
    A hub id (no local directory) is fingerprinted by its name."""
    base = Path(model_dir)
    digest = hashlib.sha256()
    if not base.is_dir():
        digest.update(f"hub:{model_dir}".encode())
        return digest.hexdigest()
    for path in [base / "config.json", *sorted(base.glob("*.safetensors"))]:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + ckpt.sha256_file(path).encode())
    return digest.hexdigest()


def adapter_meta_extra(cfg: FinetuneConfig) -> dict[str, Any]:
    """What `dpserve.json` records about an adapter checkpoint."""
    return {"kind": "lora", "lora_rank": cfg.lora_rank, "lora_alpha": alpha(cfg),
            "lora_targets": lora_targets(cfg), "base_fingerprint": base_fingerprint(cfg.model)}


def export_merged(adapter_ckpt: Path, output: Path) -> Path:
    """Write `output/step-N` (N: the adapter's step): full weights = base + adapter,
    in the base's dtype, an ordinary checkpoint `dpserve deploy` hot-loads."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dpserve.finetune.weights import copy_tokenizer_files, save_weights

    meta = ckpt.verify_checkpoint(adapter_ckpt)
    if meta.extra.get("kind") != "lora":
        raise LoraError(f"{adapter_ckpt}: is not a LoRA adapter checkpoint (it holds full "
                        "weights already; deploy it as it is)")
    base = meta.base_model
    if base_fingerprint(base) != meta.extra.get("base_fingerprint"):
        raise LoraError(f"{base}: is not the base model {adapter_ckpt} was trained on "
                        "(its config or weights changed since)")
    final = Path(output) / ckpt.step_name(meta.step)
    if final.exists():
        raise LoraError(f"{final}: already exists; checkpoints are never overwritten")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_ckpt)).merge_and_unload()
    dtype = getattr(AutoConfig.from_pretrained(base), "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tokenizer = AutoTokenizer.from_pretrained(base)

    def write(tmp: Path) -> None:
        save_weights(merged, tmp, dtype)
        copy_tokenizer_files(base, tmp, tokenizer)

    return ckpt.write_checkpoint(
        Path(output), meta.step, write, base_model=base, loss=meta.loss,
        world_size=meta.world_size,
        extra={"kind": "full", "merged_from": str(adapter_ckpt),
               "base_fingerprint": meta.extra.get("base_fingerprint")})
