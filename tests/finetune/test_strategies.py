"""`--strategy zero1|fsdp` and activation checkpointing train exactly what ddp trains.

Sharding changes where parameters, gradients and optimizer state live, never the
update: with the same global batch every strategy must reach the same parameters
(fp32 on CPU: sums in another order differ by rounding only), and an fsdp run
stopped on two ranks and resumed on one (DCP reshards its state) must continue to
the parameters the uninterrupted run reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpserve import checkpoint as ckpt
from tests.finetune_helpers import (
    STEPS,
    finetune,
    plan_matches,
    trained,
    weights,
)

RTOL = 1e-5  # parameters after STEPS steps, relative to each tensor's largest value


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)


@pytest.fixture(scope="module")
def fsdp_world_2(tiny_model, train_data, tmp_path_factory) -> Path:
    return trained(tiny_model, train_data, tmp_path_factory.mktemp("fsdp2"), nproc=2,
                   micro_batch_size=4, max_steps=STEPS, strategy="fsdp", log_every=1)


def test_fsdp_on_two_ranks_trains_what_one_rank_trains(tiny_model, world_1_batch_8, fsdp_world_2):
    assert max_rel_diff(weights(fsdp_world_2), weights(tiny_model)) > 1e-3  # it trained
    assert max_rel_diff(weights(fsdp_world_2), weights(world_1_batch_8)) <= RTOL


def test_zero1_trains_what_ddp_trains(tiny_model, train_data, tmp_path, world_1_batch_8):
    zero1 = trained(tiny_model, train_data, tmp_path, nproc=2, micro_batch_size=4,
                    max_steps=STEPS, strategy="zero1")
    assert max_rel_diff(weights(zero1), weights(world_1_batch_8)) <= RTOL
    assert ckpt.read_meta(zero1).extra["strategy"] == "zero1"
    memory = json.loads((tmp_path / "memory.json").read_text())
    plan_matches(tiny_model, memory)  # each rank holds half of AdamW's state
    ddp = json.loads((world_1_batch_8.parent / "memory.json").read_text())["ranks"][0]
    assert memory["ranks"][0]["optimizer"] <= 0.51 * ddp["optimizer"]


def test_fsdp_zero2_with_activation_checkpointing_and_accumulation_trains_the_same(
        tiny_model, train_data, tmp_path, world_1_batch_8):
    """Keeping gathered layers to the backward, recomputing activations and syncing
    gradients only on the last micro-batch change memory and traffic, not the update."""
    run = trained(tiny_model, train_data, tmp_path, nproc=2, micro_batch_size=2,
                  grad_accum=2, max_steps=STEPS, strategy="fsdp",
                  reshard_after_forward=False, activation_checkpointing=True)
    assert max_rel_diff(weights(run), weights(world_1_batch_8)) <= RTOL


def test_fsdp_saves_servable_weights_and_sharded_training_state(tiny_model, fsdp_world_2):
    meta = ckpt.verify_checkpoint(fsdp_world_2)
    assert meta.extra["strategy"] == "fsdp" and meta.world_size == 2
    base, tuned = weights(tiny_model), weights(fsdp_world_2)
    assert {k: (v.shape, v.dtype) for k, v in base.items()} == {
        k: (v.shape, v.dtype) for k, v in tuned.items()}
    state = ckpt.train_state_dir(fsdp_world_2.parent, STEPS)
    assert state is not None
    shards = sorted(p.name for p in (state / "dcp").iterdir())
    assert len(shards) == 2 and all(s.endswith(".safetensors") for s in shards)
    assert not (state / "master_weights.pt").exists()
    # Each rank holds half of the weights, gradients and optimizer state, as planned.
    memory = json.loads((fsdp_world_2.parent / "memory.json").read_text())
    plan_matches(tiny_model, memory)


def test_fsdp_resumed_on_another_world_size_continues_exactly(tiny_model, train_data, tmp_path,
                                                              fsdp_world_2):
    half = trained(tiny_model, train_data, tmp_path, nproc=2, micro_batch_size=4,
                   max_steps=STEPS, strategy="fsdp", stop_after_steps=STEPS // 2)
    assert ckpt.read_meta(half).step == STEPS // 2
    # One rank with twice the micro-batch: the same global batch, the same data.
    resumed = trained(tiny_model, train_data, tmp_path, nproc=1, micro_batch_size=8,
                      max_steps=STEPS, strategy="fsdp", resume=True)
    assert ckpt.read_meta(resumed).world_size == 1
    assert max_rel_diff(weights(resumed), weights(fsdp_world_2)) <= RTOL


def test_the_progress_and_loss_csv_split_step_time_into_compute_and_comm(fsdp_world_2):
    rows = (fsdp_world_2.parent / "loss.csv").read_text().splitlines()
    header, *values = [r.split(",") for r in rows]
    assert header[-2:] == ["step_s", "comm_s"]
    for row in values:
        step_s, comm_s = float(row[-2]), float(row[-1])
        assert 0 < comm_s < step_s  # two ranks do wait on each other


def test_resuming_with_another_strategy_is_refused_before_training(stopped_run):
    before = stopped_run.listing()
    done = finetune(stopped_run.model, stopped_run.data, stopped_run.output, nproc=2,
                    micro_batch_size=2, grad_accum=2, max_steps=3, strategy="fsdp",
                    resume=True)
    assert done.returncode == 2
    line, = done.stderr.strip().splitlines()
    assert "strategy:" in line and "--strategy ddp" in line
    assert "torch.distributed.run" not in done.stdout  # no worker was started
    assert stopped_run.listing() == before


@pytest.mark.parametrize(("flags", "message"), [
    ({"strategy": "zero3"}, "strategy: must be one of ddp, zero1, fsdp"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb: must be > 0"),
    ({"lora_rank": 0}, "lora_rank: must be >= 1"),
])
def test_bad_strategy_settings_are_one_line_errors(tiny_model, train_data, tmp_path, flags,
                                                   message):
    done = finetune(tiny_model, train_data, tmp_path / "out", nproc=2, max_steps=1, **flags)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_sharded_weights_are_what_transformers_loads(tiny_model, tmp_path):
    """Past the shard size the weights are split into files with an index, as Hugging
    Face shards them, and load back to the same tensors."""
    from transformers import AutoModelForCausalLM

    from dpserve.finetune.strategy import full_tensors, tensor_sizes
    from dpserve.finetune.weights import INDEX_FILE, plan_files, write_config, write_weights

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    files = plan_files(tensor_sizes(model), torch.float32, max_bytes=300_000)
    assert len(set(files.values())) > 2
    write_weights(tmp_path, files, full_tensors(model, master=True), torch.float32, write=True)
    write_config(model, tmp_path, torch.float32)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"] == files
    assert all(p.stat().st_size <= 300_000 + 4096 or len(
        [k for k, f in files.items() if f == p.name]) == 1
        for p in tmp_path.glob("model-*.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_resume_takes_the_runs_settings_and_refuses_a_given_change_naming_it(
        stopped_run, tmp_path):
    """Resumed with --grad-accum 1 given, the global batch would halve: refused, naming
    it, unless --resume-changes. Settings left out are the run's, said as taken: on one
    rank instead of two the accumulation doubles to keep the global batch."""
    before = stopped_run.listing()
    done = finetune(stopped_run.model, stopped_run.data, stopped_run.output, nproc=2,
                    micro_batch_size=2, grad_accum=1, resume=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line, = done.stderr.strip().splitlines()
    assert "was trained with other settings: global batch (--micro-batch-size x " \
           "--grad-accum x ranks: 2 x 1 x 2 now) 8 in the run, 4 now." in line, line
    assert "--resume-changes" in line
    assert stopped_run.listing() == before  # nothing written
    model, data, run = stopped_run.model, stopped_run.data, stopped_run.copy(tmp_path / "run")
    done = finetune(model, data, run, nproc=1, max_steps=4, stop_after_steps=1, resume=True,
                    resume_changes=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "with the run's settings: --micro-batch-size 2, --grad-accum 4\n" in done.stdout
    assert "with changed settings (--resume-changes): --max-steps 3 in the run, 4 now" \
        in done.stdout
    done = finetune(model, data, run, nproc=1, resume=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "with the run's settings: --max-steps 4, --micro-batch-size 2, --grad-accum 4" \
        in done.stdout
    assert "changed settings" not in done.stdout
    latest = ckpt.latest_checkpoint(run)
    assert latest is not None
    meta = ckpt.read_meta(latest)
    assert meta.step == 4
    assert (meta.extra["run"]["global_batch"], meta.extra["run"]["grad_accum"]) == (8, 4)
