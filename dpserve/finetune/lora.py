"""LoRA fine-tuning with peft: the base frozen, low-rank adapters trained.

An adapter checkpoint is what vLLM's `--enable-lora` loads — `adapter_config.json`
and `adapter_model.safetensors` — inside the usual `step-NNNNNN/` with its
`dpserve.json`, whose `extra` records `kind: lora`, the rank, alpha, targets and
the base model's fingerprint. `export_merged` turns one into an ordinary full
checkpoint (base + B·A·alpha/r folded into the weights) that `dpserve deploy`
hot-loads like any other.

Only the adapter's parameters require gradients, so DDP all-reduces only them
and AdamW keeps state only for them (~1% of the model at rank 16).

Errors: `LoraError` (a ValueError) for a setting or an adapter checkpoint that
cannot be used, one line naming the flag or the path; `CheckpointError` for an
adapter file that does not fit the model it is loaded into (resume).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dpserve import checkpoint as ckpt
from dpserve.finetune.config import FinetuneConfig, lora_targets


class LoraError(ValueError):
    """A LoRA setting or an adapter checkpoint is unusable; one line naming which."""


def linear_modules(model_dir: str) -> list[str]:
    """The full names of the model's nn.Linear modules (model.layers.0.self_attn.q_proj,
    lm_head, ...), from its config alone (a meta-device model: no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def linear_names(model_dir: str) -> list[str]:
    """The distinct last names of the model's nn.Linear modules (q_proj, lm_head, ...)."""
    return sorted({name.rsplit(".", 1)[-1] for name in linear_modules(model_dir)})


def check_targets(model_dir: str, targets: list[str]) -> None:
    """LoraError naming every target that matches no linear layer of the model.

    A target matches as peft matches a list entry: a module whose full name is the
    target or ends with "." + target (so `q_proj` and `self_attn.q_proj` both work).
    peft itself only fails when *no* target matches; one typo among seven would
    otherwise train silently without that module."""
    modules = linear_modules(model_dir)
    missing = [t for t in targets
               if not any(m == t or m.endswith("." + t) for m in modules)]
    if missing:
        verb = "matches" if len(missing) == 1 else "match"
        raise LoraError(f"lora_targets: {', '.join(missing)} {verb} no linear layer of "
                        f"{model_dir}; its linear layers are "
                        f"{', '.join(linear_names(model_dir))}")


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

    # fork_rng: the seed fixes the adapter's init without resetting the caller's stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        peft_model: torch.nn.Module = get_peft_model(model, lora_config(cfg))
    # What adapter_config.json names as the base: the model the manifest names too,
    # whatever path the weights were read from.
    peft_config: Any = peft_model.peft_config["default"]  # type: ignore[index]
    peft_config.base_model_name_or_path = cfg.model
    return peft_model


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, named as in `adapter_model.safetensors`."""
    from peft import get_peft_model_state_dict

    # Only the LoRA factors: targeting lm_head, peft would also save the whole base layer
    # ("auto" embedding layers), which vLLM does not load from an adapter.
    return dict(get_peft_model_state_dict(model, save_embedding_layers=False))


def full_adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, whole, on CPU. Under fsdp they are DTensor shards, gathered
    here: a collective, every rank calls it."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu")
            .contiguous() for k, v in adapter_state(model).items()}


def save_adapter(model: torch.nn.Module, out_dir: Path,
                 state: dict[str, torch.Tensor] | None = None) -> None:
    """`adapter_config.json` + `adapter_model.safetensors` (fp32) and nothing else (no
    README), as vLLM's `--enable-lora` loads them; the same bytes for the same adapter.
    `state` from `full_adapter_state` (gathered by every rank) under fsdp."""
    from safetensors.torch import save_file

    peft_config: Any = model.peft_config["default"]  # type: ignore[index]
    if state is None:
        state = full_adapter_state(model)
    save_file(state, str(out_dir / ckpt.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    peft_config.save_pretrained(str(out_dir))
    # peft writes target_modules from a set: sorted, the file is the same on every save.
    path = out_dir / ckpt.ADAPTER_CONFIG
    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_adapter_weights(model: torch.nn.Module, adapter_dir: Path) -> None:
    """Put a saved adapter's tensors into a peft model built with the same settings
    (resume). Strict: the file must hold exactly the model's adapter tensors, with their
    shapes, else CheckpointError naming the file — nothing is loaded then."""
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(adapter_dir) / ckpt.ADAPTER_WEIGHTS
    if not path.is_file():
        raise ckpt.CheckpointError(f"{path}: no adapter weights")
    try:
        saved = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ckpt.CheckpointError(f"{path}: cannot read the adapter: {exc}") from None
    expected = {k: tuple(v.shape) for k, v in adapter_state(model).items()}
    if set(saved) != set(expected):
        missing = sorted(set(expected) - set(saved))
        raise ckpt.CheckpointError(
            f"{path}: holds another adapter (tensor names differ from --lora-targets"
            + (f"; lacks {missing[0]}" if missing else "") + ")")
    for name, shape in expected.items():
        if tuple(saved[name].shape) != shape:
            raise ckpt.CheckpointError(
                f"{path}: holds another adapter ({name} is {list(saved[name].shape)}, "
                f"--lora-rank makes it {list(shape)})")
    set_peft_model_state_dict(model, saved)


def adapter_meta_extra(cfg: FinetuneConfig, *, fingerprint: str | None = None
                       ) -> dict[str, Any]:
    """What `dpserve.json` records about an adapter checkpoint. `fingerprint`: the
    base's `base_fingerprint`, computed once per run by the caller (it reads every
    weight byte); computed here when not given."""
    return {"kind": "lora", "lora_rank": cfg.lora_rank, "lora_alpha": alpha(cfg),
            "lora_targets": lora_targets(cfg),
            "base_fingerprint": fingerprint or ckpt.base_fingerprint(cfg.model)}


def check_resumable(meta: ckpt.CheckpointMeta, cfg: FinetuneConfig) -> None:
    """LoraError unless the adapter checkpoint `meta` continues with `cfg`'s settings on
    the same base: another rank or other targets cannot load, another alpha or base
    would silently train something else."""
    saved = meta.extra
    for name, now in (("lora_rank", cfg.lora_rank), ("lora_alpha", alpha(cfg)),
                      ("lora_targets", lora_targets(cfg))):
        if saved.get(name) != now:
            raise LoraError(f"{name}: the run being resumed used {saved.get(name)!r}, "
                            f"not {now!r}; resume with the same setting, or a new --output")
    if saved.get("base_fingerprint") != ckpt.base_fingerprint(cfg.model):
        raise LoraError(f"model: {cfg.model} is not the base the run being resumed was "
                        "trained on (its config or weights changed since)")


def export_merged(adapter_ckpt: Path, output: Path, *, base_fingerprint_now: str | None = None
                  ) -> Path:
    """Write `output/step-N` (N: the adapter's step) and return it: full weights =
    base + B·A·alpha/r, merged in fp32 and stored in the base's dtype, an ordinary
    checkpoint (`extra.kind` full, `merged_from` the adapter) `dpserve deploy` hot-loads.

    Refused with LoraError, before anything is written: a checkpoint that is not an
    adapter, an existing `output/step-N`, a base (the manifest's `base_model`) that is
    missing or whose fingerprint changed. CheckpointError: the adapter fails
    verification. `base_fingerprint_now`: the base's fingerprint when the caller has
    just computed it (the trainer, once per run), instead of hashing it again."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dpserve.finetune.weights import copy_tokenizer_files, save_weights

    meta = ckpt.verify_checkpoint(adapter_ckpt)
    kind = ckpt.checkpoint_kind(meta)
    if kind != "lora":
        why = ("it holds full weights already; deploy it as it is" if kind == "full"
               else f"its {ckpt.META_FILE} says kind {kind!r}")
        raise LoraError(f"{adapter_ckpt}: is not a LoRA adapter checkpoint ({why})")
    final = Path(output) / ckpt.step_name(meta.step)
    if os.path.lexists(final):  # before the (long) hashing and merging
        raise LoraError(f"{final}: already exists; checkpoints are never overwritten")
    base = meta.base_model
    if not Path(base).is_dir() and (base.startswith((".", "/", "~")) or base.count("/") > 1):
        raise LoraError(f"{base}: no such directory; it is the base model {adapter_ckpt} "
                        f"names in its {ckpt.META_FILE}")
    now = base_fingerprint_now or ckpt.base_fingerprint(base)
    if now != meta.extra.get("base_fingerprint"):
        raise LoraError(f"{base}: is not the base model {adapter_ckpt} was trained on "
                        "(its config or weights changed since)")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    try:
        merged = PeftModel.from_pretrained(model, str(adapter_ckpt)).merge_and_unload()
    except (ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LoraError(f"{adapter_ckpt}: cannot apply the adapter to {base}: {first}"
                        ) from None
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
