"""What a resume takes from the run it continues (no training: a checkpoint written by
hand). The end-to-end resume, with its refusals, is in test_strategies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dpserve import checkpoint as ckpt
from dpserve.finetune.config import FinetuneConfig, build_finetune_config, given_settings
from dpserve.finetune.resume import ResumeError, check, take_run_settings

RUN = {"global_batch": 16, "lr": 3e-4, "min_lr_ratio": 0.1, "warmup_steps": 5,
       "max_steps": 40, "epochs": None, "weight_decay": 0.01, "max_grad_norm": 1.0,
       "max_seq_len": 256, "seed": 7, "micro_batch_size": 2, "grad_accum": 4}


def a_run(output: Path, run: dict[str, Any] | None = None, **extra: Any) -> Path:
    path = ckpt.write_checkpoint(
        output, 10, lambda tmp: (tmp / "model.safetensors").write_bytes(b"x"),
        base_model="base", loss=1.0, world_size=2,
        extra={"strategy": "zero1", "run": RUN if run is None else run, **extra})
    state = output / ckpt.STATE_DIR / ckpt.step_name(10)
    state.mkdir(parents=True)
    (state / ckpt.STATE_MARKER).write_text("")
    return path


def config(output: Path, **flags: Any) -> tuple[FinetuneConfig, frozenset[str]]:
    output.mkdir(exist_ok=True)
    data = output / "train.jsonl"  # beside the checkpoints: not one of them
    data.touch()
    ns = {"model": "base", "data": str(data), "output": str(output), "resume": True, **flags}
    return build_finetune_config(ns, env={}), given_settings(ns, env={})


def test_settings_left_out_are_the_runs_and_said(tmp_path):
    latest = a_run(tmp_path)
    cfg, given = config(tmp_path)
    taken = take_run_settings(cfg, given, world_size=2)
    assert taken.checkpoint == latest
    c = taken.cfg
    assert (c.strategy, c.lr, c.warmup_steps, c.max_steps, c.weight_decay, c.max_seq_len,
            c.seed, c.micro_batch_size, c.grad_accum) == ("zero1", 3e-4, 5, 40, 0.01, 256, 7,
                                                           2, 4)
    assert "--strategy zero1" in taken.settings and "--grad-accum 4" in taken.settings
    assert "--min-lr-ratio 0.1" not in taken.settings  # the default already: not a change
    check(c, world_size=2)  # continues the run as it was


@pytest.mark.parametrize(("flags", "world", "split"), [
    ({}, 1, (2, 8)),  # one rank instead of two: twice the accumulation
    ({"micro_batch_size": 4}, 2, (4, 2)),  # the accumulation fills in for a given micro
    ({"grad_accum": 1}, 2, (8, 1)),  # and the micro-batch for a given accumulation
    ({}, 3, (4, 1)),  # 16 does not divide over 3 ranks: left, and refused below
])
def test_the_global_batch_is_kept_by_the_split_not_given(tmp_path, flags, world, split):
    a_run(tmp_path)
    cfg, given = config(tmp_path, **flags)
    c = take_run_settings(cfg, given, world_size=world).cfg
    assert (c.micro_batch_size, c.grad_accum) == split
    if c.micro_batch_size * c.grad_accum * world == 16:
        check(c, world_size=world)
    else:
        with pytest.raises(ResumeError, match=r"global batch .* 16 in the run, 12 now"):
            check(c, world_size=world)


def test_a_given_value_is_kept_and_refused_when_it_differs(tmp_path):
    a_run(tmp_path)
    cfg, given = config(tmp_path, lr=1e-3, epochs=2.0)
    c = take_run_settings(cfg, given, world_size=2).cfg
    assert (c.lr, c.epochs, c.max_steps) == (1e-3, 2.0, None)  # epochs given: not max_steps
    with pytest.raises(ResumeError) as refused:
        check(c, world_size=2)
    assert "--lr 0.0003 in the run, 0.001 now" in str(refused.value)
    assert "--max-steps 40 in the run, None now" in str(refused.value)
    assert "--resume-changes" in str(refused.value)


def test_the_environment_and_the_config_file_count_as_given(tmp_path):
    a_run(tmp_path)
    settings = tmp_path / "ft.yaml"
    settings.write_text("finetune:\n  seed: 1\n")
    ns = {"model": "base", "data": str(settings), "output": str(tmp_path), "resume": True,
          "config": str(settings)}
    assert {"seed", "lr"} <= given_settings(ns, env={"DPSERVE_LR": "0.01"})
    assert "lr" not in given_settings(ns, env={})


def test_a_lora_run_gives_its_shape(tmp_path):
    a_run(tmp_path, kind="lora", lora_rank=8, lora_alpha=32.0, lora_targets=["q_proj"])
    cfg, given = config(tmp_path)
    c = take_run_settings(cfg, given, world_size=2).cfg
    assert (c.lora_rank, c.lora_alpha, c.lora_targets) == (8, 32.0, "q_proj")


def test_a_checkpoint_from_before_the_settings_were_saved_takes_only_its_strategy(tmp_path):
    a_run(tmp_path, run={})
    cfg, given = config(tmp_path)
    taken = take_run_settings(cfg, given, world_size=2)
    assert taken.settings == ("--strategy zero1",)
    assert taken.cfg.lr == FinetuneConfig.lr


def test_nothing_to_resume_takes_nothing(tmp_path):
    cfg, given = config(tmp_path / "empty")
    taken = take_run_settings(cfg, given, world_size=2)
    assert (taken.cfg, taken.checkpoint, taken.settings) == (cfg, None, ())


@pytest.mark.parametrize("run", [{"lr": "fast"}, {"lr": -1.0}, {"seed": [1]},
                                 {"max_steps": 0}])
def test_a_checkpoint_recording_a_bad_setting_is_refused_naming_it(tmp_path, run):
    a_run(tmp_path, run=run)
    cfg, given = config(tmp_path)
    with pytest.raises(ResumeError, match="records a setting that is not valid") as refused:
        take_run_settings(cfg, given, world_size=2)
    assert next(iter(run)) in str(refused.value)
