"""The demo's load-test requests around its deploy: time to first token while the deploy
ran, beside the steady state just before it.

Times are wall-clock (Unix seconds): the load test writes its time zero
(`metadata.time_zero_unix_s`) and each request's offsets from it (`--save-detailed`).

- **during**: every successful request that was waiting for its first token at any
  moment of the deploy (one sent before it and held up by it counts);
- **steady**: the successful requests whose whole wait for a first token fell in the
  `steady_s` before the deploy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadtest.metrics import distribution


@dataclass(frozen=True)
class TtftWindows:
    steady: list[float]
    """TTFT of each steady request, seconds."""
    during: list[float]

    def line(self) -> str:
        return (f"TTFT p50 / p99: {_describe(self.steady)} before the deploy · "
                f"{_describe(self.during)} during it")


def ttft_windows(doc: dict[str, Any], deploy_start: float, deploy_end: float, *,
                 steady_s: float) -> TtftWindows:
    """Split the requests of a load-test result document (`--save-detailed`)."""
    zero = float(doc["metadata"]["time_zero_unix_s"])
    steady, during = [], []
    for r in doc.get("requests", []):
        if not r["ok"] or r["ttft_s"] is None:
            continue
        start = zero + r["start_s"]
        first = start + r["ttft_s"]
        if start <= deploy_end and first >= deploy_start:
            during.append(r["ttft_s"])
        elif deploy_start - steady_s <= start and first < deploy_start:
            steady.append(r["ttft_s"])
    return TtftWindows(steady, during)


def _describe(ttft_s: list[float]) -> str:
    if not ttft_s:
        return "no request"
    d = distribution(ttft_s, (99.0,))
    p99 = next(iter(d.percentiles.values()))
    return f"{d.median:.0f} / {p99:.0f} ms ({len(ttft_s)} requests)"
