"""Validation refuses, with a message naming the problem, every checkpoint that a
running replica of the tiny model must not load."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from dpserve.checkpoint import META_FILE
from dpserve.rollout.deployed import weights_for
from dpserve.rollout.validate import (
    ModelFingerprint,
    Refused,
    fingerprint,
    read_safetensors_header,
    validate_checkpoint,
)
from tests.rollout.checkpoints import edit_json, other_vocabulary, perturbed, write_variant


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> ModelFingerprint:
    return fingerprint(tiny_model)


def refusal(ckpt_dir: Path, served: ModelFingerprint) -> Refused:
    with pytest.raises(Refused) as exc:
        validate_checkpoint(ckpt_dir, served)
    return exc.value


def test_a_finetuned_checkpoint_of_the_served_model_passes(tiny_model, served, tmp_path):
    ckpt_dir = write_variant(tiny_model, tmp_path, 7, tensors=perturbed(0.01, seed=1))
    meta = validate_checkpoint(ckpt_dir, served)
    assert meta.step == 7
    version = weights_for(str(ckpt_dir)).version
    assert version.startswith("step-000007@") and len(version) == len("step-000007@") + 8


def test_headers_are_read_without_loading_the_tensors(tiny_model):
    tensors = read_safetensors_header(tiny_model / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    assert (embed.dtype, embed.shape) == ("F32", (1024, 128))


def test_a_directory_without_metadata_is_not_a_checkpoint(tiny_model, served):
    error = refusal(tiny_model, served)
    assert error.status == 422 and f"no {META_FILE}" in error.message


def test_a_file_that_does_not_match_its_sha256_is_refused(tiny_model, served, tmp_path):
    ckpt_dir = write_variant(tiny_model, tmp_path, 1, tensors=perturbed(0.01, seed=1))
    weights = ckpt_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte inside a tensor
    weights.write_bytes(bytes(data))
    error = refusal(ckpt_dir, served)
    assert error.status == 422
    assert "model.safetensors does not match its sha256" in error.message


def test_a_missing_directory_is_refused(served, tmp_path):
    error = refusal(tmp_path / "step-000001", served)
    assert error.status == 422 and "no such directory" in error.message


def test_other_shapes_are_refused_naming_the_tensor(tiny_model, served, tmp_path):
    def wider_mlp(t):
        return {**t, "model.layers.0.mlp.up_proj.weight": torch.zeros(512, 128)}
    error = refusal(write_variant(tiny_model, tmp_path, 1, tensors=wider_mlp), served)
    assert error.status == 409
    assert ("tensor model.layers.0.mlp.up_proj.weight has shape [512, 128] in the checkpoint, "
            "[256, 128] in the served model") in error.message


def test_another_config_is_refused_naming_the_key(tiny_model, served, tmp_path):
    ckpt_dir = write_variant(tiny_model, tmp_path, 1, files=lambda d: edit_json(
        d / "config.json", lambda c: c.update(rms_norm_eps=1e-5)))
    error = refusal(ckpt_dir, served)
    assert error.status == 409
    assert "config.json: rms_norm_eps is 1e-05 in the checkpoint, 1e-06" in error.message


def test_another_vocabulary_is_refused(tiny_model, served, tmp_path):
    error = refusal(write_variant(tiny_model, tmp_path, 1, files=other_vocabulary), served)
    assert error.status == 409
    assert "tokenizer: tokenizer.json differs from the served model's" in error.message


def test_a_larger_vocabulary_names_config_and_tensors(tiny_model, served, tmp_path):
    def grow(t):
        return {k: torch.cat([v, v[:8]]) if k in ("model.embed_tokens.weight", "lm_head.weight")
                else v for k, v in t.items()}
    ckpt_dir = write_variant(tiny_model, tmp_path, 1, tensors=grow, files=lambda d: edit_json(
        d / "config.json", lambda c: c.update(vocab_size=1032)))
    error = refusal(ckpt_dir, served)
    assert "vocab_size is 1032 in the checkpoint, 1024" in error.message
    assert "tensor lm_head.weight has shape [1032, 128]" in error.message


def test_missing_and_extra_tensors_are_named(tiny_model, served, tmp_path):
    def rename(t):
        t = dict(t)
        t["model.norm.scale"] = t.pop("model.norm.weight")
        return t
    error = refusal(write_variant(tiny_model, tmp_path, 1, tensors=rename), served)
    assert "tensor model.norm.weight is missing from the checkpoint" in error.message
    assert "tensor model.norm.scale is not in the served model" in error.message


def test_another_dtype_is_refused(tiny_model, served, tmp_path):
    def half(t):
        return {k: v.to(torch.bfloat16) for k, v in t.items()}
    error = refusal(write_variant(tiny_model, tmp_path, 1, tensors=half), served)
    assert error.status == 409 and "has dtype BF16 in the checkpoint, F32" in error.message
    assert "(and " in error.message  # many tensors differ: the message stays short


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_weights_are_refused(tiny_model, tmp_path, bad, dtype):
    def diverged(t):
        t = {k: v.to(dtype) for k, v in t.items()}
        t["model.layers.1.self_attn.o_proj.weight"][3, 5] = bad
        return t
    ckpt_dir = write_variant(tiny_model, tmp_path, 1, tensors=diverged)
    served_same_dtype = fingerprint(ckpt_dir)  # only finiteness differs from "served"
    error = refusal(ckpt_dir, served_same_dtype)
    assert error.status == 422
    assert "model.layers.1.self_attn.o_proj.weight holds NaN or infinite" in error.message


def test_a_truncated_safetensors_header_is_refused(tiny_model, served, tmp_path):
    def truncate(d: Path) -> None:
        (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    error = refusal(write_variant(tiny_model, tmp_path, 1, files=truncate), served)
    assert error.status == 422 and "not a safetensors file" in error.message


@pytest.mark.parametrize(("kind", "message"), [
    ("lora", "is a LoRA adapter (kind lora), not full weights; serve it beside the base "
             "with `dpserve deploy CHECKPOINT --name NAME`"),
    ("qlora", "holds kind 'qlora' (see extra in dpserve.json), not full weights"),
])
def test_an_adapter_checkpoint_is_refused_where_full_weights_are_needed(served, tmp_path,
                                                                        kind, message):
    from dpserve.checkpoint import write_checkpoint

    def adapter(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}\n')
        (tmp / "adapter_model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}      ")

    ckpt_dir = write_checkpoint(tmp_path, 3, adapter, base_model="base", loss=None,
                                world_size=1, extra={"kind": kind, "lora_rank": 4})
    error = refusal(ckpt_dir, served)
    assert error.status == 422
    assert error.message.startswith(f"{ckpt_dir}: {message}")
