"""Whether a canary is worse than its baseline, with a stated error rate: the verdict a
deploy's canary phase acts on (`dpserve.rollout.canary_phase`). Pure, no I/O.

Two checks, each ending `worse`, `not worse` or `unsure`:

- **TTFT**: the ratio of the canary's time to first byte to the baseline's, estimated
  by Hodges-Lehmann on log TTFT within strata (time block and request size:
  `canary.stratum`), with its rank-test interval (`canary_stats.shift`). `worse` when
  the whole interval lies above `max_ttft_ratio` (and the slowdown it allows at least
  is over `ttft_slack_ms` at the baseline's median), `not worse` when the whole
  interval lies at or below it (or the most it allows is within the slack). The
  threshold sits between "as fast" and "too slow" on purpose: two replicas on one
  version differ by their neighbours, and the rule must not hold that against a
  canary; what the interval straddles is `unsure`.
- **Errors**: the canary's error rate minus the baseline's, with Newcombe's interval
  (`canary_stats.rate_difference`). `worse` when the canary has surely more errors
  (the interval above 0) and the difference is over `max_error_rate_delta`; `not
  worse` when the interval's top is within `max_error_rate_delta`. A healthy replica
  fails (almost) nothing, so any sure excess over the tolerance counts.

The canary is `worse` if either check is, `not worse` if both are, else `unsure`. A
window is looked at up to `looks` times; each look's intervals are at confidence
`1 - 2 (1 - confidence) / looks` (Bonferroni; each verdict is one-sided), so over a
whole window the chance that a canary on one side of a threshold is judged on the
other is at most `1 - confidence`, however often it was looked at. Fewer than
`min_requests` on either side is `unsure`. What it costs: with no error on either side,
errors are `not worse` than a 2-point tolerance only after about 300 requests on each
(`z^2 / 0.02`): a window must carry that much traffic, or end inconclusive.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from dpserve.router.routing.canary import CanarySplit, Sample
from dpserve.router.routing.canary_stats import Interval, rate_difference, shift, z_for

WORSE, NOT_WORSE, UNSURE = "worse", "not worse", "unsure"


@dataclass(frozen=True)
class Rule:
    max_ttft_ratio: float = 1.5
    ttft_slack_ms: float = 20.0
    max_error_rate_delta: float = 0.02
    min_requests: int = 30
    confidence: float = 0.95
    looks: int = 1

    @property
    def z(self) -> float:
        """Each verdict is one-sided (the canary surely above a threshold, or surely at
        or below it), so a look's interval misses on each side with probability
        `(1 - confidence) / looks`."""
        return z_for(2 * (1 - self.confidence) / self.looks)


@dataclass(frozen=True)
class Check:
    verdict: str
    interval: Interval | None
    """TTFT: the canary's over the reference's, a ratio; errors: a difference of rates."""
    canary_n: int
    reference_n: int
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        iv = self.interval
        return {"verdict": self.verdict, "canary_n": self.canary_n,
                "reference_n": self.reference_n,
                "estimate": None if iv is None else round(iv.estimate, 4),
                "low": None if iv is None else round(iv.low, 4),
                "high": None if iv is None else _finite(iv.high)}


def _finite(x: float) -> float | None:
    return round(x, 4) if x != float("inf") else None


@dataclass(frozen=True)
class Verdict:
    against: str
    """What the canary was compared with: `the baseline r1` or `the others`."""
    ttft: Check
    errors: Check

    @property
    def outcome(self) -> str:
        checks = (self.ttft.verdict, self.errors.verdict)
        if WORSE in checks:
            return WORSE
        return NOT_WORSE if all(c == NOT_WORSE for c in checks) else UNSURE

    def describe(self, rule: Rule) -> str:
        """The verdict in a sentence, numbers included."""
        parts = [f"{name} {check.why}" for name, check in
                 (("TTFT", self.ttft), ("errors", self.errors))
                 if check.verdict == self.outcome or self.outcome == UNSURE]
        relation = "against" if self.outcome == UNSURE else "than"
        return (f"{self.outcome} {relation} {self.against} at {rule.confidence:.0%} "
                f"confidence: " + "; ".join(parts))

    def to_json(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "against": self.against,
                "ttft_ratio": self.ttft.to_json(), "error_rate_difference":
                    self.errors.to_json()}


def reference(split: CanarySplit, rule: Rule) -> tuple[str, Sample]:
    """What the canary is judged against, named: its baseline when it served enough
    requests (one that left rotation early may not have), else the other replicas."""
    if split.baseline_id is not None and split.baseline.requests >= rule.min_requests:
        return f"the baseline {split.baseline_id}", split.baseline
    merged = Sample()
    merged.add(split.others)
    merged.add(split.baseline)
    return "the others", merged


def judge(split: CanarySplit, rule: Rule) -> Verdict:
    name, ref = reference(split, rule)
    return Verdict(name, ttft_check(split.canary, ref, rule), error_check(split.canary, ref, rule))


def ttft_check(canary: Sample, ref: Sample, rule: Rule) -> Check:
    n, m = len(canary.first_byte_s), len(ref.first_byte_s)
    if min(n, m) < rule.min_requests:
        return Check(UNSURE, None, n, m, f"unsure: {n} and {m} answers, fewer than the "
                                         f"{rule.min_requests} each needs")
    iv = shift(zip(canary.strata, canary.first_byte_s, strict=True),
               zip(ref.strata, ref.first_byte_s, strict=True), rule.z)
    if iv is None:
        return Check(UNSURE, None, n, m, "unsure: no stratum holds answers from both")
    base_ms = 1000 * statistics.median(ref.first_byte_s)
    limit = rule.max_ttft_ratio
    if iv.low > limit and (iv.low - 1) * base_ms > rule.ttft_slack_ms:
        verdict = WORSE
    elif iv.high <= limit or (iv.high - 1) * base_ms <= rule.ttft_slack_ms:
        verdict = NOT_WORSE
    else:
        verdict = UNSURE
    high = "inf" if iv.high == float("inf") else f"{iv.high:.2f}"
    why = (f"{iv.estimate:.2f}x ({iv.low:.2f}-{high}x) over {n}/{m} answers, "
           f"{'above' if verdict == WORSE else 'within' if verdict == NOT_WORSE else 'around'}"
           f" the {limit:g}x allowed (baseline median {base_ms:.0f} ms)")
    return Check(verdict, iv, n, m, why)


def error_check(canary: Sample, ref: Sample, rule: Rule) -> Check:
    n, m = canary.requests, ref.requests
    if min(n, m) < rule.min_requests:
        return Check(UNSURE, None, n, m, f"unsure: {n} and {m} requests, fewer than the "
                                         f"{rule.min_requests} each needs")
    iv = rate_difference(canary.errors, n, ref.errors, m, rule.z)
    assert iv is not None  # both sides have requests
    tol = rule.max_error_rate_delta
    if iv.low > 0 and iv.estimate > tol:
        verdict = WORSE
    elif iv.high <= tol:
        verdict = NOT_WORSE
    else:
        verdict = UNSURE
    why = (f"{canary.errors}/{n} against {ref.errors}/{m}, {100 * iv.estimate:+.1f} points "
           f"({100 * iv.low:+.1f}..{100 * iv.high:+.1f}), "
           f"{'above' if verdict == WORSE else 'within' if verdict == NOT_WORSE else 'around'}"
           f" the {100 * tol:g} allowed")
    return Check(verdict, iv, n, m, why)
