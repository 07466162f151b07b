"""`dpserve finetune --lora-rank`: only the adapter trains, the same on any world size,
and its checkpoint is what vLLM's LoRA loader and `dpserve export-merged` read."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpserve import checkpoint as ckpt
from dpserve.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS, base_fingerprint
from dpserve.finetune.config import FinetuneConfig, build_finetune_config
from dpserve.finetune.lora import (
    LoraError,
    adapter_meta_extra,
    adapter_state,
    apply_lora,
    check_resumable,
    check_targets,
    export_merged,
    load_adapter_weights,
    save_adapter,
)
from dpserve.rollout.validate_adapter import validate_adapter
from tests.finetune_helpers import finetune, plan_matches, trained, weights, write_train_data

STEPS = 3
RTOL = 1e-4
"""Two ranks sum gradients in another order than one (Gloo's all-reduce): float32
noise, 1.9e-5 seen on an AMD EPYC where 1e-5 held on other CPUs. A real fault (a
gradient not averaged, or averaged twice) is off by far more after 3 steps at lr 1e-2."""
LORA = {"lora_rank": 4, "lora_alpha": 8, "lr": 1e-2}


@pytest.fixture(scope="module")
def train_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_train_data(tmp_path_factory.mktemp("data") / "train.jsonl")


@pytest.fixture(scope="module")
def base(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model the tests may change."""
    copy = tmp_path_factory.mktemp("base") / "tiny"
    shutil.copytree(tiny_model, copy)
    return copy


@pytest.fixture(scope="module")
def adapter_world_2(base, train_data, tmp_path_factory) -> Path:
    return trained(base, train_data, tmp_path_factory.mktemp("lora2"), nproc=2,
                   micro_batch_size=4, max_steps=STEPS, **LORA)


def adapter(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt_dir / ADAPTER_WEIGHTS))


@pytest.fixture(scope="module")
def adapter_world_1(base, train_data, tmp_path_factory) -> Path:
    return trained(base, train_data, tmp_path_factory.mktemp("lora1"), nproc=1,
                   micro_batch_size=8, max_steps=STEPS, **LORA)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)


def test_lora_on_two_ranks_trains_the_adapter_one_rank_trains(adapter_world_1,
                                                              adapter_world_2):
    a, b = adapter(adapter_world_2), adapter(adapter_world_1)
    assert any("lora_B" in k for k in a)
    assert max(float(b[k].abs().max()) for k in b if "lora_B" in k) > 1e-4  # it trained
    assert max_rel_diff(a, b) <= RTOL


def test_lora_under_fsdp_trains_the_same_adapter_and_resumes_on_one_rank(
        base, train_data, tmp_path, adapter_world_1):
    """The frozen base is sharded too (what a 70B adapter needs); its sharded training
    state holds the adapter and its optimizer state only, and reshards on resume."""
    half = trained(base, train_data, tmp_path, nproc=2, micro_batch_size=4,
                   max_steps=STEPS, strategy="fsdp", stop_after_steps=1, **LORA)
    state = ckpt.train_state_dir(tmp_path, 1)
    assert state is not None and ckpt.read_meta(half).extra["strategy"] == "fsdp"
    dcp_bytes = sum(p.stat().st_size for p in (state / "dcp").iterdir())
    assert dcp_bytes < 0.2 * (base / "model.safetensors").stat().st_size  # no base weights
    resumed = trained(base, train_data, tmp_path, nproc=1, micro_batch_size=8,
                      max_steps=STEPS, strategy="fsdp", resume=True, **LORA)
    assert max_rel_diff(adapter(resumed), adapter(adapter_world_1)) <= RTOL


def test_an_adapter_checkpoint_is_what_vllm_loads_and_says_what_it_is(base, adapter_world_2):
    meta = ckpt.verify_checkpoint(adapter_world_2)
    assert sorted(meta.files) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    extra = meta.extra
    assert (extra["kind"], extra["lora_rank"], extra["lora_alpha"]) == ("lora", 4, 8.0)
    assert extra["lora_targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"]
    assert len(extra["base_fingerprint"]) == 64
    config = json.loads((adapter_world_2 / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    # 2 layers x 7 projections x (A, B); nothing of the base model.
    names = adapter(adapter_world_2)
    assert len(names) == 28 and all("lora_" in k for k in names)
    memory = json.loads((adapter_world_2.parent / "memory.json").read_text())["ranks"][0]
    assert memory["grads"] < 0.1 * memory["weights"]  # gradients for the adapter only
    plan_matches(base, json.loads((adapter_world_2.parent / "memory.json").read_text()))


def test_export_merged_folds_the_adapter_into_the_weights(base, adapter_world_2, tmp_path):
    merged = export_merged(adapter_world_2, tmp_path)
    meta = ckpt.verify_checkpoint(merged)
    assert meta.step == STEPS and meta.extra["kind"] == "full"
    tuned, original, lora = weights(merged), weights(base), adapter(adapter_world_2)
    assert tuned.keys() == original.keys()
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = lora[f"{prefix}.lora_A.weight"], lora[f"{prefix}.lora_B.weight"]
    expected = original["model.layers.0.self_attn.q_proj.weight"] + (8 / 4) * b @ a
    assert torch.allclose(tuned["model.layers.0.self_attn.q_proj.weight"], expected,
                          atol=1e-6)
    assert torch.equal(tuned["model.embed_tokens.weight"], original["model.embed_tokens.weight"])


def test_export_merged_gives_the_logits_of_the_unmerged_adapter(base, adapter_world_2,
                                                                tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = export_merged(adapter_world_2, tmp_path)
    ids = torch.tensor([[5, 17, 42, 99, 7, 300]])
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            str(adapter_world_2)).eval()
        full = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        assert torch.allclose(full(ids).logits, peft_model(ids).logits, atol=1e-5)


def test_merge_on_save_writes_deployable_full_weights_beside_the_adapter(base, train_data,
                                                                        tmp_path):
    trained(base, train_data, tmp_path, nproc=1, micro_batch_size=4, max_steps=1,
            merge_on_save=True, **LORA)
    merged = ckpt.latest_checkpoint(tmp_path / "merged")
    assert merged is not None
    assert ckpt.verify_checkpoint(merged).extra["kind"] == "full"
    assert (merged / "model.safetensors").is_file()


def test_export_merged_refuses_what_it_cannot_merge(base, adapter_world_2, tmp_path):
    with pytest.raises(LoraError, match="is not a LoRA adapter checkpoint"):
        export_merged(_full_checkpoint(base, tmp_path / "full"), tmp_path / "out")
    export_merged(adapter_world_2, tmp_path / "twice")
    with pytest.raises(LoraError, match="already exists"):
        export_merged(adapter_world_2, tmp_path / "twice")


def test_export_merged_refuses_a_base_that_changed(base, adapter_world_2, tmp_path):
    config = base / "config.json"
    original = config.read_bytes()
    try:
        config.write_text(original.decode().replace('"rms_norm_eps": 1e-06',
                                                    '"rms_norm_eps": 1e-05'))
        done = subprocess.run([sys.executable, "-m", "dpserve", "export-merged",
                               str(adapter_world_2), str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=120)
    finally:
        config.write_bytes(original)
    assert done.returncode == 2
    line, = done.stderr.strip().splitlines()
    assert "is not the base model" in line and str(base) in line
    assert not (tmp_path / "out").exists()


def _full_checkpoint(model: Path, output: Path) -> Path:
    def copy(tmp: Path) -> None:
        for f in model.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
    return ckpt.write_checkpoint(output, 1, copy, base_model=str(model), loss=None,
                                 world_size=1)


@pytest.mark.parametrize(("flags", "message"), [
    ({"lora_targets": "q_proj,qkv_proj"}, "lora_targets: qkv_proj matches no linear layer"),
    ({"lora_rank": 4, "lora_dropout": 1.5}, "lora_dropout: must be in [0, 1)"),
    ({"merge_on_save": True}, "merge_on_save: needs --lora-rank"),
])
def test_bad_lora_settings_are_one_line_errors_before_anything_starts(base, train_data,
                                                                       tmp_path, flags,
                                                                       message):
    flags = {"lora_rank": 4, **flags} if "lora_targets" in flags else flags
    done = finetune(base, train_data, tmp_path / "out", nproc=2, max_steps=1, **flags)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "torch.distributed.run" not in done.stdout
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_resuming_a_full_run_as_lora_is_refused(stopped_run):
    """(A LoRA run resumed without the LoRA flags continues its adapter: test_resume.)"""
    before = stopped_run.listing()
    done = finetune(stopped_run.model, stopped_run.data, stopped_run.output, nproc=2,
                    micro_batch_size=2, grad_accum=2, max_steps=3, resume=True, **LORA)
    assert done.returncode == 2
    line, = done.stderr.strip().splitlines()
    assert line.startswith("dpserve finetune: lora_rank:") and "every weight" in line
    assert stopped_run.listing() == before


# -- the pieces, in process (no training) ---------------------------------------------------


def lora_cfg(model: Path, **flags: object) -> FinetuneConfig:
    return build_finetune_config({"model": str(model), "data": "", "output": "",
                                  "lora_rank": 4, "lora_alpha": 8, **flags},
                                 env={}, plan_only=True)


def wrapped(model: Path, **flags: object) -> torch.nn.Module:
    """The base with a fresh adapter; `lora_B` made non-zero (seeded) so it changes logits."""
    from transformers import AutoModelForCausalLM

    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                            lora_cfg(model, **flags))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return peft_model


def handmade_checkpoint(model: Path, output: Path, step: int = 5, **flags: object) -> Path:
    """An adapter checkpoint as `dpserve finetune --lora-rank 4` writes one."""
    peft_model = wrapped(model, **flags)
    return ckpt.write_checkpoint(output, step, lambda tmp: save_adapter(peft_model, tmp),
                                 base_model=str(model), loss=1.0, world_size=1,
                                 extra=adapter_meta_extra(lora_cfg(model, **flags)))


def test_check_targets_names_each_target_that_matches_no_linear_layer(base):
    with pytest.raises(LoraError) as error:
        check_targets(str(base), ["q_proj", "qkv_proj", "w1"])
    message = str(error.value)
    assert message.startswith(f"lora_targets: qkv_proj, w1 match no linear layer of {base};")
    assert message.endswith("its linear layers are down_proj, gate_proj, k_proj, lm_head, "
                            "o_proj, q_proj, up_proj, v_proj")
    check_targets(str(base), ["self_attn.q_proj", "down_proj"])  # peft's suffix matching


def test_apply_lora_trains_only_the_adapter_and_starts_it_the_same_every_time(base):
    from transformers import AutoModelForCausalLM

    def fresh(seed: int) -> torch.nn.Module:
        torch.manual_seed(1000 + seed)  # the caller's RNG state must not matter
        return apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                          lora_cfg(base, seed=seed))

    one, two, other_seed = fresh(0), fresh(0), fresh(1)
    trainable = [n for n, p in one.named_parameters() if p.requires_grad]
    assert len(trainable) == 28 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    a, b, c = adapter_state(one), adapter_state(two), adapter_state(other_seed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "lora_A" in k)
    assert all(not v.any() for k, v in a.items() if "lora_B" in k)  # starts as the base


def test_a_saved_adapter_is_what_vllm_loads_and_loads_back_exactly(base, tmp_path):
    from transformers import AutoModelForCausalLM

    first = wrapped(base)
    (tmp_path / "one").mkdir()
    save_adapter(first, tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [ADAPTER_CONFIG,
                                                                    ADAPTER_WEIGHTS]
    config = json.loads((tmp_path / "one" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(base)
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8.0, "CAUSAL_LM")

    second = apply_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                        lora_cfg(base, seed=9))  # another init, replaced by the load
    load_adapter_weights(second, tmp_path / "one")
    a, b = adapter_state(first), adapter_state(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (tmp_path / "two").mkdir()
    save_adapter(second, tmp_path / "two")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):  # deterministic: same adapter, same bytes
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


@pytest.mark.parametrize(("saved", "message"), [
    ({"lora_rank": 8}, "lora_A.weight is [8, 128], --lora-rank makes it [4, 128]"),
    ({"lora_targets": "q_proj"}, "tensor names differ from --lora-targets; lacks"),
])
def test_resuming_from_another_adapter_is_refused_naming_the_file(base, tmp_path, saved,
                                                                  message):
    (tmp_path / "adapter").mkdir()
    save_adapter(wrapped(base, **saved), tmp_path / "adapter")
    with pytest.raises(ckpt.CheckpointError) as error:
        load_adapter_weights(wrapped(base), tmp_path / "adapter")
    assert str(error.value).startswith(str(tmp_path / "adapter" / ADAPTER_WEIGHTS) + ":")
    assert message in str(error.value)
    with pytest.raises(ckpt.CheckpointError, match="no adapter weights"):
        load_adapter_weights(wrapped(base), tmp_path)


@pytest.mark.parametrize("targets", [None, "q_proj,v_proj,lm_head"])
def test_an_adapter_dpserve_writes_passes_the_rollouts_adapter_validation(base, tmp_path,
                                                                          targets):
    """Also with lm_head targeted (the documented adapter recipe): only its LoRA factors
    are saved, not the whole output layer peft would add, which vLLM does not load."""
    flags = {} if targets is None else {"lora_targets": targets}
    adapter_ckpt = handmade_checkpoint(base, tmp_path, **flags)
    info = validate_adapter(adapter_ckpt, ckpt.verify_checkpoint(adapter_ckpt),
                            served_base=base, served_fingerprint=base_fingerprint(base),
                            max_lora_rank=4)
    assert (info.rank, info.alpha) == (4, 8.0)
    assert len(info.targets) == (7 if targets is None else 3)


def test_a_handmade_adapter_merges_into_the_weights_peft_computes(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_ckpt = handmade_checkpoint(base, tmp_path / "adapter")
    merged = export_merged(adapter_ckpt, tmp_path / "merged")
    assert merged == tmp_path / "merged" / "step-000005"
    assert ckpt.latest_checkpoint(tmp_path / "merged") == merged  # what deploy looks for
    extra = ckpt.verify_checkpoint(merged).extra
    assert extra == {"kind": "full", "merged_from": str(adapter_ckpt),
                     "base_fingerprint": base_fingerprint(str(base))}
    lora = adapter(adapter_ckpt)
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    expected = (weights(base)["model.layers.1.mlp.down_proj.weight"]
                + (8 / 4) * lora[f"{prefix}.lora_B.weight"] @ lora[f"{prefix}.lora_A.weight"])
    assert torch.allclose(weights(merged)["model.layers.1.mlp.down_proj.weight"], expected,
                          atol=1e-6)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        unmerged = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            str(adapter_ckpt)).eval()
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        full = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        assert not torch.allclose(plain(ids).logits, unmerged(ids).logits, atol=1e-3)
        assert torch.allclose(full(ids).logits, unmerged(ids).logits, atol=1e-5)


def test_export_merged_refuses_a_base_that_is_gone_and_a_kind_it_does_not_know(base,
                                                                                tmp_path):
    gone = tmp_path / "gone"
    shutil.copytree(base, gone)
    adapter_ckpt = handmade_checkpoint(gone, tmp_path / "adapter")
    shutil.rmtree(gone)
    with pytest.raises(LoraError, match=f"^{re.escape(str(gone))}: no such directory;"):
        export_merged(adapter_ckpt, tmp_path / "out")
    odd = ckpt.write_checkpoint(tmp_path / "odd", 1, lambda tmp: None, base_model=str(base),
                                loss=None, world_size=1, extra={"kind": "qlora"})
    with pytest.raises(LoraError, match=r"is not a LoRA adapter checkpoint .*kind 'qlora'"):
        export_merged(odd, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_resume_must_keep_the_adapter_settings_and_the_base(base, tmp_path):
    meta = ckpt.read_meta(handmade_checkpoint(base, tmp_path / "adapter"))
    check_resumable(meta, lora_cfg(base))
    with pytest.raises(LoraError, match=r"^lora_rank: the run being resumed used 4, not 8;"):
        check_resumable(meta, lora_cfg(base, lora_rank=8, lora_alpha=16))
    with pytest.raises(LoraError, match=r"^lora_alpha: the run being resumed used 8\.0, not 4\.0"):
        check_resumable(meta, lora_cfg(base, lora_alpha=4))
    other = tmp_path / "other"
    shutil.copytree(base, other)
    (other / "config.json").write_text((base / "config.json").read_text() + "\n")
    with pytest.raises(LoraError, match=f"^model: {re.escape(str(other))} is not the base"):
        check_resumable(meta, lora_cfg(other))
