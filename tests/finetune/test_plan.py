"""`dpserve finetune --plan` estimates what training then measures.

Weights, gradients and optimizer state are counted exactly; activations come from a
per-token formula, checked here against what autograd actually saves
(`memory.ActivationMeter`) on models of different shapes, within 25%. The sharded
strategies' per-rank numbers are checked against real 2-rank runs in
test_strategies.py and test_lora.py (`finetune_helpers.plan_matches`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpserve.finetune.memory import ActivationMeter, state_bytes
from dpserve.finetune.plan import Setup, activation_bytes, estimate, model_shape
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


def measured_activations(model_dir: Path, batch: int, seq: int) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(4, 500, (batch, seq))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with ActivationMeter() as meter:
        token_loss_sum(model, data).backward()
    return meter.peak_bytes


@pytest.mark.parametrize(("which", "batch", "seq"), [
    ("tiny", 4, 64), ("tiny", 2, 256), ("gqa", 2, 128), ("gqa", 1, 512)])
def test_the_activation_estimate_is_within_25_percent_of_what_autograd_saves(
        tiny_model, gqa_model, which, batch, seq):
    model = tiny_model if which == "tiny" else gqa_model
    planned = activation_bytes(model_shape(str(model), TARGETS),
                               Setup("ddp", 1, batch, seq, gpu=False))
    measured = measured_activations(model, batch, seq)
    assert abs(planned - measured) <= TOLERANCE * measured, (planned, measured)


def test_the_state_estimate_is_what_one_ddp_rank_holds(gqa_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gqa_model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(4, 500, (1, 16))
    token_loss_sum(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                           "labels": ids}).backward()
    optimizer.step()
    held = state_bytes(model, optimizer)
    planned = estimate(model_shape(str(gqa_model), TARGETS), Setup("ddp", 1, 1, 1, gpu=False))
    # AdamW's step counters (one 4-byte tensor per parameter) are the only extra.
    assert planned.weights == held["weights"] and planned.grads == held["grads"]
    assert 0 <= held["optimizer"] - planned.optimizer <= 4 * len(list(model.parameters()))


def plan(model: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpserve", "finetune", "--plan", "--model",
                           str(model), *flags], capture_output=True, text=True, timeout=120)


def test_plan_prints_every_strategy_and_a_verdict_without_training(gqa_model, tmp_path):
    done = plan(gqa_model, "--strategy", "fsdp", "--nproc-per-node", "4", "--micro-batch-size",
                "2", "--max-seq-len", "128", "--device-memory-gib", "0.05", "--output",
                str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "fsdp, world size 4, micro-batch 2 x 128 tokens, fp32 (CPU)" in out
    for row in ("weights", "gradients", "optimizer (AdamW)", "gathered parameters",
                "activations", "total"):
        assert f"  {row} " in out
    for other in ("ddp ", "zero1 ", "ddp + LoRA rank 16", "fsdp + LoRA rank 16"):
        assert f"\n  {other}" in out
    # 51 MiB less 10% headroom: fsdp (43 MiB) and LoRA (34 MiB) fit, ddp (68 MiB) does not.
    assert "; fits (keeping 10% headroom)" in out
    assert re.search(r"\n  ddp +[\d.]+ MiB  does NOT fit", out)
    assert re.search(r"\n  ddp \+ LoRA rank 16 +[\d.]+ MiB  fits", out)
    assert not (tmp_path / "out").exists()


def test_an_8b_llama_plan_matches_the_known_sizes():
    """Meta-Llama-3-8B (from its config alone): ~16 bytes per parameter under ddp, an
    eighth of that per rank under fsdp on 8 GPUs."""
    config = Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3-8b"
    shape = model_shape(str(config), TARGETS)
    assert 8.0e9 < shape.params < 8.1e9
    ddp = estimate(shape, Setup("ddp", 8, 1, 4096, gpu=True))
    fsdp = estimate(shape, Setup("fsdp", 8, 1, 4096, gpu=True))
    assert ddp.weights + ddp.grads + ddp.optimizer == 16 * shape.params
    assert fsdp.weights + fsdp.grads + fsdp.optimizer == 2 * shape.params


def test_plan_on_a_directory_without_config_is_one_line(tmp_path):
    done = plan(tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == f"dpserve finetune: model: {tmp_path} has no config.json"
