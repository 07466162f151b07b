"""Runs shared by the fine-tune tests: the data, and the one-rank reference run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.finetune_helpers import STEPS, StoppedRun, trained, write_train_data


@pytest.fixture(scope="session")
def train_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_train_data(tmp_path_factory.mktemp("data") / "train.jsonl")


@pytest.fixture(scope="session")
def world_1_batch_8(tiny_model: Path, train_data: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ddp` on one rank, micro-batch 8, STEPS steps: what every other strategy and
    world size must reproduce with the same global batch."""
    return trained(tiny_model, train_data, tmp_path_factory.mktemp("w1b8"), nproc=1,
                   micro_batch_size=8, max_steps=STEPS)


@pytest.fixture(scope="session")
def stopped_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> StoppedRun:
    """A full-weight `ddp` run on two ranks, micro-batch 2 x accumulation 2 (global batch
    8), stopped after step 1 of 3 with its training state: what the resume refusals are
    tried on. A refused resume writes nothing (each test checks); a test that resumes
    it for real works on a copy (`StoppedRun.copy`)."""
    where = tmp_path_factory.mktemp("stopped")
    data = write_train_data(where / "train.jsonl")
    output = where / "run"
    trained(tiny_model, data, output, nproc=2, micro_batch_size=2, grad_accum=2, max_steps=3,
            stop_after_steps=1)
    return StoppedRun(tiny_model, data, output)
