"""A bound on the request bytes the router holds in memory at once.

Each request's body is read whole before it is forwarded (it is parsed for
routing and kept for retries), so without a bound on their sum, many large
bodies at once could exhaust the router's memory even though each is under
`max_body_bytes`. A request that would pass the bound is refused with 503 and
Retry-After; the bytes are given back when the request ends, on every path.
"""

from __future__ import annotations

from types import TracebackType


class BodyBudget:
    """Bytes of request bodies held now, out of `limit`."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def hold(self) -> BodyHold:
        """A per-request hold, to be used as a context manager."""
        return BodyHold(self)


class BodyHold:
    """What one request holds of the budget; all of it is given back on exit."""

    __slots__ = ("_budget", "held")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.held = 0

    def grow_to(self, size: int) -> bool:
        """Hold `size` bytes in all (no-op if already held); False if the budget is spent."""
        extra = size - self.held
        if extra <= 0:
            return True
        budget = self._budget
        if budget.used + extra > budget.limit:
            return False
        budget.used += extra
        self.held = size
        return True

    def __enter__(self) -> BodyHold:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._budget.used -= self.held
        self.held = 0
