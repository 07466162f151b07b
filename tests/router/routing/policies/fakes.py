"""Fakes for policy tests: a random source that draws what the test scripts."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from dpserve.router.fleet.pool import Replica


class ScriptedRandom(random.Random):
    """`sample` returns the scripted index pairs in order, so a test knows which
    two replicas a power-of-two policy compares."""

    def __init__(self, *pairs: tuple[int, int]) -> None:
        super().__init__(0)
        self._pairs = list(pairs)

    def sample(self, population: Sequence[Any], k: int, *, counts: Any = None) -> list[Any]:
        i, j = self._pairs.pop(0)
        return [population[i], population[j]]


def replicas(*loads: int) -> list[Replica]:
    return [Replica(id=f"r{i}", url=f"http://r{i}", in_flight=n) for i, n in enumerate(loads)]
