"""`dpserve finetune` end to end on CPU: Gloo, real torchrun, the tiny model.

The equivalence tests are the properties data-parallel training rests on:
the same global batch gives the same parameters whatever the world size,
micro-batch or accumulation, and a resumed run continues exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dpserve import checkpoint as ckpt
from tests.finetune_helpers import (
    STEPS,
    finetune,
    finetune_argv,
    trained,
    weights,
)
from tests.procs import process_alive

# fp32 on CPU; sums in another order (2 ranks vs 1) differ by rounding only.
ATOL = 2e-6


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def world_2_batch_4(tiny_model, train_data, tmp_path_factory) -> Path:
    return trained(tiny_model, train_data, tmp_path_factory.mktemp("w2b4"), nproc=2,
                   micro_batch_size=4, max_steps=STEPS, log_every=1)


def test_training_changes_the_weights(tiny_model, world_1_batch_8):
    assert max_diff(weights(world_1_batch_8), weights(tiny_model)) > 1e-3


def test_world_size_2_matches_world_size_1_with_twice_the_micro_batch(world_1_batch_8,
                                                                       world_2_batch_4):
    assert max_diff(weights(world_2_batch_4), weights(world_1_batch_8)) <= ATOL


def test_gradient_accumulation_matches_the_bigger_batch(tiny_model, train_data, tmp_path,
                                                        world_1_batch_8):
    accumulated = trained(tiny_model, train_data, tmp_path, nproc=1, micro_batch_size=4,
                          grad_accum=2, max_steps=STEPS)
    assert max_diff(weights(accumulated), weights(world_1_batch_8)) <= ATOL


def test_resume_continues_exactly_where_it_stopped(tiny_model, train_data, tmp_path,
                                                   world_2_batch_4):
    half = trained(tiny_model, train_data, tmp_path, nproc=2, micro_batch_size=4,
                   max_steps=STEPS, stop_after_steps=STEPS // 2)
    assert ckpt.read_meta(half).step == STEPS // 2
    resumed = trained(tiny_model, train_data, tmp_path, nproc=2, micro_batch_size=4,
                      max_steps=STEPS, resume=True)
    assert ckpt.read_meta(resumed).step == STEPS
    assert max_diff(weights(resumed), weights(world_2_batch_4)) <= ATOL
    rows = (tmp_path / "loss.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [str(s) for s in range(1, STEPS + 1)]


def test_two_nodes_meet_by_c10d_rendezvous_and_train_as_one_world(tiny_model, train_data,
                                                                  tmp_path, world_2_batch_4):
    """Multi-node torchrun, with both "nodes" on this machine: one process each, joined
    by the c10d rendezvous, must train exactly like one node with two processes."""
    from dpserve.replicas.launcher import free_port

    flags = {"micro_batch_size": 4, "max_steps": STEPS, "log_every": 1, "nnodes": 2,
             "rdzv_endpoint": f"127.0.0.1:{free_port()}", "rdzv_id": "test-2-nodes"}
    out = tmp_path / "shared-volume"
    other = subprocess.Popen(finetune_argv(tiny_model, train_data, out, nproc=1, **flags),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        done = finetune(tiny_model, train_data, out, nproc=1, **flags)
        other_out = other.communicate(timeout=300)[0]
    finally:
        if other.poll() is None:
            other.kill()
    assert done.returncode == 0 and other.returncode == 0, done.stderr + other_out
    assert "world size 2" in done.stdout + other_out
    latest = ckpt.latest_checkpoint(out)
    assert ckpt.read_meta(latest).world_size == 2
    assert max_diff(weights(latest), weights(world_2_batch_4)) <= ATOL


def test_a_checkpoint_is_complete_servable_and_described(tiny_model, world_2_batch_4):
    meta = ckpt.verify_checkpoint(world_2_batch_4)
    assert (meta.step, meta.world_size, meta.base_model) == (STEPS, 2, str(tiny_model))
    assert meta.loss is not None and meta.loss > 0
    # Architecture and tokenizer are the base model's, byte for byte.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (world_2_batch_4 / name).read_bytes() == (tiny_model / name).read_bytes()
    base, tuned = weights(tiny_model), weights(world_2_batch_4)
    assert {k: (v.shape, v.dtype) for k, v in base.items()} == {
        k: (v.shape, v.dtype) for k, v in tuned.items()}
    output = world_2_batch_4.parent
    assert ckpt.train_state_dir(output, STEPS) is not None
    assert not any(".tmp-" in p.name for p in output.iterdir())  # no half-written leftovers
    assert (output / "loss.png").stat().st_size > 1000
    rows = (output / "loss.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,eval_loss,step_s,comm_s" and len(rows) == STEPS + 1


def test_progress_shows_the_global_batch_and_each_step(tiny_model, train_data, tmp_path):
    t0 = time.monotonic()
    done = finetune(tiny_model, train_data, tmp_path, nproc=2, micro_batch_size=2,
                    grad_accum=2, max_steps=2, log_every=1, eval_data=train_data, eval_every=1)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # the summary is the run's wall time (processes, model and data loading included),
    # not the training loop's alone
    finished = out.splitlines()[-1]
    assert finished.startswith("dpserve finetune: finished in "), out[-2000:]
    h, m, s = (int(x) for x in finished.split()[4].split(":"))
    assert took / 2 <= 3600 * h + 60 * m + s <= took, (finished, took)  # start-up: seconds
    assert "training loop done in " in out
    assert "global batch 8 = micro-batch 2 x world 2 x accumulation 2" in out
    assert "step      1/2" in out and "tok/s" in out and "eta" in out
    assert "eval loss" in out


def test_memory_peaks_cover_a_step_that_holds_the_optimizer_state(tiny_model, train_data,
                                                                  tmp_path, world_1_batch_8):
    """AdamW allocates its state in the first update, after the activations are freed:
    the peaks are read after the second step, which holds both (on an H100 the first
    step's GPU peak was 2 GiB short for a 270M model). A one-step run reports its step."""
    longer = json.loads((world_1_batch_8.parent / "memory.json").read_text())
    assert longer["peak_steps"] == 2 and longer["ranks"][0]["peak_rss"] > 0
    done = finetune(tiny_model, train_data, tmp_path, nproc=1, micro_batch_size=4, max_steps=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "memory.json").read_text())["peak_steps"] == 1
    line, = [x for x in done.stdout.splitlines() if x.startswith("memory on rank 0")]
    assert "process peak" in line and "(steps" not in line


def test_autocast_is_bf16_on_a_gpu_except_under_fsdp_and_off_on_cpu():
    """fsdp computes in bf16 through its mixed-precision policy (checked on an H100:
    bf16 weights and outputs, fp32 gradients); autocast on top would cast twice."""
    import contextlib

    from dpserve.finetune.config import FinetuneConfig
    from dpserve.finetune.dist import Dist
    from dpserve.finetune.train import autocast_for

    def on(device: str, strategy: str) -> object:
        cfg = FinetuneConfig(model="m", data="", output="", strategy=strategy)
        return autocast_for(cfg, Dist(0, 0, 1, torch.device(device)))

    for strategy in ("ddp", "zero1"):
        gpu = on("cuda", strategy)
        assert (gpu.func, gpu.args, gpu.keywords) == (  # type: ignore[attr-defined]
            torch.autocast, ("cuda",), {"dtype": torch.bfloat16})
    assert on("cuda", "fsdp") is contextlib.nullcontext
    assert all(on("cpu", s) is contextlib.nullcontext for s in ("ddp", "zero1", "fsdp"))


def test_keep_last_prunes_older_checkpoints(tiny_model, train_data, tmp_path):
    trained(tiny_model, train_data, tmp_path, nproc=1, micro_batch_size=4, max_steps=3,
            save_every=1, keep_last=2)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]


def test_sigterm_saves_at_the_next_step_and_exits_cleanly(tiny_model, train_data, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpserve", "finetune", "--model", str(tiny_model), "--data",
         str(train_data), "--output", str(tmp_path), "--nproc-per-node", "2",
         "--threads-per-rank", "1", "--micro-batch-size", "2", "--max-steps", "100000",
         "--save-every", "0", "--log-every", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.startswith("step") or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, rest[-3000:]
    assert "stopping at step" in rest
    (step, path), = ckpt.list_checkpoints(tmp_path)
    assert 1 <= step < 100000
    ckpt.verify_checkpoint(path)
    assert not process_alive(proc.pid)


@pytest.mark.parametrize(("case", "message"), [
    ("bad_line", ":3: not valid JSON"),
    ("missing_model", "model: directory"),
    ("output_is_a_file", "output: cannot write to"),
    ("existing_checkpoints", "already holds checkpoints"),
])
def test_bad_input_is_a_clear_error_and_nothing_is_written(tiny_model, train_data, tmp_path,
                                                           case, message):
    data, model, output = train_data, tiny_model, tmp_path / "out"
    if case == "bad_line":
        data = tmp_path / "bad.jsonl"
        lines = train_data.read_text().splitlines()
        data.write_text("\n".join([*lines[:2], '{"prompt": "x", ', *lines[2:]]) + "\n")
    elif case == "missing_model":
        model = tmp_path / "no-such-model"
    elif case == "output_is_a_file":
        output.write_text("not a directory")
    elif case == "existing_checkpoints":
        ckpt.write_checkpoint(output, 5, lambda d: (d / "config.json").write_text("{}"),
                              base_model=str(model), loss=None, world_size=1)
    done = finetune(model, data, output, nproc=2, max_steps=1)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    if case != "existing_checkpoints" and output.is_dir():
        assert not any(p.name.startswith("step-") for p in output.iterdir())
