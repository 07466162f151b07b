"""How one attempt on one replica ended: the closed set `ProxyEndpoint` acts on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias


@dataclass(slots=True)
class Answered:
    """The client got its answer, or its stream's end (perhaps an error event)."""

    status: int
    """The status the client was sent."""
    served_by: str
    """The replica that ended it: after a migration, the last one; `none` if none."""


@dataclass(slots=True)
class TryAnother:
    """The replica failed before a byte went to the client: another may take the
    request, after a backoff, as a retry."""

    reason: str


@dataclass(slots=True)
class StartOver:
    """A drain took the stream off its replica before its first chunk: it starts over
    on another, which is no failure and no retry."""

    reason: str


Attempt: TypeAlias = Answered | TryAnother | StartOver
