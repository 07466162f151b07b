"""Is a directory a LoRA adapter the running replicas can load beside the base they serve?

vLLM loads an adapter into engines that keep serving. What its loader rejects fails
on every replica at once; what it accepts but does not fit (an adapter trained on
other weights, a tensor of another shape) either serves wrong text without an error
or fails inside the engine. So everything is checked here, before any engine is
touched, from what can be read without loading a tensor (and the bytes, for NaN):

1. `dpserve.json` says kind lora (the snapshot store checked every sha256 already);
2. `adapter_config.json` is a plain LoRA of one rank with listed target modules, and
   agrees with the manifest's lora_rank, lora_alpha and lora_targets;
3. it uses no feature vLLM cannot serve (`PEFTHelper.validate_legal`);
4. it was trained on the exact base the replicas serve (`checkpoint.base_fingerprint`);
5. its rank fits the engines' LoRA slots (`--max-lora-rank`);
6. every target names a linear layer of the served base;
7. every tensor in `adapter_model.safetensors` is the lora_A [r, in] or lora_B [out, r]
   of such a layer, paired, floating-point and finite.

Refusals are `validate.Refused`: 422 for a directory that is not a sound adapter,
409 for one that conflicts with what the replicas serve; one line naming the file,
key or tensor at fault.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpserve.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CheckpointError,
    CheckpointMeta,
    checkpoint_kind,
    read_capped,
)
from dpserve.rollout.deployed import checkpoint_version
from dpserve.rollout.validate import (
    Refused,
    TensorInfo,
    check_finite,
    fingerprint,
    read_safetensors_header,
    refused,
)

MAX_CONFIG_BYTES = 1024 * 1024
"""Largest adapter_config.json read; peft writes about 1.5 KiB."""
_PREFIX = "base_model.model."
_FACTORS = {"lora_A": ".lora_A.weight", "lora_B": ".lora_B.weight"}
_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# vLLM 0.32 `PEFTHelper._init_is_supported`: inits that only set the adapter's starting
# values. The others (PiSSA, OLoRA, CorDA, LoftQ) change the base weights too.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


@dataclass(frozen=True)
class AdapterInfo:
    """A validated adapter, as the replicas are to load it."""

    path: str
    """The (snapshot) directory vLLM loads, absolute."""
    version: str
    """`step-000120@3f2a9c1b`, named as full checkpoints are (`deployed.checkpoint_version`):
    the step and a digest of every file's sha256, so equal versions mean equal files."""
    rank: int
    alpha: float
    targets: tuple[str, ...]
    """adapter_config.json's target_modules, sorted."""
    base_fingerprint: str
    """`checkpoint.base_fingerprint` of the base it was trained on (the served one)."""


def validate_adapter(adapter_dir: Path, meta: CheckpointMeta, *, served_base: Path,
                     served_fingerprint: str, max_lora_rank: int) -> AdapterInfo:
    """All the checks above, cheapest refusal first; `meta` is what the snapshot store
    returned (files already hashed). Reads every byte of the adapter, and the served
    base's safetensors headers (`validate.fingerprint`): run it in a thread."""
    adapter_dir = Path(adapter_dir)
    kind = checkpoint_kind(meta)
    if kind == "full":
        raise refused(422, f"{adapter_dir}: is a full checkpoint, not a LoRA adapter: "
                           "deploy it without --name")
    if kind != "lora":
        raise refused(422, f"{adapter_dir}: holds kind {kind!r}, not a LoRA adapter")
    config = _read_config(adapter_dir / ADAPTER_CONFIG)
    rank, alpha, targets = _lora_settings(config, adapter_dir / ADAPTER_CONFIG, meta)
    trained_on = meta.extra.get("base_fingerprint")
    if not isinstance(trained_on, str) or not trained_on:
        raise refused(422, f"{adapter_dir}: its manifest lacks base_fingerprint, so the "
                           "base it was trained on is unknown")
    if trained_on != served_fingerprint:
        named = str(meta.base_model)
        named = named if len(named) <= 200 else named[:200] + "..."
        raise refused(409, f"{adapter_dir}: adapter was trained on base {named!r} "
                           f"(fingerprint {trained_on[:12]}); the replicas serve "
                           f"{served_base} (fingerprint {served_fingerprint[:12]})")
    if rank > max_lora_rank:
        raise refused(409, f"{adapter_dir}: rank {rank} is above the replicas' "
                           f"--max-lora-rank {max_lora_rank}; start `dpserve serve` with "
                           f"--max-lora-rank {rank} (or more) to serve it")
    linears = _linear_layers(served_base)
    for target in targets:
        if not any(_matches(module, target) for module in linears):
            raise refused(409, f"{adapter_dir / ADAPTER_CONFIG}: target {target!r} matches no "
                               f"linear layer of the served base {served_base}")
    tensors = _check_tensors(adapter_dir / ADAPTER_WEIGHTS, rank, targets, linears)
    check_finite(adapter_dir, tensors)
    return AdapterInfo(path=str(adapter_dir.resolve()), version=checkpoint_version(meta),
                       rank=rank, alpha=alpha, targets=tuple(sorted(targets)),
                       base_fingerprint=trained_on)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(read_capped(path, MAX_CONFIG_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise refused(422, f"{path}: missing; a LoRA adapter needs it") from None
    except OSError as exc:
        raise refused(422, f"{path}: cannot read: {exc.strerror}") from None
    except CheckpointError as exc:
        raise refused(422, str(exc)) from None
    except (ValueError, RecursionError):
        raise refused(422, f"{path}: is not valid JSON") from None
    if not isinstance(config, dict):
        raise refused(422, f"{path}: must hold a JSON object")
    return config


def _lora_settings(config: dict[str, Any], path: Path, meta: CheckpointMeta
                   ) -> tuple[int, float, list[str]]:
    """(r, lora_alpha, target_modules) of a plain, one-rank LoRA vLLM can serve, equal to
    what the manifest records."""
    if config.get("peft_type") != "LORA":
        raise refused(422, f"{path}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    rank, alpha, targets = (config.get(k) for k in ("r", "lora_alpha", "target_modules"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise refused(422, f"{path}: r must be a positive integer, not {rank!r}")
    if (not isinstance(alpha, int | float) or isinstance(alpha, bool)
            or not math.isfinite(alpha)):
        raise refused(422, f"{path}: lora_alpha must be a finite number, not {alpha!r}")
    if isinstance(targets, str):
        raise refused(422, f"{path}: target_modules is a regular expression ({targets!r}); "
                           "dpserve deploys adapters whose target_modules is a list of "
                           "module names")
    if (not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) and t for t in targets)):
        raise refused(422, f"{path}: target_modules must be a non-empty list of module "
                           "names")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise refused(422, f"{path}: {key} is set; dpserve adapters have one rank and "
                               "one alpha for every module")
    _check_features(config, path)
    extra = meta.extra
    for key, ours, manifest_key, recorded in (
            ("r", rank, "lora_rank", extra.get("lora_rank")),
            ("lora_alpha", alpha, "lora_alpha", extra.get("lora_alpha")),
            ("target_modules", sorted(targets), "lora_targets",
             _sorted_names(extra.get("lora_targets")))):
        if ours != recorded:
            raise refused(422, f"{path}: {key} is {ours!r}, but the manifest says "
                               f"{manifest_key} {recorded!r}")
    return rank, float(alpha), targets


def _check_features(config: dict[str, Any], path: Path) -> None:
    """Refuse, before any engine sees it, what vLLM 0.32's loader refuses in every replica
    (`vllm.lora.peft_helper.PEFTHelper._validate_features` and `validate_legal`). A causal
    LM has no classifier head, so modules_to_save is refused whatever it names."""
    init = config.get("init_lora_weights", True)
    unsupported = {
        "modules_to_save": bool(config.get("modules_to_save")),
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "lora_bias": bool(config.get("lora_bias")),
        "init_lora_weights": isinstance(init, str) and init.lower() not in _PLAIN_INITS,
        "alora_invocation_tokens": bool(config.get("alora_invocation_tokens")),
        "layer_replication": bool(config.get("layer_replication")),
        "use_bdlora": bool(config.get("use_bdlora")),
        "use_qalora": bool(config.get("use_qalora")),
    }
    for key, bad in unsupported.items():
        if bad:
            raise refused(422, f"{path}: {key} is {config.get(key)!r}, which vLLM cannot "
                               "serve from a runtime-loaded adapter")


def _linear_layers(served_base: Path) -> dict[str, tuple[int, int]]:
    """Module path -> (out, in) of every 2-D `*.weight` of the served base, from its
    safetensors headers."""
    try:
        tensors = fingerprint(served_base).tensors
    except Refused as exc:  # the served base, not the request, is at fault
        raise Refused(409, f"cannot read the served base: {exc.message}") from None
    return {name.removesuffix(".weight"): (info.shape[0], info.shape[1])
            for name, info in tensors.items()
            if name.endswith(".weight") and len(info.shape) == 2}


def _matches(module: str, target: str) -> bool:
    """peft's rule for a target_modules list entry: the full name, or a "."-suffix."""
    return module == target or module.endswith("." + target)


def _check_tensors(path: Path, rank: int, targets: list[str],
                   linears: dict[str, tuple[int, int]]) -> dict[str, TensorInfo]:
    """Refused(422) naming the first tensor that is not the lora_A [r, in] or lora_B
    [out, r] of a targeted linear layer of the served base, or lacks its other half."""
    tensors = read_safetensors_header(path)
    if not tensors:
        raise refused(422, f"{path}: holds no tensors")
    halves: dict[str, set[str]] = {}
    for name, info in sorted(tensors.items()):
        factor, module = _parse_name(name)
        if factor is None:
            raise refused(422, f"{path}: tensor {name} is not a LoRA factor (dpserve "
                               f"loads {_PREFIX}<module>.lora_A/lora_B.weight only)")
        if module not in linears:
            raise refused(422, f"{path}: tensor {name} adapts {module}, which is not a "
                               "linear layer of the served base")
        if not any(_matches(module, t) for t in targets):
            raise refused(422, f"{path}: tensor {name} adapts {module}, which no entry of "
                               "target_modules names")
        out_dim, in_dim = linears[module]
        expected = (rank, in_dim) if factor == "lora_A" else (out_dim, rank)
        if info.shape != expected:
            raise refused(422, f"{path}: tensor {name} has shape {list(info.shape)}, "
                               f"rank {rank} on a [{out_dim}, {in_dim}] layer needs "
                               f"{list(expected)}")
        if info.dtype not in _DTYPES:
            raise refused(422, f"{path}: tensor {name} has dtype {info.dtype}, not a "
                               "floating-point type")
        halves.setdefault(module, set()).add(factor)
    for module, found in sorted(halves.items()):
        if len(found) == 1:
            (has,) = found
            lacks = "lora_B" if has == "lora_A" else "lora_A"
            raise refused(422, f"{path}: tensor {_PREFIX}{module}.{has}.weight has no "
                               f"{lacks}.weight")
    return tensors


def _parse_name(name: str) -> tuple[str | None, str]:
    """("lora_A" or "lora_B", module path) of a peft tensor name; (None, "") otherwise."""
    if name.startswith(_PREFIX):
        for factor, suffix in _FACTORS.items():
            module = name[len(_PREFIX):].removesuffix(suffix)
            if name.endswith(suffix) and module:
                return factor, module
    return None, ""


def _sorted_names(value: object) -> list[str] | None:
    """`value` sorted if it is a list of strings (the manifest's lora_targets), else None."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return sorted(value)
    return None
