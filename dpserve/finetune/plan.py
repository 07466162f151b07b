"""`dpserve finetune --plan`: what each rank will hold, estimated before anything runs.

The parameter counts are exact: the model is built from its `config.json` on the
meta device (no weights read, any size). The bytes follow what the trainer does:

| per rank          | ddp      | zero1    | fsdp       | LoRA (ddp)       | LoRA (fsdp)  |
|-------------------|----------|----------|------------|------------------|--------------|
| weights (fp32)    | 4P       | 4P       | 4P/N       | 4P + 4A          | 4(P + A)/N   |
| gradients (fp32)  | 4P       | 4P       | 4P/N       | 4A               | 4A/N         |
| AdamW state       | 8P       | 8P/N     | 8P/N       | 8A (zero1: 8A/N) | 8A/N         |
| gathered (fsdp)   |          |          | 2 layers + root (ZeRO-3), every layer (ZeRO-2) |
| bf16 copies (GPU) | 2L       | 2L       |            | 2(L + A)         |              |

P parameters, A adapter parameters, L the weights of the linear layers (all but the
embedding and the norms), N ranks. The bf16 copies are autocast's: ddp and zero1 on a
GPU compute each linear layer with a bf16 copy of its fp32 weight, which autocast
caches (a trainable weight) or autograd saves (a frozen one) from the forward to the
backward: 2L, exactly what an H100 run held for a full fine-tune (a frozen layer
under activation checkpointing keeps its copy only while it runs). fsdp's bf16
compute copies are its gathered parameters. Activations, per token of a micro-batch
(elements; 4 bytes each in fp32 on CPU, about 2 under bf16 autocast on GPU, plus the
fp32 loss): 8h + 4i + 2·kv saved per decoder layer (h hidden, i MLP width, kv the
key/value width), and 3h + V for the embedding, final norm and loss (V vocabulary) —
fitted to what autograd saves in transformers' Llama with SDPA attention (no s² term)
and checked against `memory.ActivationMeter` in the tests. With activation
checkpointing a layer saves only its input (h).

On top of what is saved, the step's peak holds a transient: at the loss, the logits
and their shifted copy (`logits[:, :-1]` reshaped) beside log-softmax's output, 2V
per token (fp32 on CPU; bf16 logits + an fp32 copy on GPU); or, if larger, in the
last layer's backward (the loss's tensors are gone by then) its gradient
temporaries, 2i + h, plus under activation checkpointing the layer's recompute.
With a large vocabulary the logits win, and they are most of the activation memory
an activation-checkpointed run needs: Llama 3's V = 128256 is 31 x h.
`memory.LiveMeter` measures the peak in the tests. Allocator slack, the framework
itself (~0.5 GiB per process) and communication buffers come on top: the verdict
keeps 10% headroom.

The GPU figures (bf16 autocast) follow the same count in 2-byte elements, checked on
an H100 (benchmarks/gpu/check.py precision): what autograd saves is within 0.85-1.16 of
the estimate on the test shapes under ddp and fsdp; the tests run on CPU.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from dpserve.finetune.config import FinetuneConfig, lora_targets
from dpserve.finetune.launch import DEFAULT_CPU_PROCS
from dpserve.finetune.sharding import DDP, FSDP, ZERO1, Strategy

GIB = 1024**3
HEADROOM = 0.9


@dataclass(frozen=True)
class Shape:
    """What the estimate needs to know about a model."""

    params: int
    layer_params: int
    """Parameters of the largest decoder layer (FSDP's unit of all-gather)."""
    layers: int
    hidden: int
    intermediate: int
    kv_width: int
    vocab: int
    lora_params_per_rank: int
    """Adapter parameters per unit of LoRA rank on the chosen targets."""
    linear_params: int = 0
    """Weights of every linear layer (autocast computes them from bf16 copies)."""
    layer_linear_params: int = 0
    """The linear weights of the largest decoder layer."""


@dataclass(frozen=True)
class Setup:
    strategy: Strategy
    world_size: int
    micro_batch: int
    seq_len: int
    gpu: bool
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    lora_rank: int | None = None


@dataclass(frozen=True)
class Estimate:
    weights: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    transient: float
    """On top of the saved activations at the step's peak (see the module docstring)."""
    copies: float = 0.0
    """Autocast's bf16 copies of the linear weights (ddp and zero1 on a GPU)."""

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.gathered + self.copies
                + self.activations + self.transient)


class PlanError(ValueError):
    """The model cannot be planned; one line naming the file."""


def model_shape(model_dir: str, lora_targets: list[str]) -> Shape:
    """Exact counts from the config alone (a meta-device model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (Path(model_dir) / "config.json").is_file():
        raise PlanError(f"model: {model_dir} has no config.json")
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from dpserve.finetune.strategy import decoder_layers

    layers = decoder_layers(model)
    params = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter
    lora = sum(m.in_features + m.out_features for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in lora_targets)
    def linear(module: torch.nn.Module) -> int:
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))

    text = getattr(config, "text_config", config)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return Shape(
        params=params, layer_params=max(sum(p.numel() for p in layer.parameters())
                                        for layer in layers),
        layers=len(layers), hidden=text.hidden_size, intermediate=text.intermediate_size,
        kv_width=(getattr(text, "num_key_value_heads", None) or heads) * head_dim,
        vocab=text.vocab_size, lora_params_per_rank=lora, linear_params=linear(model),
        layer_linear_params=max(linear(layer) for layer in layers))


class _PerToken(NamedTuple):
    """Bytes per token of a micro-batch."""

    layer: int
    """What one decoder layer saves for its backward."""
    head: int
    """What the embedding, the final norm, the LM head and the loss save."""
    logits: int
    """The loss's transient: the logits and their shifted copy."""
    backward: int
    """A layer's backward temporaries at their peak (the MLP's two input gradients and
    one hidden-sized gradient: 2i + h, measured)."""


def _per_token(shape: Shape, setup: Setup) -> _PerToken:
    h, i = shape.hidden, shape.intermediate
    per_layer = 8 * h + 4 * i + 2 * shape.kv_width
    head = 4 * (3 * h + shape.vocab)  # log-softmax's output is fp32 everywhere
    if setup.gpu:  # bf16 autocast (2 bytes), the norms in fp32; bf16 logits, fp32 copy
        return _PerToken(2 * per_layer + 8 * h, head, (2 + 4) * shape.vocab, 2 * (2 * i + h))
    return _PerToken(4 * per_layer, head, (4 + 4) * shape.vocab, 4 * (2 * i + h))


def activation_bytes(shape: Shape, setup: Setup) -> float:
    """What one micro-batch's forward saves for its backward (what
    `memory.ActivationMeter` measures)."""
    t = _per_token(shape, setup)
    # Under activation checkpointing a layer keeps only its input, for the recompute.
    layer = (2 if setup.gpu else 4) * shape.hidden if setup.activation_checkpointing else t.layer
    return float(setup.micro_batch * setup.seq_len * (shape.layers * layer + t.head))


def transient_bytes(shape: Shape, setup: Setup) -> float:
    """What the step's peak holds on top of the saved activations: at the loss, its
    logits; or, when larger, in the last layer's backward (the loss's tensors freed by
    then), that layer's gradient temporaries, plus its recompute under activation
    checkpointing."""
    t = _per_token(shape, setup)
    in_layer = t.backward + (t.layer if setup.activation_checkpointing else 0) - t.head
    return float(setup.micro_batch * setup.seq_len * max(t.logits, in_layer))


def copy_bytes(shape: Shape, setup: Setup, adapter: int) -> float:
    """Autocast's bf16 copies of the linear weights under ddp and zero1 on a GPU: a
    trainable weight's copy is cached for the whole step, a frozen one's saved for the
    backward — under activation checkpointing only outside the layers and for the
    layer being recomputed."""
    if not setup.gpu or not setup.strategy.uses_autocast:
        return 0.0
    if setup.lora_rank is None:
        return 2.0 * shape.linear_params
    frozen = shape.linear_params
    if setup.activation_checkpointing:
        frozen -= (shape.layers - 1) * shape.layer_linear_params
    return 2.0 * (frozen + adapter)


def estimate(shape: Shape, setup: Setup) -> Estimate:
    n = setup.world_size
    p = shape.params
    act = activation_bytes(shape, setup), transient_bytes(shape, setup)
    a = shape.lora_params_per_rank * setup.lora_rank if setup.lora_rank is not None else 0
    copies = copy_bytes(shape, setup, a)
    if setup.strategy.shards_params:
        compute = 2 if setup.gpu else 4
        root = p - shape.layers * shape.layer_params
        if setup.reshard_after_forward:  # this layer, the prefetched next one, the root
            gathered = compute * (2 * shape.layer_params + root)
        else:  # every layer stays gathered from its forward to its backward
            gathered = compute * p
        if setup.lora_rank is not None:  # frozen base: gradients for the adapter only
            return Estimate(4 * (p + a) / n, 4 * a / n, 8 * a / n, float(gathered), *act)
        gathered += 4 * shape.layer_params  # one layer's full gradients before reduce-scatter
        return Estimate(4 * p / n, 4 * p / n, 8 * p / n, float(gathered), *act)
    if setup.lora_rank is not None:
        opt = 8 * a / (n if setup.strategy.shards_optimizer else 1)
        return Estimate(4 * (p + a), 4 * a, opt, 0.0, *act, copies=copies)
    opt = 8 * p / (n if setup.strategy.shards_optimizer else 1)
    return Estimate(4 * p, 4 * p, opt, 0.0, *act, copies=copies)


def device_memory(local_ranks: int, override_gib: float | None) -> tuple[float, str]:
    """Bytes one rank may use and where the figure comes from."""
    if override_gib is not None:
        return override_gib * GIB, f"{override_gib:g} GiB per device (--device-memory-gib)"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.name}, {props.total_memory / GIB:.0f} GiB"
    import psutil

    ram = psutil.virtual_memory().total
    return ram / local_ranks, (f"no GPU: RAM {ram / GIB:.0f} GiB / {local_ranks} ranks "
                               "on this node")


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GIB:,.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:,.1f} MiB"


def _verdict(total: float, budget: float) -> str:
    return "fits" if total <= HEADROOM * budget else "does NOT fit"


def format_plan(model: str, shape: Shape, setup: Setup, budget: float, where: str) -> str:
    chosen = estimate(shape, setup)
    what = setup.strategy.name + (f" + LoRA rank {setup.lora_rank}" if setup.lora_rank else "")
    lines = [
        f"memory plan for {model}: {_count(shape.params)} parameters, {shape.layers} "
        f"layers" + (f", adapter {_count(shape.lora_params_per_rank * setup.lora_rank)} "
                     "parameters" if setup.lora_rank else ""),
        f"  {what}, world size {setup.world_size}, micro-batch {setup.micro_batch} x "
        f"{setup.seq_len} tokens, {'bf16 autocast (GPU)' if setup.gpu else 'fp32 (CPU)'}"
        + (", activation checkpointing" if setup.activation_checkpointing else "")
        + ("" if not setup.strategy.shards_params or setup.reshard_after_forward
           else ", no reshard after forward"),
        "",
        f"  {'per rank':<22}{'bytes':>14}",
    ]
    for label, value in (("weights", chosen.weights), ("gradients", chosen.grads),
                         ("optimizer (AdamW)", chosen.optimizer),
                         ("gathered parameters", chosen.gathered),
                         ("bf16 weight copies", chosen.copies),
                         ("activations", chosen.activations),
                         ("peak transient", chosen.transient), ("total", chosen.total)):
        lines.append(f"  {label:<22}{_fmt(value):>14}")
    lines += [f"  device: {where}; {_verdict(chosen.total, budget)} "
              f"(keeping {100 - 100 * HEADROOM:.0f}% headroom)", "",
              "  the other strategies, same batch:"]
    others = [replace(setup, strategy=s, lora_rank=None) for s in (DDP, ZERO1, FSDP)]
    others += [replace(setup, strategy=s, lora_rank=setup.lora_rank or 16) for s in (DDP, FSDP)]
    for other in others:
        if other == setup:
            continue
        name = other.strategy.name + (f" + LoRA rank {other.lora_rank}" if other.lora_rank else "")
        e = estimate(shape, other)
        lines.append(f"  {name:<22}{_fmt(e.total):>14}  {_verdict(e.total, budget)}")
    return "\n".join(lines)


def run_plan(cfg: FinetuneConfig, device_memory_gib: float | None,
             device: str | None = None) -> int:
    """`dpserve finetune --plan`: print the plan; exit 2 with one line if it cannot."""
    from dpserve.replicas.launcher import visible_gpus

    gpus = len(visible_gpus())
    local = cfg.nproc_per_node or gpus or DEFAULT_CPU_PROCS
    if device_memory_gib is not None and device_memory_gib <= 0:
        print("dpserve finetune: device_memory_gib: must be > 0", file=sys.stderr)
        return 2
    try:
        shape = model_shape(cfg.model, lora_targets(cfg))
    except (PlanError, OSError, ValueError) as exc:
        print(f"dpserve finetune: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    setup = Setup(strategy=Strategy.named(cfg.strategy), world_size=local * cfg.nnodes,
                  micro_batch=cfg.micro_batch_size, seq_len=cfg.max_seq_len,
                  gpu=device == "gpu" if device is not None else gpus > 0,
                  activation_checkpointing=cfg.activation_checkpointing,
                  reshard_after_forward=cfg.reshard_after_forward, lora_rank=cfg.lora_rank)
    budget, where = device_memory(local, device_memory_gib)
    print(format_plan(cfg.model, shape, setup, budget, where))
    return 0
