"""Each strategy answers the trainer's questions as the trainer used to decide them by
name: what it shards, whether autocast computes in bf16, how its state is saved."""

from __future__ import annotations

import pytest

from dpserve.finetune.config import FinetuneConfig, build_finetune_config
from dpserve.finetune.sharding import DDP, FSDP, STRATEGIES, ZERO1, Strategy


def test_every_strategy_name_has_its_answers_in_the_order_the_setting_lists_them():
    assert STRATEGIES == ("ddp", "zero1", "fsdp")
    assert [Strategy.named(name) for name in STRATEGIES] == [DDP, ZERO1, FSDP]
    assert [s.name for s in (DDP, ZERO1, FSDP)] == list(STRATEGIES)


@pytest.mark.parametrize(("strategy", "answers"), [
    # shards_params, shards_optimizer, uses_autocast, saves_sharded_state,
    # consolidates_optimizer
    (DDP, (False, False, True, False, False)),
    (ZERO1, (False, True, True, False, True)),
    (FSDP, (True, True, False, True, False)),
])
def test_each_strategy_answers_as_the_trainer_decided_by_name(strategy: Strategy, answers):
    assert (strategy.shards_params, strategy.shards_optimizer, strategy.uses_autocast,
            strategy.saves_sharded_state, strategy.consolidates_optimizer) == answers


def test_the_start_up_line_names_the_strategy_and_what_it_shards():
    assert DDP.describe() == "ddp"
    assert ZERO1.describe() == "zero1 (optimizer state sharded)"
    assert FSDP.describe() == "fsdp (ZeRO-3)"
    assert FSDP.describe(reshard_after_forward=False) == "fsdp (ZeRO-2)"
    assert ZERO1.describe(reshard_after_forward=False) == "zero1 (optimizer state sharded)"


def test_a_strategy_stays_a_plain_string_in_the_settings():
    cfg = build_finetune_config({"model": "m", "strategy": "fsdp"}, env={}, plan_only=True)
    assert cfg.strategy == "fsdp" and type(cfg.strategy) is str
    assert FinetuneConfig.to_json(cfg)["strategy"] == "fsdp"
    with pytest.raises(KeyError):
        Strategy.named("zero3")
