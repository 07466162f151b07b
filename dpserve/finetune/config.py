"""Settings of `dpserve finetune`, resolved like every dpserve setting:
flag > environment (DPSERVE_<NAME>) > YAML file > default, validated once.

The same flags are accepted by the launcher (`dpserve finetune`) and by the
training module run directly under torchrun
(`torchrun --nproc-per-node 2 -m dpserve.finetune.train --model ... --data ...`);
launcher-only settings (process counts, rendezvous) are ignored by the latter.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dpserve.config import ConfigError, load_yaml, resolve
from dpserve.config.flags import add_setting_flags
from dpserve.config.settings import ENV_PREFIX
from dpserve.finetune.sharding import STRATEGIES, StrategyName


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """One fine-tuning run."""

    model: str
    """Base model: a local Hugging Face directory or a hub id."""
    data: str
    """Training data, JSONL: {"prompt", "completion"} or {"messages": [...]} per line."""
    output: str
    """Directory for checkpoints (`step-NNNNNN/`), training state, the loss curve."""
    eval_data: str | None = None
    """Optional validation JSONL; its loss is computed every `eval_every` steps."""
    eval_every: int = 50
    """Steps between two evaluations (and at the end)."""
    max_steps: int | None = None
    """Optimizer steps to train; exclusive with `epochs`."""
    epochs: float | None = None
    """Passes over the data (may be fractional); default 1 when `max_steps` is unset."""
    stop_after_steps: int | None = None
    """Stop (saving a checkpoint) after this many steps of *this* run, keeping the LR
    schedule of the full run — for time-boxed or preemptible jobs continued with --resume."""
    micro_batch_size: int = 4
    """Examples per rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; global batch = micro x world size x accum."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Final LR of the cosine decay as a fraction of the peak."""
    warmup_steps: int = 10
    """Linear warm-up from 0 to the peak LR."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 disables)."""
    max_seq_len: int = 1024
    """Examples are truncated to this many tokens."""
    save_every: int = 100
    """Steps between checkpoints (0: only at the end)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after each save."""
    resume: bool = False
    """Continue from the newest complete checkpoint in `output`, with the run's settings
    where none is given."""
    resume_changes: bool = False
    """With --resume: continue although settings given that shape the optimisation
    (global batch, learning-rate schedule, sequence length, seed) differ from the run's;
    without it such a resume is refused, naming them."""
    seed: int = 0
    """Seeds initialisation-independent randomness: data order, dropout."""
    log_every: int = 10
    """Steps between two progress lines."""
    threads_per_rank: int | None = None
    """CPU threads per rank (torch.set_num_threads); default: cores / local ranks."""
    nproc_per_node: int | None = None
    """Processes on this node; default one per GPU, or 2 on CPU."""
    nnodes: int = 1
    """Nodes taking part (multi-node uses c10d rendezvous)."""
    node_rank: int | None = None
    """This node's rank (only for static rendezvous; c10d assigns ranks itself)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous, required when nnodes > 1."""
    rdzv_id: str = "dpserve-finetune"
    """Rendezvous id shared by the nodes of one job."""
    max_restarts: int = 0
    """Times the elastic agent restarts the workers after a failure (resuming)."""
    strategy: StrategyName = "ddp"
    """How ranks share the work: `ddp` (every rank holds weights, gradients and AdamW
    state), `zero1` (DDP with the optimizer state sharded over ranks) or `fsdp` (FSDP2:
    parameters, gradients and optimizer state sharded, ZeRO-3)."""
    reshard_after_forward: bool = True
    """fsdp: free each layer's gathered parameters after its forward (ZeRO-3); off keeps
    them until the backward (ZeRO-2 behaviour: more memory, one all-gather less)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of storing them."""
    bucket_cap_mb: float = 25.0
    """ddp/zero1: gradient all-reduce bucket size in MiB (DDP's `bucket_cap_mb`)."""
    lora_rank: int | None = None
    """Train a LoRA adapter of this rank (peft) instead of every weight."""
    lora_alpha: float | None = None
    """LoRA scaling numerator (scale = alpha / rank); default 2 x rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated module names the adapter wraps (the attention and MLP projections)."""
    merge_on_save: bool = False
    """LoRA: also write merged full weights (base + adapter) as an ordinary checkpoint
    into OUTPUT/merged/step-N at every save, ready for `dpserve deploy`."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


SHAPING = ("global_batch", "lr", "min_lr_ratio", "warmup_steps", "max_steps", "epochs",
           "weight_decay", "max_grad_norm", "max_seq_len", "seed")
"""What a resumed run must keep to continue the same optimisation (the micro-batch,
accumulation and world size may change as long as their product, the global batch,
does not: DCP reshards the state)."""


def shaping(cfg: FinetuneConfig, world_size: int) -> dict[str, Any]:
    """The settings in SHAPING of a run of `cfg` on `world_size` ranks (saved with each
    checkpoint, compared on --resume)."""
    values = {name: getattr(cfg, name) for name in SHAPING if name != "global_batch"}
    return {"global_batch": cfg.micro_batch_size * cfg.grad_accum * world_size, **values}


LAUNCH_ONLY = frozenset({"nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id",
                         "max_restarts"})


FLAG_OVERRIDES: dict[str, dict[str, Any]] = {
    # No argparse choices: a strategy from a flag is refused like one from the environment
    # or the file, by the validation (naming the setting and its choices).
    "strategy": {"choices": None},
}
"""Where a flag differs from what its field gives (`dpserve.config.flags`)."""


def add_arguments(p: argparse.ArgumentParser, *, launcher: bool) -> None:
    """The command-line flags, one per setting; `launcher` adds the process/rendezvous
    ones and `--plan`'s."""
    add_setting_flags(p, FinetuneConfig, skip=LAUNCH_ONLY, overrides=FLAG_OVERRIDES)
    p.add_argument("--config", help="YAML settings file")
    if launcher:
        p.add_argument("--plan", action="store_true",
                       help="print each rank's memory per strategy and exit (no training)")
        p.add_argument("--device-memory-gib", type=float,
                       help="--plan: memory of one device (default: the GPU's, else RAM/ranks)")
        p.add_argument("--plan-device", choices=("gpu", "cpu"),
                       help="--plan: plan for GPUs (bf16 autocast) or CPUs (fp32); "
                            "default: what this machine has")
        add_setting_flags(p, FinetuneConfig, [f.name for f in fields(FinetuneConfig)
                                              if f.name in LAUNCH_ONLY])


def build_finetune_config(
    ns: argparse.Namespace | Mapping[str, Any], env: Mapping[str, str] | None = None,
    *, plan_only: bool = False,
) -> FinetuneConfig:
    """The validated settings; `plan_only` (for `--plan`) needs no data or output."""
    flags, file_values = _sources(ns)
    if plan_only:
        flags["data"] = flags.get("data") or ""
        flags["output"] = flags.get("output") or ""
    cfg = resolve(FinetuneConfig, flags, file_values, os.environ if env is None else env,
                  prefix="")
    _validate(cfg, plan_only=plan_only)
    return cfg


def given_settings(ns: argparse.Namespace | Mapping[str, Any],
                   env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The settings given a value (a flag, DPSERVE_<NAME> or the config file), not left
    to their defaults: what a resume does not take from the run it continues."""
    flags, file_values = _sources(ns)
    env = os.environ if env is None else env
    return frozenset(name for name in (f.name for f in fields(FinetuneConfig))
                     if flags.get(name) is not None or name in file_values
                     or ENV_PREFIX + name.upper() in env)


def _sources(ns: argparse.Namespace | Mapping[str, Any]
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the flags that are settings, the config file's values)."""
    flags = dict(vars(ns) if isinstance(ns, argparse.Namespace) else ns)
    file_values = load_yaml(flags.pop("config", None))
    file_values = dict(file_values.get("finetune", file_values))
    names = {f.name for f in fields(FinetuneConfig)}
    return {k: v for k, v in flags.items() if k in names}, file_values


def _check(ok: bool, name: str, message: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name}: {message}, got {value!r}")


def _validate(c: FinetuneConfig, *, plan_only: bool = False) -> None:
    _check(c.max_steps is None or c.epochs is None, "max_steps",
           "give either max_steps or epochs, not both", c.max_steps)
    if c.max_steps is not None:
        _check(c.max_steps >= 1, "max_steps", "must be >= 1", c.max_steps)
    if c.epochs is not None:
        _check(c.epochs > 0 and math.isfinite(c.epochs), "epochs", "must be > 0", c.epochs)
    if c.stop_after_steps is not None:
        _check(c.stop_after_steps >= 1, "stop_after_steps", "must be >= 1", c.stop_after_steps)
    for name in ("micro_batch_size", "grad_accum", "max_seq_len", "keep_last", "log_every",
                 "eval_every", "nnodes"):
        _check(getattr(c, name) >= 1, name, "must be >= 1", getattr(c, name))
    for name in ("save_every", "warmup_steps", "max_restarts"):
        _check(getattr(c, name) >= 0, name, "must be >= 0", getattr(c, name))
    _check(c.lr > 0, "lr", "must be > 0", c.lr)
    _check(0 <= c.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]", c.min_lr_ratio)
    _check(c.weight_decay >= 0, "weight_decay", "must be >= 0", c.weight_decay)
    _check(c.max_grad_norm >= 0, "max_grad_norm", "must be >= 0", c.max_grad_norm)
    if c.nproc_per_node is not None:
        _check(c.nproc_per_node >= 1, "nproc_per_node", "must be >= 1", c.nproc_per_node)
    if c.threads_per_rank is not None:
        _check(c.threads_per_rank >= 1, "threads_per_rank", "must be >= 1", c.threads_per_rank)
    if c.nnodes > 1:
        _check(c.rdzv_endpoint is not None, "rdzv_endpoint",
               "is required when nnodes > 1 (HOST:PORT of the c10d rendezvous)", c.rdzv_endpoint)
    if c.rdzv_endpoint is not None:
        host, _, port = c.rdzv_endpoint.rpartition(":")
        _check(bool(host) and port.isdigit(), "rdzv_endpoint", "must be HOST:PORT",
               c.rdzv_endpoint)
    _check(c.strategy in STRATEGIES, "strategy", f"must be one of {', '.join(STRATEGIES)}",
           c.strategy)
    _check(c.bucket_cap_mb > 0, "bucket_cap_mb", "must be > 0", c.bucket_cap_mb)
    if c.lora_rank is not None:
        _check(c.lora_rank >= 1, "lora_rank", "must be >= 1", c.lora_rank)
    if c.lora_alpha is not None:
        _check(c.lora_alpha > 0, "lora_alpha", "must be > 0", c.lora_alpha)
    _check(0 <= c.lora_dropout < 1, "lora_dropout", "must be in [0, 1)", c.lora_dropout)
    _check(bool(lora_targets(c)), "lora_targets", "must name at least one module",
           c.lora_targets)
    _check(not c.merge_on_save or c.lora_rank is not None, "merge_on_save",
           "needs --lora-rank (full fine-tunes are saved merged already)", c.merge_on_save)
    for name in ("data", "eval_data"):
        value = getattr(c, name)
        if value is not None and not plan_only:
            _check(Path(value).is_file(), name, "no such file", value)


def lora_targets(cfg: FinetuneConfig) -> list[str]:
    """`lora_targets` as a list of module names."""
    return [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]


def training_argv(cfg: FinetuneConfig) -> list[str]:
    """The resolved settings as flags for the training module (launch-only ones dropped),
    so every rank sees exactly what the launcher validated."""
    argv: list[str] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name in LAUNCH_ONLY or value is None or (value is False and f.default is False):
            continue
        if value is False:  # a switch that defaults to on
            argv.append("--no-" + flag[2:])
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv
