"""Canary traffic: a share of new requests for one replica, and what every replica's
attempts did meanwhile (`dpserve deploy --canary-weight P --canary-duration D`).

While a `CanarySplit` is set on the dispatcher, a request's first attempt goes to the
canary replica with probability `weight`% and to the others otherwise (retries go
anywhere but where they failed). Each finished attempt is recorded by replica: its
outcome and, when a response began, the time its client waited for the first byte
(queueing and retries included: what the client saw). `compare` sets the canary
against the other replicas together. Pure state, no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpserve.router.breaker import Outcome
from dpserve.router.pool import Replica

ERRORS = frozenset({Outcome.SERVER_ERROR, Outcome.CONNECT_FAILED, Outcome.CONNECT_TIMEOUT,
                    Outcome.DISCONNECTED, Outcome.TIMEOUT})
"""Outcomes that count against a replica (a 4xx is the request's fault, an abort the
client's or the router's)."""


@dataclass
class Sample:
    requests: int = 0
    errors: int = 0
    first_byte_s: list[float] = field(default_factory=list)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def percentile_ms(self, p: float) -> float | None:
        if not self.first_byte_s:
            return None
        ordered = sorted(self.first_byte_s)
        return 1000 * ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    def to_json(self) -> dict[str, Any]:
        p50, p90 = self.percentile_ms(50), self.percentile_ms(90)
        return {"requests": self.requests, "errors": self.errors,
                "error_rate": round(self.error_rate, 4),
                "ttft_p50_ms": None if p50 is None else round(p50, 1),
                "ttft_p90_ms": None if p90 is None else round(p90, 1)}


class CanarySplit:
    def __init__(self, replica_id: str, weight_pct: float, *,
                 rng: random.Random | None = None) -> None:
        self.replica_id = replica_id
        self.weight_pct = weight_pct
        self._rng = rng or random.Random()
        self.canary = Sample()
        self.others = Sample()

    def narrow(self, candidates: Sequence[Replica], *, first_attempt: bool) -> list[Replica]:
        """The candidates for this attempt: the canary alone or the others alone, by the
        weight, for a first attempt when both are possible."""
        canary = [r for r in candidates if r.id == self.replica_id]
        others = [r for r in candidates if r.id != self.replica_id]
        if not first_attempt or not canary or not others:
            return list(candidates)
        return canary if self._rng.random() * 100 < self.weight_pct else others

    def record(self, replica_id: str, outcome: Outcome, first_byte_s: float | None) -> None:
        if outcome in (Outcome.ABORTED, Outcome.CLIENT_ERROR) and first_byte_s is None:
            return  # says nothing about the replica
        sample = self.canary if replica_id == self.replica_id else self.others
        sample.requests += 1
        sample.errors += outcome in ERRORS
        if first_byte_s is not None and outcome not in ERRORS:
            sample.first_byte_s.append(first_byte_s)


@dataclass(frozen=True)
class Thresholds:
    max_error_rate_delta: float
    """The canary's error rate may exceed the others' by at most this (0.01: 1 point)."""
    max_ttft_ratio: float
    """Its TTFT p50 and p90 may be at most this many times the others'..."""
    ttft_slack_ms: float
    """...or at most this many milliseconds above them: a millisecond or two is noise,
    not a regression, however large the ratio (2 ms against 1 ms)."""
    min_requests: int
    """Fewer canary requests than this judge nothing: the deploy is rolled back."""


def compare(split: CanarySplit, limits: Thresholds) -> str | None:
    """Why the canary fails against the other replicas, or None."""
    c, o = split.canary, split.others
    if c.requests < limits.min_requests:
        return (f"the canary got {c.requests} request(s), fewer than the "
                f"{limits.min_requests} needed to judge it")
    if c.error_rate - o.error_rate > limits.max_error_rate_delta:
        return (f"error rate {c.error_rate:.1%} on the canary against {o.error_rate:.1%} on "
                f"the others (more than {limits.max_error_rate_delta:.1%} points worse)")
    for p in (50, 90):
        mine, theirs = c.percentile_ms(p), o.percentile_ms(p)
        if (mine is not None and theirs and mine > limits.max_ttft_ratio * theirs
                and mine - theirs > limits.ttft_slack_ms):
            return (f"TTFT p{p} {mine:.0f} ms on the canary against {theirs:.0f} ms on the "
                    f"others (more than {limits.max_ttft_ratio:g}x and "
                    f"{limits.ttft_slack_ms:g} ms slower)")
    return None
