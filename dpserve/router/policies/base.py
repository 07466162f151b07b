from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dpserve.router.pool import Replica


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about the request it places."""

    route: str
    model: str | None = None


class Policy(Protocol):
    name: str

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        """Pick one of `candidates` (all able to serve), or None if there are none."""
        ...
