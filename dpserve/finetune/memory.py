"""What a rank holds, measured: the numbers `dpserve finetune --plan` estimates.

- `state_bytes`: weights, gradients and optimizer state this rank holds, summed over
  its tensors (DTensor shards count their local part; shared storage once). Exact,
  and the same on CPU and GPU.
- `ActivationMeter`: bytes the autograd graph saves for the backward during one
  forward (`saved_tensors_hooks`), parameters excluded. The forward saves, the
  backward frees, so the total saved by the end of the forward is the peak of what
  the graph holds. Cheap, and the same under every strategy (the plan's
  `activations` row). What it does not see: the forward's temporaries (at the loss,
  the logits and their shifted copy beside log-softmax's output) and, under
  activation checkpointing, the layer being recomputed in the backward — the
  plan's `peak transient` row, measured by `LiveMeter`.
- `LiveMeter`: the peak of everything one forward and backward allocates, the
  gradients it leaves excluded (saved activations + transients). Watches every
  operator, so it is for calibration and benchmarks, not the trainer.
- `peak_rss_bytes` / `peak_device_bytes`: the process' and the GPU's high-water marks,
  everything included. The trainer reads them after the second step: the first
  allocates AdamW's state in its update, after its activations are freed, so its
  peak lacks the optimizer state.
"""

from __future__ import annotations

import contextlib
import json
import resource
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode  # unannotated: type: ignores below
from torch.utils._pytree import tree_leaves

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
    """{"weights", "grads", "optimizer"}: bytes this rank holds for each. Call it after
    `optimizer.step()` and before `zero_grad`, when all three exist."""
    params = list(model.parameters())
    return {
        "weights": _nbytes(params),
        "grads": _nbytes([p.grad for p in params if p.grad is not None]),
        "optimizer": _nbytes(optimizer_tensors(optimizer)),
    }


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _is_weight_copy(t: torch.Tensor) -> bool:
    """Is `t` autocast's low-precision copy of a weight? A trainable weight's copy is
    its cast (`ToCopyBackward0` straight from the weight's `AccumulateGrad`); a frozen
    weight's (LoRA's base) has no autograd history: a 2-D low-precision tensor no
    operation made, which no activation of a decoder is (those have a batch dimension,
    and the trainer's weights are fp32). Told apart by the tensor alone: inside a
    saved-tensor hook `torch.is_autocast_enabled()` reads False."""
    fn = t.grad_fn
    if fn is not None:
        edges = fn.next_functions
        return (type(fn).__name__ == "ToCopyBackward0" and len(edges) == 1
                and edges[0][0] is not None and hasattr(edges[0][0], "variable"))
    return t.dim() == 2 and not t.requires_grad and t.dtype in _LOW_PRECISION


class ActivationMeter:
    """Around one forward and backward: `peak_bytes` = what the forward saved for the
    backward, each storage once, parameters (their FSDP-gathered copies and autocast's
    bf16 copies too) excluded.

    Under non-reentrant activation checkpointing the checkpointed layers save through
    checkpoint's own hooks, so what is counted is each layer's input (which the
    checkpoint keeps for the recompute) and the graph outside the layers; the
    recompute itself happens in the backward, one layer at a time, and is not counted."""

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
        if _is_weight_copy(base):
            return t  # autocast's copy of a weight: the plan's `copies`, not here
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


class _StorageWatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every storage an operator allocates, from its allocation to its release, as a
    list of events: (allocation id, bytes) when allocated, (allocation id, -1) when
    freed. An output sharing an input's storage (a view, an in-place op) is no new
    allocation, which is how views of the weights stay out."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.events: list[tuple[int, int]] = []
        self.live: dict[tuple[str, int], tuple[int, weakref.ref[torch.UntypedStorage]]] = {}

    def _freed(self, key: tuple[str, int], allocation: int) -> Callable[[object], None]:
        def callback(_: object) -> None:
            self.events.append((allocation, -1))
            self.live.pop(key, None)
        return callback

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = _storage_key(t)
            if key in inputs or key in self.live or storage.nbytes() == 0:
                continue
            allocation = len(self.events)
            self.live[key] = (allocation, weakref.ref(storage, self._freed(key, allocation)))
            self.events.append((allocation, storage.nbytes()))
        return out


class LiveMeter:
    """Around one forward and backward of `model`: `peak_bytes` = the most bytes the
    step's tensors occupied at once — saved activations, the forward's temporaries,
    a checkpointed layer's recompute, activation gradients — less the parameter
    gradients the step leaves behind (the plan counts those as gradients).

    Every operator goes through Python while it is active: several times slower, for
    calibration and benchmarks. Use it on an unwrapped model or DDP; under fsdp it
    would also count the all-gather buffers and, in the first step, FSDP's lazy
    initialisation."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.peak_bytes = 0
        self._model = model
        self._watch = _StorageWatch()

    def __enter__(self) -> LiveMeter:
        self._watch.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        self._watch.__exit__(*exc)  # type: ignore[no-untyped-call]
        grads = {_storage_key(_local(p.grad)) for p in self._model.parameters()
                 if p.grad is not None}
        left = {self._watch.live[k][0] for k in grads if k in self._watch.live}
        self._watch.live.clear()  # drops the weak references: no more events
        held: dict[int, int] = {}
        now = 0
        for allocation, nbytes in self._watch.events:
            if allocation in left:
                continue
            if nbytes < 0:
                now -= held.pop(allocation, 0)
            else:
                held[allocation] = nbytes
                now += nbytes
            self.peak_bytes = max(self.peak_bytes, now)


def peak_rss_bytes() -> int:
    """The process' peak resident set size (ru_maxrss is KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_device_bytes(device: torch.device) -> int | None:
    """The most memory torch's allocator has handed out on `device` (a CUDA GPU) since
    the process started or `torch.cuda.reset_peak_memory_stats`; None on CPU, where
    `peak_rss_bytes` is the figure."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def peak_bytes(device: torch.device) -> dict[str, int]:
    """{"peak_rss"} and, on a GPU, {"peak_device"}: the high-water marks so far."""
    peaks = {"peak_rss": peak_rss_bytes()}
    device_peak = peak_device_bytes(device)  # None on CPU
    if device_peak is not None:
        peaks["peak_device"] = device_peak
    return peaks


def report_memory(cfg: FinetuneConfig, d: Dist, mine: dict[str, int], output: Path, *,
                  peak_steps: int = 1) -> None:
    """What each rank held in the first step, measured, and its peaks over the first
    `peak_steps` steps. Rank 0 prints its own and writes every rank's to
    OUTPUT/memory.json: the numbers `dpserve finetune --plan` estimates."""
    ranks: list[Any] = [None] * d.world_size
    dist.all_gather_object(ranks, mine)
    if not d.master:
        return
    (output / "memory.json").write_text(json.dumps(
        {"strategy": cfg.strategy, "world_size": d.world_size, "lora_rank": cfg.lora_rank,
         "micro_batch_size": cfg.micro_batch_size, "max_seq_len": cfg.max_seq_len,
         "activation_checkpointing": cfg.activation_checkpointing,
         "reshard_after_forward": cfg.reshard_after_forward, "peak_steps": peak_steps,
         "ranks": ranks}, indent=2) + "\n")
    mib = {k: v / 2**20 for k, v in mine.items()}
    print(f"memory on rank 0 after step 1: weights {mib['weights']:,.1f} MiB, gradients "
          f"{mib['grads']:,.1f} MiB, optimizer {mib['optimizer']:,.1f} MiB, activations "
          f"{mib['activations']:,.1f} MiB (first micro-batch); process peak "
          f"{mib['peak_rss']:,.0f} MiB"
          + (f", GPU peak {mib['peak_device']:,.0f} MiB" if "peak_device" in mib else "")
          + (f" (steps 1-{peak_steps})" if peak_steps > 1 else ""),
          flush=True)


class MemoryProbe:
    """What a rank holds in its first steps, for OUTPUT/memory.json and the start of the
    log: the numbers `dpserve finetune --plan` estimates, measured while training.

    What a rank holds is measured in the first step, but AdamW allocates its state only
    in that step's update, once the activations are freed: the peak of a step that
    holds both is the second's (on an H100, 2 GiB more for a 270M model). So the
    report waits for the second step (the first, if the run has only one)."""

    def __init__(self, cfg: FinetuneConfig, d: Dist, output: Path, planned_steps: int) -> None:
        self._cfg, self._d, self._output = cfg, d, output
        self._report_after = 2 if planned_steps >= 2 else 1
        self._steps = 0
        self._meter: ActivationMeter | None = None
        self._held: dict[str, int] | None = None

    def micro_batch(self, i: int) -> contextlib.AbstractContextManager[object]:
        """Around micro-batch `i`'s forward and backward: the first step's first one is
        metered."""
        if self._steps == 0 and i == 0:
            self._meter = ActivationMeter()
            return self._meter
        return contextlib.nullcontext()

    def updated(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After the first step's update, before its gradients are freed: the state."""
        if self._meter is not None and self._held is None:
            self._held = {**state_bytes(model, optimizer), "activations": self._meter.peak_bytes}

    def step_done(self) -> None:
        """At the end of each step; reports once the step it waits for has run (a
        collective: every rank calls it)."""
        self._steps += 1
        if self._held is not None and self._steps == self._report_after:
            report_memory(self._cfg, self._d, {**self._held, **peak_bytes(self._d.device)},
                          self._output, peak_steps=self._steps)
            self._held = None
