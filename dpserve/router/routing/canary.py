"""Canary traffic: a share of new requests for one replica, and what every replica's
attempts did meanwhile (`dpserve deploy --canary-weight P --canary-duration D`).

The canary is judged against a **baseline**: one replica still on the current version,
its prefix cache reset when the canary's window opens (the canary's was reset by its
reload) and its first attempts chosen the way the canary's are, at random regardless of
any prefix home. Both start cold and see the same kind of traffic, so what differs is
the version. Judged against the rest of the fleet instead, a healthy canary loses to
warm caches and to prefix affinity's hits on them: under a chat-like load on 4 CPU
replicas, 6 of 9 healthy deploys failed the default gate against the others, 2 of 9
against the baseline (`benchmarks/deploy/canary_baseline.py`). This is the practice of
automated canary analysis ("compare the canary against an equivalent baseline
deployed at the same time, not against production": Spinnaker/Kayenta).

While a `CanarySplit` is set on the dispatcher, a request's first attempt goes to the
canary with probability `weight`%, to the baseline with `baseline_weight`% and to the
other replicas otherwise (retries go anywhere but where they failed). With 3 replicas
or more and a weight up to 50% the baseline's share equals the canary's, so both carry
the same load; with 2 the baseline is the other replica and takes the rest. Each
finished attempt is recorded by replica: its outcome and, when a response began, the
time its client waited for the first byte (queueing and retries included: what the
client saw). Pure state, no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpserve.router.fleet.breaker import Outcome
from dpserve.router.fleet.pool import Replica

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

    def add(self, other: Sample) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.first_byte_s.extend(other.first_byte_s)


def baseline_weight(weight_pct: float, replicas: int) -> float:
    """The baseline's share of first attempts for a canary at `weight_pct`% among
    `replicas` (canary included): the canary's own when a third replica is left to take
    the rest, else everything the canary does not take."""
    return weight_pct if replicas >= 3 and 2 * weight_pct <= 100 else 100 - weight_pct


class CanarySplit:
    def __init__(self, replica_id: str, weight_pct: float, *, baseline_id: str | None = None,
                 baseline_weight_pct: float = 0.0, rng: random.Random | None = None) -> None:
        self.replica_id = replica_id
        self.weight_pct = weight_pct
        self.baseline_id = baseline_id
        self.baseline_weight_pct = baseline_weight_pct if baseline_id is not None else 0.0
        self._rng = rng or random.Random()
        self.canary = Sample()
        self.baseline = Sample()
        self.others = Sample()
        """The replicas on the current version other than the baseline."""

    def spec(self) -> dict[str, Any]:
        """What a router worker needs to split the same way (`from_spec`)."""
        return {"replica": self.replica_id, "weight": self.weight_pct,
                "baseline": self.baseline_id, "baseline_weight": self.baseline_weight_pct}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> CanarySplit:
        return cls(spec["replica"], spec["weight"], baseline_id=spec["baseline"],
                   baseline_weight_pct=spec["baseline_weight"])

    def samples(self) -> dict[str, Sample]:
        return {"canary": self.canary, "baseline": self.baseline, "others": self.others}

    def take_samples(self) -> dict[str, Sample]:
        """The samples so far, replaced by empty ones (a worker reports what is new)."""
        taken = self.samples()
        self.canary, self.baseline, self.others = Sample(), Sample(), Sample()
        return taken

    def narrow(self, candidates: Sequence[Replica], *, first_attempt: bool) -> list[Replica]:
        """The candidates for this attempt: the canary alone, the baseline alone or the
        others alone, by the weights, for a first attempt. A group with no candidate
        (at its cap, out of rotation) sends the attempt to any replica but the canary,
        so the canary's share never grows."""
        if not first_attempt:
            return list(candidates)
        draw = self._rng.random() * 100
        if draw < self.weight_pct:
            group = [r for r in candidates if r.id == self.replica_id]
        elif draw < self.weight_pct + self.baseline_weight_pct:
            group = [r for r in candidates if r.id == self.baseline_id]
        else:
            group = [r for r in candidates if r.id not in (self.replica_id, self.baseline_id)]
        return group or [r for r in candidates if r.id != self.replica_id] or list(candidates)

    def record(self, replica_id: str, outcome: Outcome, first_byte_s: float | None) -> None:
        if outcome is Outcome.CLIENT_ERROR or (outcome is Outcome.ABORTED
                                               and first_byte_s is None):
            return  # says nothing about the replica: a 4xx answers at once, whatever it runs
        sample = (self.canary if replica_id == self.replica_id
                  else self.baseline if replica_id == self.baseline_id else self.others)
        sample.requests += 1
        sample.errors += outcome in ERRORS
        if first_byte_s is not None and outcome not in ERRORS:
            sample.first_byte_s.append(first_byte_s)


@dataclass(frozen=True)
class Thresholds:
    max_error_rate_delta: float
    """The canary's error rate may exceed the reference's by at most this (0.01: 1 point)."""
    max_ttft_ratio: float
    """Its TTFT p50 and p90 may be at most this many times the reference's..."""
    ttft_slack_ms: float
    """...or at most this many milliseconds above them: a millisecond or two is noise,
    not a regression, however large the ratio (2 ms against 1 ms)."""
    min_requests: int
    """Fewer canary requests than this judge nothing: the deploy is rolled back. A
    baseline with fewer is not judged against: the others are."""


def reference(split: CanarySplit, limits: Thresholds) -> tuple[str, Sample]:
    """What the canary is judged against, named: its baseline when it served enough
    requests (one that left rotation early may not have), else the other replicas."""
    if split.baseline_id is not None and split.baseline.requests >= limits.min_requests:
        return f"the baseline {split.baseline_id}", split.baseline
    merged = Sample()
    merged.add(split.others)
    merged.add(split.baseline)
    return "the others", merged


def compare(split: CanarySplit, limits: Thresholds) -> str | None:
    """Why the canary fails against its reference (`reference`), or None."""
    c = split.canary
    name, o = reference(split, limits)
    if c.requests < limits.min_requests:
        return (f"the canary got {c.requests} request(s), fewer than the "
                f"{limits.min_requests} needed to judge it")
    if c.error_rate - o.error_rate > limits.max_error_rate_delta:
        return (f"error rate {c.error_rate:.1%} on the canary against {o.error_rate:.1%} on "
                f"{name} (more than {limits.max_error_rate_delta:.1%} points worse)")
    for p in (50, 90):
        mine, theirs = c.percentile_ms(p), o.percentile_ms(p)
        if (mine is not None and theirs and mine > limits.max_ttft_ratio * theirs
                and mine - theirs > limits.ttft_slack_ms):
            return (f"TTFT p{p} {mine:.0f} ms on the canary against {theirs:.0f} ms on "
                    f"{name} (more than {limits.max_ttft_ratio:g}x and "
                    f"{limits.ttft_slack_ms:g} ms slower)")
    return None
