"""What a rank holds, measured: the numbers `dpserve finetune --plan` estimates.

- `state_bytes`: weights, gradients and optimizer state this rank holds, summed over
  its tensors (DTensor shards count their local part; shared storage once). Exact,
  and the same on CPU and GPU.
- `ActivationMeter`: bytes the autograd graph saves for the backward during one
  forward (`saved_tensors_hooks`), parameters excluded. The forward saves, the
  backward frees, so the total saved by the end of the forward is the peak of what
  the graph holds; temporaries the forward frees at once are not counted (on GPU,
  `torch.cuda.max_memory_allocated` covers them).
- `peak_rss_bytes`: the process' high-water mark (Linux), everything included.
"""

from __future__ import annotations

import json
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dpserve.finetune.config import FinetuneConfig
from dpserve.finetune.dist import Dist


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage once."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        local = _local(t)
        if local.numel() == 0:
            continue
        seen.setdefault(_storage_key(local), local.untyped_storage().nbytes())
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state tensors of `optimizer` this rank holds (ZeRO: its own shard's)."""
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
    state = (inner if isinstance(inner, torch.optim.Optimizer) else optimizer).state
    return [v for per_param in state.values() for v in per_param.values()
            if isinstance(v, torch.Tensor)]


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{"weights", "grads", "optimizer"}: bytes this rank holds for each."""
    params = list(model.parameters())
    return {
        "weights": _nbytes(params),
        "grads": _nbytes([p.grad for p in params if p.grad is not None]),
        "optimizer": _nbytes(optimizer_tensors(optimizer)),
    }


class ActivationMeter:
    """Around one forward and backward: `peak_bytes` = what the forward saved for the
    backward, each storage once, parameters (and their gathered copies) excluded."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self._seen: set[tuple[str, int]] = set()
        self._params: set[tuple[str, int]] = set()
        self._hooks: Any = None

    def exclude(self, model: torch.nn.Module) -> ActivationMeter:
        """Do not count `model`'s parameters (as stored now) as activations."""
        for p in model.parameters():
            self._params.add(_storage_key(_local(p.data)))
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t  # a linear saves weight.t(), a view
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return t  # a weight (or an FSDP-gathered one): counted as weights, not here
        local = _local(t)
        key = _storage_key(local)
        if key not in self._seen and key not in self._params:
            self._seen.add(key)
            self.peak_bytes += local.untyped_storage().nbytes()
        return t

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def peak_rss_bytes() -> int:
    """The process' peak resident set size (ru_maxrss is KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def report_memory(cfg: FinetuneConfig, d: Dist, mine: dict[str, int], output: Path) -> None:
    """What each rank held in the first step, measured. Rank 0 prints its own and writes
    every rank's to OUTPUT/memory.json: the numbers `dpserve finetune --plan` estimates."""
    ranks: list[Any] = [None] * d.world_size
    dist.all_gather_object(ranks, mine)
    if not d.master:
        return
    (output / "memory.json").write_text(json.dumps(
        {"strategy": cfg.strategy, "world_size": d.world_size, "lora_rank": cfg.lora_rank,
         "micro_batch_size": cfg.micro_batch_size, "max_seq_len": cfg.max_seq_len,
         "activation_checkpointing": cfg.activation_checkpointing,
         "reshard_after_forward": cfg.reshard_after_forward, "ranks": ranks}, indent=2) + "\n")
    mib = {k: v / 2**20 for k, v in mine.items()}
    print(f"memory on rank 0 after step 1: weights {mib['weights']:,.1f} MiB, gradients "
          f"{mib['grads']:,.1f} MiB, optimizer {mib['optimizer']:,.1f} MiB, activations "
          f"{mib['activations']:,.1f} MiB (first micro-batch); process peak "
          f"{mib['peak_rss']:,.0f} MiB", flush=True)
