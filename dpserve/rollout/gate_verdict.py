"""Whether a candidate version scores surely below the current one on an eval set: the
quality gate's comparison (`--gate-vs-current`), with a stated error rate. Pure, no I/O.

Both versions answer the same examples, so the comparison is **paired**: per example,
the candidate's score minus the current one's (each the mean over `repeats` runs), and
the mean of those differences with a bootstrap interval over examples (percentile,
seeded: the same scores give the same verdict). Each side is also scored `repeats`
times; the **spread** is the largest difference between two runs of one side, what
the engine's own nondeterminism (batching, float order) moves a score by when nothing
changed.

The gate fails only when the candidate is worse by more than `margin + spread` and the
interval's top is below `-margin`: a candidate no worse than `margin` below the
current one is then rolled back with probability at most `1 - confidence`, and the same
checkpoint against itself passes. A difference the eval set is too small to be sure of
passes, and the record says so (`sure` false).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 4000


@dataclass(frozen=True)
class Comparison:
    difference: float
    """Mean over examples of candidate minus current."""
    low: float
    high: float
    spread: float
    examples: int
    repeats: int

    def worse(self, margin: float) -> bool:
        return self.difference < -(margin + self.spread) and self.high < -margin

    def to_json(self, margin: float) -> dict[str, Any]:
        return {"difference": round(self.difference, 4), "low": round(self.low, 4),
                "high": round(self.high, 4), "spread": round(self.spread, 4),
                "examples": self.examples, "repeats": self.repeats,
                "confidence": CONFIDENCE, "margin": margin,
                "sure": self.high < -margin or self.low > -margin}

    def describe(self) -> str:
        return (f"{self.difference:+.4g} per example ({CONFIDENCE:.0%} interval "
                f"{self.low:+.4g}..{self.high:+.4g} over {self.examples} examples; runs of "
                f"one version differed by up to {self.spread:.4g} over {self.repeats} "
                f"run{'s' if self.repeats > 1 else ''} each)")


def compare(candidate: Sequence[Sequence[float]], current: Sequence[Sequence[float]], *,
            seed: int = 0) -> Comparison:
    """Per-example scores of each run (`runs x examples`, the same examples in the same
    order on both sides), compared."""
    cand, cur = np.asarray(candidate, dtype=float), np.asarray(current, dtype=float)
    diffs = cand.mean(axis=0) - cur.mean(axis=0)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(diffs), size=(RESAMPLES, len(diffs)))
    means = diffs[picks].mean(axis=1)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    spread = max(float(np.ptp(side.mean(axis=1))) for side in (cand, cur))
    return Comparison(float(diffs.mean()), float(low), float(high), spread, len(diffs),
                      min(len(cand), len(cur)))
