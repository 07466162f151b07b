"""Runs shared by the fine-tune tests: the data, and the one-rank reference run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.finetune_helpers import STEPS, trained, write_train_data


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
