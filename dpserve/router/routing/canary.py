"""Canary traffic: a share of new requests for one replica, and what every replica's
attempts did meanwhile (`dpserve deploy --canary-weight P --canary-duration D`).

The canary is judged against a **baseline**: one replica still on the current version,
its prefix cache reset when the canary's window opens (the canary's was reset by its
reload) and its first attempts chosen the way the canary's are, at random regardless of
any prefix home. Both start cold and see the same kind of traffic, so what differs is
the version. Judged against the rest of the fleet instead, a healthy canary loses to
warm caches and to prefix affinity's hits on them: under a chat-like load on 4 CPU
replicas, 6 of 9 healthy deploys failed a threshold on p50/p90 against the others, 2 of
9 against the baseline (`benchmarks/deploy/canary_baseline.py`). This is the practice of
automated canary analysis ("compare the canary against an equivalent baseline
deployed at the same time, not against production": Spinnaker/Kayenta).

While a `CanarySplit` is set on the dispatcher, a request's first attempt goes to the
canary with probability `weight`%, to the baseline with `baseline_weight`% and to the
other replicas otherwise (retries go anywhere but where they failed). With 3 replicas
or more and a weight up to 50% the baseline's share equals the canary's, so both carry
the same load; with 2 the baseline is the other replica and takes the rest. Each
finished attempt is recorded by replica: its outcome and, when a response began, the
time its client waited for the first byte (queueing and retries included: what the
client saw) with its stratum (`stratum`: when it finished, how much prompt its engine
had to compute: the uncached tokens by the engines' KV events, else its size). The
verdict on these samples is `canary_verdict`'s. Pure state, no I/O.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpserve.router.fleet.breaker import Outcome
from dpserve.router.fleet.pool import Replica

ERRORS = frozenset({Outcome.SERVER_ERROR, Outcome.CONNECT_FAILED, Outcome.CONNECT_TIMEOUT,
                    Outcome.DISCONNECTED, Outcome.TIMEOUT})
"""Outcomes that count against a replica (a 4xx is the request's fault, an abort the
client's or the router's)."""


MAX_ANSWERS = 20_000
"""TTFTs kept per side of a window: memory and the verdict's work stay bounded however
long the window and high the rate (20,000 a side pin a ratio to within ~3%)."""


@dataclass
class Sample:
    requests: int = 0
    errors: int = 0
    first_byte_s: list[float] = field(default_factory=list)
    strata: list[int] = field(default_factory=list)
    """Beside each `first_byte_s`, the stratum its request falls in (`stratum`): the
    verdict compares TTFTs only within one."""
    answers: int = 0
    """Answers seen; `first_byte_s` keeps a uniform random MAX_ANSWERS of them."""

    def answer(self, first_byte_s: float, stratum: int, rng: random.Random) -> None:
        """Keep one answer's TTFT, by reservoir sampling beyond MAX_ANSWERS."""
        self.answers += 1
        if len(self.first_byte_s) < MAX_ANSWERS:
            self.first_byte_s.append(first_byte_s)
            self.strata.append(stratum)
        elif (i := rng.randrange(self.answers)) < MAX_ANSWERS:
            self.first_byte_s[i], self.strata[i] = first_byte_s, stratum

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

    def add(self, other: Sample, rng: random.Random | None = None) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.answers += other.answers
        self.first_byte_s.extend(other.first_byte_s)
        self.strata.extend(other.strata)
        if len(self.first_byte_s) > MAX_ANSWERS:  # a random MAX_ANSWERS of both
            keep = sorted((rng or random.Random()).sample(range(len(self.first_byte_s)),
                                                          MAX_ANSWERS))
            self.first_byte_s = [self.first_byte_s[i] for i in keep]
            self.strata = [self.strata[i] for i in keep]


BLOCK_S = 5.0
"""Requests sent this close in time share a stratum: a burst, a neighbour's busy spell or
a stall lands on both sides of the comparison alike."""
PER_BLOCK = 128
"""Strata in one time block: 64 of body size, 64 of uncached prompt tokens."""


def stratum(at_s: float, size: int, prefill: int | None = None) -> int:
    """The stratum of a request that finished `at_s` seconds into the window: its time
    block, and the work its first token waited on to a factor of 4 (a long prompt's
    prefill is not a regression, nor is a cache miss): the prompt tokens its engine
    computed afresh, `prefill`, where the router follows the engines' KV events (a cache
    hit costs nothing), else its body's `size` in bytes. The two never share a stratum."""
    work = min(63, size.bit_length() // 2) if prefill is None else (
        64 + min(63, prefill.bit_length() // 2))
    return int(at_s // BLOCK_S) * PER_BLOCK + work


def baseline_weight(weight_pct: float, replicas: int) -> float:
    """The baseline's share of first attempts for a canary at `weight_pct`% among
    `replicas` (canary included): the canary's own when a third replica is left to take
    the rest, else everything the canary does not take."""
    return weight_pct if replicas >= 3 and 2 * weight_pct <= 100 else 100 - weight_pct


class CanarySplit:
    def __init__(self, replica_id: str, weight_pct: float, *, baseline_id: str | None = None,
                 baseline_weight_pct: float = 0.0, opened: float | None = None,
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_id = replica_id
        self._clock = clock
        self.opened = clock() if opened is None else opened
        """When the window opened, on `clock` (time.monotonic: one clock for every
        worker process of the machine)."""
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
                "baseline": self.baseline_id, "baseline_weight": self.baseline_weight_pct,
                "opened": self.opened}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> CanarySplit:
        return cls(spec["replica"], spec["weight"], baseline_id=spec["baseline"],
                   baseline_weight_pct=spec["baseline_weight"], opened=spec["opened"])

    def snapshot(self) -> CanarySplit:
        """A copy of the split as it stands, to judge away from the event loop while
        this one goes on recording."""
        copy = CanarySplit(self.replica_id, self.weight_pct, baseline_id=self.baseline_id,
                           baseline_weight_pct=self.baseline_weight_pct, opened=self.opened)
        copy.canary, copy.baseline, copy.others = (
            dataclasses.replace(s, first_byte_s=list(s.first_byte_s), strata=list(s.strata))
            for s in (self.canary, self.baseline, self.others))
        return copy

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

    def record(self, replica_id: str, outcome: Outcome, first_byte_s: float | None,
               size: int = 0, prefill: int | None = None) -> None:
        """One finished attempt on `replica_id`; `size`: its request body's bytes;
        `prefill`: the prompt tokens its engine computed afresh, when known."""
        if outcome is Outcome.CLIENT_ERROR or (outcome is Outcome.ABORTED
                                               and first_byte_s is None):
            return  # says nothing about the replica: a 4xx answers at once, whatever it runs
        sample = (self.canary if replica_id == self.replica_id
                  else self.baseline if replica_id == self.baseline_id else self.others)
        sample.requests += 1
        sample.errors += outcome in ERRORS
        if first_byte_s is not None and outcome not in ERRORS:
            sample.answer(first_byte_s, stratum(self._clock() - self.opened, size, prefill),
                          self._rng)
