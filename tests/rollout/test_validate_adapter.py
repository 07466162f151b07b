"""Adapter validation refuses, with a message naming the culprit, every LoRA adapter the
replicas of the tiny model must not load; adapters are built here from the tiny model's
real linear layer shapes and written with the real checkpoint writer."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpserve import checkpoint as ckpt
from dpserve.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from dpserve.rollout.snapshot import SnapshotStore
from dpserve.rollout.validate import Refused
from dpserve.rollout.validate_adapter import AdapterInfo, validate_adapter
from tests.rollout.checkpoints import (
    DOWN_PROJ,
    PREFIX,
    Q_PROJ,
    RANK,
    Arrays,
    write_adapter,
)


@pytest.fixture(scope="module")
def served_fingerprint(tiny_model: Path) -> str:
    return ckpt.base_fingerprint(tiny_model)


def validate(tiny_model: Path, fp: str, adapter: tuple[Path, ckpt.CheckpointMeta],
             max_lora_rank: int = 16) -> AdapterInfo:
    return validate_adapter(adapter[0], adapter[1], served_base=tiny_model,
                            served_fingerprint=fp, max_lora_rank=max_lora_rank)


def refusal(tiny_model: Path, fp: str, adapter: tuple[Path, ckpt.CheckpointMeta],
            max_lora_rank: int = 16) -> Refused:
    with pytest.raises(Refused) as exc:
        validate(tiny_model, fp, adapter, max_lora_rank)
    assert "\n" not in exc.value.message
    return exc.value


def test_an_adapter_of_the_served_base_passes_and_says_what_the_replicas_load(
        tiny_model, served_fingerprint, tmp_path):
    ckpt_dir, _ = write_adapter(tiny_model, tmp_path / "out")
    snapshot, meta = SnapshotStore(tmp_path / "snapshots").take(ckpt_dir, within=tmp_path)
    info = validate_adapter(snapshot, meta, served_base=tiny_model,
                            served_fingerprint=served_fingerprint, max_lora_rank=RANK)
    assert info.path == str(snapshot.resolve())
    assert info.version.startswith("step-000007@") and len(info.version) == 20
    assert (info.rank, info.alpha, info.targets) == (RANK, 8.0, ("down_proj", "q_proj"))
    assert info.base_fingerprint == served_fingerprint


def test_features_vllm_serves_pass(tiny_model, served_fingerprint, tmp_path):
    adapter = write_adapter(tiny_model, tmp_path, targets=("self_attn.q_proj",), config={
        "use_rslora": True, "init_lora_weights": "gaussian", "lora_dropout": 0.1})
    assert validate(tiny_model, served_fingerprint, adapter).targets == ("self_attn.q_proj",)


def test_the_router_can_import_it_without_torch():
    code = ("import sys, dpserve.rollout.validate_adapter; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("kind", ["full", None])  # None: written before kinds existed
def test_a_full_checkpoint_is_refused_pointing_to_a_deploy_without_name(
        tiny_model, served_fingerprint, tmp_path, kind):
    adapter = write_adapter(tiny_model, tmp_path, extra={"kind": kind})
    error = refusal(tiny_model, served_fingerprint, adapter)
    assert error.status == 422 and error.param == "checkpoint"
    assert "is a full checkpoint, not a LoRA adapter: deploy it without --name" in error.message


def test_another_kind_is_refused_naming_it(tiny_model, served_fingerprint, tmp_path):
    error = refusal(tiny_model, served_fingerprint,
                    write_adapter(tiny_model, tmp_path, extra={"kind": "prefix-tuning"}))
    assert error.status == 422 and "'prefix-tuning'" in error.message


def unreadable_configs() -> list[Any]:
    def replace(text: str | None) -> Callable[[Path], None]:
        def edit(tmp: Path) -> None:
            (tmp / ADAPTER_CONFIG).unlink()
            if text is not None:
                (tmp / ADAPTER_CONFIG).write_text(text)
        return edit
    return [pytest.param(replace(None), "missing", id="missing"),
            pytest.param(replace("{r: 4"), "not valid JSON", id="not-json"),
            pytest.param(replace("[1, 2]"), "must hold a JSON object", id="not-object"),
            pytest.param(replace("{}" + " " * (1024 * 1024)), "larger than", id="too-large")]


@pytest.mark.parametrize(("files", "message"), unreadable_configs())
def test_an_unreadable_adapter_config_is_refused(tiny_model, served_fingerprint, tmp_path,
                                                 files, message):
    error = refusal(tiny_model, served_fingerprint, write_adapter(tiny_model, tmp_path,
                                                                  files=files))
    assert error.status == 422
    assert error.message.startswith(str(tmp_path / "step-000007" / ADAPTER_CONFIG))
    assert message in error.message


@pytest.mark.parametrize(("config", "message"), [
    ({"peft_type": "LOHA"}, "peft_type is 'LOHA', not 'LORA'"),
    ({"r": 0}, "r must be a positive integer, not 0"),
    ({"r": True}, "r must be a positive integer, not True"),
    ({"r": "4"}, "r must be a positive integer, not '4'"),
    ({"lora_alpha": None}, "lora_alpha must be a finite number, not None"),
    ({"target_modules": r".*\.q_proj"}, "target_modules is a regular expression"),
    ({"target_modules": []}, "target_modules must be a non-empty list of module names"),
    ({"target_modules": ["q_proj", 3]}, "target_modules must be a non-empty list"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern is set; dpserve adapters have one rank"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern is set"),
])
def test_an_adapter_config_that_is_not_a_plain_lora_is_refused_naming_the_key(
        tiny_model, served_fingerprint, tmp_path, config, message):
    error = refusal(tiny_model, served_fingerprint, write_adapter(tiny_model, tmp_path,
                                                                  config=config))
    assert error.status == 422 and f"{ADAPTER_CONFIG}: {message}" in error.message


@pytest.mark.parametrize(("extra", "message"), [
    ({"lora_rank": 8}, "r is 4, but the manifest says lora_rank 8"),
    ({"lora_alpha": 16.0}, "lora_alpha is 8.0, but the manifest says lora_alpha 16.0"),
    ({"lora_targets": ["q_proj"]}, "target_modules is ['down_proj', 'q_proj'], but the "
                                   "manifest says lora_targets ['q_proj']"),
])
def test_an_adapter_config_that_disagrees_with_the_manifest_is_refused(
        tiny_model, served_fingerprint, tmp_path, extra, message):
    error = refusal(tiny_model, served_fingerprint, write_adapter(tiny_model, tmp_path,
                                                                  extra=extra))
    assert error.status == 422 and message in error.message


@pytest.mark.parametrize(("config", "key"), [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "use_dora"),
    ({"bias": "lora_only"}, "bias"),
    ({"lora_bias": True}, "lora_bias"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    ({"layer_replication": [[0, 2]]}, "layer_replication"),
    ({"use_bdlora": {"block": 2}}, "use_bdlora"),
    ({"use_qalora": True}, "use_qalora"),
])
def test_features_vllm_cannot_serve_are_refused_naming_the_key(
        tiny_model, served_fingerprint, tmp_path, config, key):
    error = refusal(tiny_model, served_fingerprint, write_adapter(tiny_model, tmp_path,
                                                                  config=config))
    assert error.status == 422
    assert f"{ADAPTER_CONFIG}: {key} is {config[key]!r}, which vLLM cannot" in error.message


def test_an_adapter_without_a_base_fingerprint_is_refused(tiny_model, served_fingerprint,
                                                          tmp_path):
    adapter = write_adapter(tiny_model, tmp_path, extra={"base_fingerprint": None})
    error = refusal(tiny_model, served_fingerprint, adapter)
    assert error.status == 422 and "lacks base_fingerprint" in error.message


def test_an_adapter_of_another_base_is_a_conflict_naming_both(tiny_model, served_fingerprint,
                                                              tmp_path):
    other = "ab" * 32
    adapter = write_adapter(tiny_model, tmp_path, extra={"base_fingerprint": other})
    error = refusal(tiny_model, served_fingerprint, adapter)
    assert error.status == 409
    _, meta = adapter
    assert (f"adapter was trained on base {str(meta.base_model)!r} (fingerprint "
            f"{other[:12]}); the replicas serve {tiny_model} (fingerprint "
            f"{served_fingerprint[:12]})") in error.message


def test_a_rank_above_the_engines_limit_is_a_conflict_saying_how_to_raise_it(
        tiny_model, served_fingerprint, tmp_path):
    adapter = write_adapter(tiny_model, tmp_path, rank=8)
    error = refusal(tiny_model, served_fingerprint, adapter, max_lora_rank=4)
    assert error.status == 409
    assert "rank 8 is above the replicas' --max-lora-rank 4" in error.message
    assert "start `dpserve serve` with --max-lora-rank 8" in error.message


def test_a_target_that_is_no_linear_layer_of_the_served_base_is_a_conflict(
        tiny_model, served_fingerprint, tmp_path):
    adapter = write_adapter(tiny_model, tmp_path, targets=("q_proj", "qkv_proj"))
    error = refusal(tiny_model, served_fingerprint, adapter)
    assert error.status == 409
    assert f"target 'qkv_proj' matches no linear layer of the served base {tiny_model}" \
        in error.message


def added(name: str, array: np.ndarray) -> Callable[[Arrays], Arrays]:
    return lambda t: {**t, name: array}


def changed(name: str, edit: Callable[[np.ndarray], np.ndarray]) -> Callable[[Arrays], Arrays]:
    return lambda t: {**t, name: edit(t[name])}


def nan_at_end(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flat[-1] = np.nan
    return a


A_Q = f"{PREFIX}{Q_PROJ}.lora_A.weight"
B_Q = f"{PREFIX}{Q_PROJ}.lora_B.weight"
B_DOWN = f"{PREFIX}{DOWN_PROJ}.lora_B.weight"


@pytest.mark.parametrize(("tensors", "message"), [
    pytest.param(lambda t: {}, "holds no tensors", id="empty"),
    pytest.param(added(f"{PREFIX}{Q_PROJ}.lora_magnitude_vector", np.ones(128, np.float32)),
                 f"tensor {PREFIX}{Q_PROJ}.lora_magnitude_vector is not a LoRA factor",
                 id="dora-magnitude"),
    pytest.param(added("model.layers.0.self_attn.q_proj.lora_A.weight",
                       np.zeros((RANK, 128), np.float32)),
                 "tensor model.layers.0.self_attn.q_proj.lora_A.weight is not a LoRA factor",
                 id="no-peft-prefix"),
    pytest.param(added(f"{PREFIX}model.layers.7.self_attn.q_proj.lora_A.weight",
                       np.zeros((RANK, 128), np.float32)),
                 "adapts model.layers.7.self_attn.q_proj, which is not a linear layer of "
                 "the served base", id="no-such-layer"),
    pytest.param(added(f"{PREFIX}model.layers.0.self_attn.k_proj.lora_A.weight",
                       np.zeros((RANK, 128), np.float32)),
                 "adapts model.layers.0.self_attn.k_proj, which no entry of target_modules "
                 "names", id="not-targeted"),
    pytest.param(changed(A_Q, lambda a: a[:, :64]),
                 f"tensor {A_Q} has shape [4, 64], rank 4 on a [128, 128] layer needs [4, 128]",
                 id="lora-a-shape"),
    pytest.param(changed(B_DOWN, lambda a: np.zeros((128, 8), np.float32)),
                 f"tensor {B_DOWN} has shape [128, 8], rank 4 on a [128, 256] layer needs "
                 "[128, 4]", id="lora-b-rank"),
    pytest.param(lambda t: {k: v for k, v in t.items() if k != B_Q},
                 f"tensor {A_Q} has no lora_B.weight", id="unpaired"),
    pytest.param(changed(B_Q, lambda a: a.astype(np.int32)),
                 f"tensor {B_Q} has dtype I32, not a floating-point type", id="int"),
    pytest.param(changed(B_DOWN, nan_at_end), f"tensor {B_DOWN} holds NaN", id="nan"),
    pytest.param(changed(A_Q, lambda a: (a * np.inf).astype(np.float16)),
                 f"tensor {A_Q} holds NaN or infinite values", id="inf-f16"),
])
def test_adapter_weights_that_do_not_fit_the_served_base_are_refused_naming_the_tensor(
        tiny_model, served_fingerprint, tmp_path, tensors, message):
    error = refusal(tiny_model, served_fingerprint, write_adapter(tiny_model, tmp_path,
                                                                  tensors=tensors))
    assert error.status == 422 and message in error.message


def test_adapter_weights_that_are_not_safetensors_are_refused(tiny_model, served_fingerprint,
                                                              tmp_path):
    adapter = write_adapter(tiny_model, tmp_path, files=lambda tmp: (
        tmp / ADAPTER_WEIGHTS).write_bytes(b"PK\x03\x04 not safetensors"))
    error = refusal(tiny_model, served_fingerprint, adapter)
    assert error.status == 422
    assert f"{ADAPTER_WEIGHTS}: not a safetensors file" in error.message
