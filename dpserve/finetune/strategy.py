"""How the ranks share a model: `ddp`, `zero1` or `fsdp`, behind one small surface
(what each one shards, and what follows from it: `dpserve.finetune.sharding`).

| strategy | each rank holds                               | gradients are       |
|----------|-----------------------------------------------|---------------------|
| ddp      | weights, gradients, AdamW state (~16 B/param) | all-reduced (DDP)   |
| zero1    | weights, gradients, 1/N of the AdamW state    | all-reduced (DDP)   |
| fsdp     | 1/N of weights, gradients and AdamW state     | reduce-scattered    |

All three average gradients over ranks, so the loop scales its loss by the world size
to get a sum, and one step's update is the same whatever the strategy (the
equivalence tests check it). fsdp is FSDP2: `fully_shard` on every decoder layer,
then on the root; `reshard_after_forward=False` keeps gathered layers from forward to
backward (ZeRO-2 behaviour, one all-gather per layer less, more memory).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dpserve.finetune.comm import CommTimer
from dpserve.finetune.config import FinetuneConfig
from dpserve.finetune.dist import Dist
from dpserve.finetune.sharding import Strategy

ADAMW_BETAS = (0.9, 0.95)


@dataclass
class Parallel:
    """The model as the loop uses it.

    `model` is the module whose parameters are trained and saved (under fsdp its
    parameters are DTensor shards); `forward` is what the loop calls (the DDP wrapper,
    or the model itself)."""

    strategy: Strategy
    model: torch.nn.Module
    forward: torch.nn.Module
    optimizer: torch.optim.Optimizer
    comm: CommTimer
    comm_itemised: bool
    """False when the gradient collectives' time cannot be measured (fsdp on CUDA)."""

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Around one micro-batch's forward and backward: gradients are synchronised
        only on the last micro-batch of a step."""
        if last:
            return contextlib.nullcontext()
        if isinstance(self.forward, DDP):
            return self.forward.no_sync()
        return _fsdp_no_sync(self.model)

    def clip_grad_norm(self, max_norm: float) -> None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        # Under fsdp the gradients are DTensor shards; clip_grad_norm_ reduces the norm
        # over the ranks (a collective), so every rank clips by the same global norm.
        with self.comm.blocking() if self.strategy.shards_params else contextlib.nullcontext():
            torch.nn.utils.clip_grad_norm_(params, max_norm)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks the model declares unsplittable (transformers'
    `_no_split_modules`, e.g. LlamaDecoderLayer): the unit of sharding and of
    activation checkpointing."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no decoder layer class "
                         "(_no_split_modules); cannot shard it per layer")
    return layers


def wrap(model: torch.nn.Module, cfg: FinetuneConfig, d: Dist) -> Parallel:
    """Shard or replicate `model` (already on `d.device`, trainable parameters marked),
    and build AdamW over its trainable parameters."""
    comm = CommTimer()
    strategy = Strategy.named(cfg.strategy)
    if cfg.activation_checkpointing:
        _checkpoint_layers(model)
    if strategy.shards_params:
        _fully_shard(model, cfg, d)
        itemised = comm.install_fsdp(model)
        optimizer = _adamw(model, cfg)
        return Parallel(strategy, model, model, optimizer, comm, itemised)
    ddp = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None,
              bucket_cap_mb=cfg.bucket_cap_mb,
              # Gradients live in the all-reduce buckets (no second copy): 4 B/param less.
              gradient_as_bucket_view=True)
    # A lambda: DDP rejects a hook whose `bucket` annotation is not the GradBucket class
    # itself, and postponed annotations are strings.
    ddp.register_comm_hook(None, lambda state, bucket: comm.ddp_hook(state, bucket))
    if strategy.shards_optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        params = [p for p in model.parameters() if p.requires_grad]
        zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=cfg.lr,
                                       betas=ADAMW_BETAS, weight_decay=cfg.weight_decay)
        return Parallel(strategy, model, ddp, zero, comm, True)
    return Parallel(strategy, model, ddp, _adamw(model, cfg), comm, True)


def _adamw(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=ADAMW_BETAS,
                             weight_decay=cfg.weight_decay)


def _fully_shard(model: torch.nn.Module, cfg: FinetuneConfig, d: Dist) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # bf16 compute with fp32 master weights and fp32 gradient reduction on GPU; on CPU
    # everything stays fp32 (bf16 matmuls there are slow and the tests compare to 1e-5).
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if d.device.type == "cuda" else MixedPrecisionPolicy())
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp)
    # The root (embeddings, final norm, LM head) is needed right after the forward
    # anyway: keeping it gathered saves one all-gather per step.
    fully_shard(model, reshard_after_forward=False, mp_policy=mp)
    if d.device.type == "cpu":
        _prefetch_explicitly(model, layers)


def _prefetch_explicitly(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    """Overlap each layer's all-gather with the previous layer's compute on CPU.

    FSDP2 overlaps through CUDA streams; on CPU its all-gathers are synchronous, so a
    rank computes nothing while it gathers (measured: 54% of a 156M model's step). An
    asynchronous unshard runs the all-gather on Gloo's thread while this one computes;
    the next layer is prefetched in forward, the previous one in backward. (The
    reduce-scatter stays synchronous: FSDP2 issues it without `async_op`.) Measured
    on 2 ranks, 156M model: 0.47x -> 0.62x ddp's samples/s (ZeRO-2: 0.62x -> 0.72x),
    benchmarks/finetune/memory.py."""
    from torch.distributed.fsdp import FSDPModule

    set_async = getattr(model, "_set_unshard_async_op", None)
    if set_async is None:  # a torch without the switch: the default, synchronous path
        return
    set_async(True)
    shards = [layer for layer in layers if isinstance(layer, FSDPModule)]
    for i, layer in enumerate(shards):
        if i + 1 < len(shards):
            layer.set_modules_to_forward_prefetch([shards[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([shards[i - 1]])


def _checkpoint_layers(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant, the
    variant that composes with DDP and FSDP2)."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False


@contextlib.contextmanager
def _fsdp_no_sync(model: torch.nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_tensors(model: torch.nn.Module, master: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, full tensor on CPU) for every entry of the model's state dict, in order;
    tied entries (one tensor under two names) once, under the first name.

    Under fsdp each shard is gathered one tensor at a time (a collective: every rank
    must iterate to the end), so no rank ever holds the whole model; ranks other than
    the master get None instead of the tensor."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    for name, value in model.state_dict().items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        yield name, (tensor.detach().to("cpu") if master else None)


def tensor_sizes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) of the state dict entries `full_tensors` yields, without
    gathering anything: what a sharded writer plans its files from."""
    seen: set[int] = set()
    out = []
    for name, value in model.state_dict().items():
        if id(value) not in seen:
            seen.add(id(value))
            out.append((name, tuple(value.shape)))
    return out
