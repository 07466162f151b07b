"""`dpserve finetune --plan` estimates what training then measures.

Weights, gradients and optimizer state are counted exactly; activations come from a
per-token formula, checked here against what autograd actually saves
(`memory.ActivationMeter`) and against the step's measured peak (`memory.LiveMeter`)
on models of different shapes, with and without activation checkpointing, within
25%. Every strategy's state is checked on a world of one here, and the sharded
strategies' per-rank numbers against real 2-rank runs in test_strategies.py and
test_lora.py (`finetune_helpers.plan_matches`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dpserve.finetune.config import FinetuneConfig
from dpserve.finetune.dist import Dist
from dpserve.finetune.memory import ActivationMeter, LiveMeter, state_bytes
from dpserve.finetune.plan import (
    Setup,
    activation_bytes,
    estimate,
    model_shape,
    transient_bytes,
)
from dpserve.finetune.sharding import DDP, FSDP, ZERO1, Strategy
from dpserve.finetune.train import token_loss_sum
from tests.finetune_helpers import LORA_TARGETS as TARGETS

TOLERANCE = 0.25


def tiny_llama(model_dir: Path, **shape: int) -> Path:
    """A randomly initialised Llama of `shape` saved to `model_dir` (config + weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=1024, tie_word_embeddings=False, **shape)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("gqa"), hidden_size=256, intermediate_size=704,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=2048)


@pytest.fixture(scope="module")
def wide_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shaped like a real Llama where it matters for memory: the vocabulary is 83 x the
    hidden size (Llama 3 8B: 31 x), so the loss's logits outweigh the layers."""
    from transformers import LlamaConfig

    model_dir = tmp_path_factory.mktemp("wide-vocab")
    LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=6, num_key_value_heads=2, vocab_size=32000,
                max_position_embeddings=1024, tie_word_embeddings=False,
                ).save_pretrained(model_dir)  # the config alone: weights are random here
    return model_dir


@pytest.fixture(scope="module")
def narrow_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The other extreme: a wide MLP and a small vocabulary, so a layer's backward (and
    recompute) outweighs the loss."""
    from transformers import LlamaConfig

    model_dir = tmp_path_factory.mktemp("narrow-vocab")
    LlamaConfig(hidden_size=256, intermediate_size=2048, num_hidden_layers=3,
                num_attention_heads=4, vocab_size=512, max_position_embeddings=1024,
                tie_word_embeddings=False).save_pretrained(model_dir)
    return model_dir


def measured_activations(model_dir: Path, batch: int, seq: int, *,
                         checkpointing: bool = False) -> tuple[int, int]:
    """(bytes the forward saved, the step's peak less its gradients) for one forward and
    backward of a randomly initialised model built from `model_dir`'s config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                             dtype=torch.float32)
    model.train()
    if checkpointing:  # as strategy.wrap does it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(4, 500, (batch, seq))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with ActivationMeter() as saved, LiveMeter(model) as live:
        token_loss_sum(model, data).backward()
    return saved.peak_bytes, live.peak_bytes


@pytest.mark.parametrize(("which", "batch", "seq", "checkpointing"), [
    ("tiny", 4, 64, False), ("tiny", 2, 256, False), ("tiny", 2, 256, True),
    ("gqa", 2, 128, False), ("gqa", 1, 512, False), ("gqa", 1, 512, True),
    ("wide_vocab", 1, 256, False), ("wide_vocab", 2, 128, True),
    ("narrow_vocab", 2, 128, False), ("narrow_vocab", 2, 128, True)])
def test_the_activation_estimate_is_within_25_percent_of_what_autograd_saves_and_the_peak(
        request, which, batch, seq, checkpointing):
    model = request.getfixturevalue(f"{which}_model")
    shape = model_shape(str(model), TARGETS)
    setup = Setup(DDP, 1, batch, seq, gpu=False, activation_checkpointing=checkpointing)
    saved, peak = measured_activations(model, batch, seq, checkpointing=checkpointing)
    planned = activation_bytes(shape, setup)
    assert abs(planned - saved) <= TOLERANCE * saved, (planned, saved)
    planned_peak = planned + transient_bytes(shape, setup)
    assert abs(planned_peak - peak) <= TOLERANCE * peak, (planned_peak, peak)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dist]:
    """A gloo process group of one rank in this process, as the trainer sets it up."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "rendezvous"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    try:
        yield Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("strategy", "lora_rank"), [
    ("ddp", None), ("zero1", None), ("fsdp", None), ("ddp", 8), ("fsdp", 8)])
def test_the_state_estimate_is_what_a_rank_holds_and_fsdp_saves_no_parameters(
        gqa_model, world_of_one, strategy, lora_rank):
    """Wrapped as the trainer wraps it, one step: weights and gradients are exactly the
    plan's, the optimizer state too but for AdamW's step counters (4 bytes per
    parameter tensor); fsdp's gathered parameters do not count as activations."""
    from transformers import AutoModelForCausalLM

    from dpserve.finetune import lora
    from dpserve.finetune.strategy import wrap

    cfg = FinetuneConfig(model=str(gqa_model), data="", output="", strategy=strategy,
                         lora_rank=lora_rank)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.float32)
    if lora_rank is not None:
        model = lora.apply_lora(model, cfg)
    par = wrap(model, cfg, world_of_one)
    ids = torch.randint(4, 500, (2, 64))
    with ActivationMeter() as saved:
        token_loss_sum(par.forward, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                     "labels": ids}).backward()
    par.optimizer.step()
    held = state_bytes(par.model, par.optimizer)
    shape = model_shape(str(gqa_model), TARGETS)
    planned = estimate(shape, Setup(Strategy.named(strategy), 1, 2, 64, gpu=False,
                                    lora_rank=lora_rank))
    assert (planned.weights, planned.grads) == (held["weights"], held["grads"])
    trained = sum(1 for p in par.model.parameters() if p.requires_grad)
    assert 0 <= held["optimizer"] - planned.optimizer <= 4 * trained
    if lora_rank is None:  # the adapter's own activations are not in the formula
        assert abs(saved.peak_bytes - planned.activations) <= 0.02 * planned.activations


def plan(model: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpserve", "finetune", "--plan", "--model",
                           str(model), *flags], capture_output=True, text=True, timeout=120)


def test_plan_prints_every_strategy_and_a_verdict_without_training(gqa_model, tmp_path):
    done = plan(gqa_model, "--strategy", "fsdp", "--nproc-per-node", "4", "--micro-batch-size",
                "2", "--max-seq-len", "128", "--device-memory-gib", "0.06", "--output",
                str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "fsdp, world size 4, micro-batch 2 x 128 tokens, fp32 (CPU)" in out
    for row in ("weights", "gradients", "optimizer (AdamW)", "gathered parameters",
                "activations", "peak transient", "total"):
        assert f"  {row} " in out
    for other in ("ddp ", "zero1 ", "ddp + LoRA rank 16", "fsdp + LoRA rank 16"):
        assert f"\n  {other}" in out
    # 61 MiB less 10% headroom: fsdp (47 MiB) and LoRA (38 MiB) fit, ddp (72 MiB) does not.
    assert "; fits (keeping 10% headroom)" in out
    assert re.search(r"\n  ddp +[\d.]+ MiB  does NOT fit", out)
    assert re.search(r"\n  ddp \+ LoRA rank 16 +[\d.]+ MiB  fits", out)
    assert not (tmp_path / "out").exists()


def test_an_8b_llama_plan_matches_the_known_sizes():
    """Meta-Llama-3-8B (from its config alone): ~16 bytes per parameter under ddp, an
    eighth of that per rank under fsdp on 8 GPUs."""
    config = Path(__file__).parents[2] / "benchmarks" / "finetune" / "configs" / "llama-3-8b"
    shape = model_shape(str(config), TARGETS)
    assert 8.0e9 < shape.params < 8.1e9
    ddp = estimate(shape, Setup(DDP, 8, 1, 4096, gpu=True))
    fsdp = estimate(shape, Setup(FSDP, 8, 1, 4096, gpu=True))
    assert ddp.weights + ddp.grads + ddp.optimizer == 16 * shape.params
    assert fsdp.weights + fsdp.grads + fsdp.optimizer == 2 * shape.params


def test_plan_on_a_directory_without_config_is_one_line(tmp_path):
    done = plan(tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == f"dpserve finetune: model: {tmp_path} has no config.json"


class _WeightCasts:
    """Saved-tensor hooks recording autocast's casts of trainable weights (a saved
    tensor whose autograd edge is `ToCopyBackward0` of a weight), each storage once."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is not None and type(fn).__name__ == "ToCopyBackward0":
            if hasattr(fn.next_functions[0][0], "variable"):
                self.bytes.setdefault(base.untyped_storage().data_ptr(),
                                      base.untyped_storage().nbytes())
        return t


def test_the_plan_counts_autocasts_bf16_weight_copies_under_ddp_on_a_gpu(gqa_model):
    """On a GPU ddp and zero1 compute every linear layer from a bf16 copy of its fp32
    weight, held from the forward to the backward: 2 bytes per linear weight (measured
    on an H100: exactly that). CPU autocast caches the same copies, so it checks the
    count here; fsdp's bf16 copies are its gathered parameters, and CPU runs in fp32."""
    from transformers import AutoModelForCausalLM

    shape = model_shape(str(gqa_model), TARGETS)
    model = AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.float32)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    ids = torch.randint(4, 500, (2, 32))
    casts = _WeightCasts()
    with torch.autograd.graph.saved_tensors_hooks(casts.pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        token_loss_sum(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                               "labels": ids}).backward()
    assert sum(casts.bytes.values()) == 2 * linear
    for strategy in (DDP, ZERO1):
        assert estimate(shape, Setup(strategy, 2, 1, 64, gpu=True)).copies == 2 * linear
        checkpointed = Setup(strategy, 2, 1, 64, gpu=True, activation_checkpointing=True)
        assert estimate(shape, checkpointed).copies == 2 * linear  # autocast's cache
    assert estimate(shape, Setup(FSDP, 2, 1, 64, gpu=True)).copies == 0
    assert estimate(shape, Setup(DDP, 2, 1, 64, gpu=False)).copies == 0
    lora = estimate(shape, Setup(DDP, 1, 1, 64, gpu=True, lora_rank=8))
    assert lora.copies == 2 * (linear + 8 * shape.lora_params_per_rank)
    gpu = estimate(shape, Setup(DDP, 1, 1, 64, gpu=True))
    assert gpu.total == pytest.approx(gpu.weights + gpu.grads + gpu.optimizer + gpu.copies
                                      + gpu.activations + gpu.transient)


@pytest.mark.parametrize("frozen", [False, True])
def test_autocasts_weight_copies_are_not_counted_as_activations(frozen):
    """Under autocast a linear layer saves a bf16 copy of its weight (cached when the
    weight trains, made per call when it is frozen, as LoRA's base): the plan's copies,
    not activations. Its input's bf16 copy, saved for the weight's gradient, is one."""
    layer = torch.nn.Linear(512, 512, bias=False).requires_grad_(not frozen)
    x = torch.randn(2, 8, 512, requires_grad=True)
    with ActivationMeter() as saved, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x * 2).sum().backward()
    assert x.grad is not None  # the weight's copy was saved, for this gradient
    assert saved.peak_bytes == (0 if frozen else 2 * 8 * 512 * 2)  # not 512 x 512 x 2
