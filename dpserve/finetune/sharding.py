"""What each `--strategy` shards, and the questions the trainer asks of it.

torchtitan's `ParallelDims` habit: the training code never compares a strategy's
name, it asks the setup (`shards_params`, `uses_autocast`), so a new strategy is one
more `Strategy` here. The name stays a plain string on the wire (flags, env, YAML,
the checkpoint's `extra["strategy"]`, `trainer.pt`); `Strategy.named` turns it into
the answers. `dpserve.finetune.strategy` builds the model each one describes.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

StrategyName = Literal["ddp", "zero1", "fsdp"]
STRATEGIES: tuple[StrategyName, ...] = typing.get_args(StrategyName)


@dataclass(frozen=True)
class Strategy:
    """One way the ranks share the model; every answer follows from what it shards."""

    name: StrategyName
    shards_params: bool
    """Each rank holds 1/N of the weights and gradients (DTensor shards): the full
    weights exist on no rank, so saving them gathers tensor by tensor (a collective
    every rank takes part in), the gradient norm is a collective, and the training
    state is saved per rank (DCP), not whole by rank 0."""
    shards_optimizer: bool
    """Each rank holds 1/N of the AdamW state."""

    @property
    def uses_autocast(self) -> bool:
        """On a GPU, bf16 compute comes from autocast (fp32 weights, bf16 copies for the
        matmuls); FSDP's mixed-precision policy computes in bf16 itself, and autocast on
        top would cast twice."""
        return not self.shards_params

    @property
    def saves_sharded_state(self) -> bool:
        """Every rank writes its own shards of the training state (DCP), and a resume
        restores the fp32 weights (or the adapter) from them, not from the served
        checkpoint."""
        return self.shards_params

    @property
    def consolidates_optimizer(self) -> bool:
        """Rank 0 saves the whole AdamW state, which must first be gathered from the
        ranks' shards (ZeroRedundancyOptimizer's `consolidate_state_dict`)."""
        return self.shards_optimizer and not self.saves_sharded_state

    def describe(self, *, reshard_after_forward: bool = True) -> str:
        """The start-up line's words: "fsdp (ZeRO-3)", "zero1 (optimizer state sharded)"."""
        if self.shards_params:
            return f"{self.name} ({'ZeRO-3' if reshard_after_forward else 'ZeRO-2'})"
        if self.shards_optimizer:
            return f"{self.name} (optimizer state sharded)"
        return self.name

    @classmethod
    def named(cls, name: str) -> Strategy:
        """The strategy called `name` (a validated setting); KeyError for another."""
        return _BY_NAME[name]


DDP = Strategy("ddp", shards_params=False, shards_optimizer=False)
ZERO1 = Strategy("zero1", shards_params=False, shards_optimizer=True)
FSDP = Strategy("fsdp", shards_params=True, shards_optimizer=True)
_BY_NAME: dict[str, Strategy] = {s.name: s for s in (DDP, ZERO1, FSDP)}
