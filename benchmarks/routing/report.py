"""The tables and the verdicts of ``quality.py``.

One table per workload, one row per (router, policy), and two targets:

- **p99 TTFT**: dpserve's default policy (``RouterConfig().policy``) is no worse than
  the best vllm-router policy, on each workload;
- **prefix-cache hit rate**: dpserve's prefix-affinity at least matches
  vllm-router's cache_aware, on each workload where prompts share prefixes
  (cache_aware hits on at least ``MIN_SHARED_HIT_RATE`` of prompt tokens;
  elsewhere both are ~0 and the comparison is reported as n/a).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.routing.sim_fleet import FleetDelta
from dpserve.config import RouterConfig

DEFAULT_POLICY = RouterConfig().policy
PREFIX_POLICY, CACHE_AWARE = "prefix-affinity", "cache_aware"
MIN_SHARED_HIT_RATE = 0.01


@dataclass(kw_only=True)
class RunRow:
    """One (workload, router, policy) run: the load result document and the fleet's delta."""

    workload: str
    router: str
    policy: str
    rate: float
    load: dict[str, Any] | None = None
    """loadtest's run document (``schema``, ``config``, ``metadata``, ``metrics``)."""
    fleet: FleetDelta | None = None
    error: str | None = None
    wall_s: float | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds spent starting the fleet, starting the router, loading, stopping."""
    load_average: float | None = None
    """1-minute load average when the run ended."""
    quiet_wait_s: float | None = None
    """Time waited for other processes to quieten before the run."""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """Every attempt of this run (a distorted one is repeated), this one included."""

    def metric(self, *path: str) -> Any:
        node: Any = (self.load or {}).get("metrics")
        for key in path:
            if not isinstance(node, dict):
                return None
            node = node.get(key)
        return node

    @property
    def ttft_p99(self) -> float | None:
        return self.metric("ttft_ms", "percentiles", "p99")

    @property
    def hit_rate(self) -> float | None:
        return self.fleet.hit_rate if self.fleet else None

    @property
    def failures(self) -> int | None:
        failed = self.metric("failed")
        return None if failed is None else int(failed)

    def attempt_summary(self) -> dict[str, Any]:
        f = self.fleet
        return {"ttft_p99_ms": self.ttft_p99, "hit_rate": self.hit_rate,
                "late_share": f.late_share if f else None,
                "very_late_share": f.very_late_share if f else None,
                "distorted": f.distorted if f else None, "load_average": self.load_average,
                "quiet_wait_s": self.quiet_wait_s, "error": self.error}

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fleet"] = _finite(self.fleet.as_dict()) if self.fleet else None
        return d


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}


COLUMNS = (("router", 11), ("policy", 17), ("TTFT p50", 9), ("TTFT p99", 9), ("TPOT p50", 9),
           ("out tok/s", 9), ("req/s", 6), ("failed", 6), ("hit rate", 8), ("spread", 6),
           ("late>1ms", 8), ("late>10ms", 9))


def _fmt(value: Any, digits: int = 0, pct: bool = False) -> str:
    if value is None:
        return "-"
    if pct:
        return f"{100 * value:.1f}%"
    return f"{value:,.{digits}f}"


def row_cells(r: RunRow) -> list[str]:
    if r.load is None:
        return [r.router, r.policy, *(["-"] * (len(COLUMNS) - 3)), r.error or "no result"]
    f = r.fleet
    policy = r.policy + (" *" if f is not None and f.distorted else "")
    return [r.router, policy, _fmt(r.metric("ttft_ms", "median")), _fmt(r.ttft_p99),
            _fmt(r.metric("tpot_ms", "median"), 1), _fmt(r.metric("output_throughput")),
            _fmt(r.metric("request_throughput"), 2), _fmt(r.failures),
            _fmt(r.hit_rate, pct=True), _fmt(f.imbalance if f else None, 2),
            _fmt(f.late_share if f else None, pct=True),
            _fmt(f.very_late_share if f else None, pct=True)]


def print_tables(args: argparse.Namespace, rows: list[RunRow]) -> None:
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload]
        print(f"\n{workload}: {mine[0].rate:g} req/s offered, {args.num_prompts} requests, "
              f"{args.replicas} replicas (TTFT, TPOT in ms)")
        print("  ".join(name.ljust(w) if i < 2 else name.rjust(w)
                        for i, (name, w) in enumerate(COLUMNS)))
        for r in mine:
            cells = row_cells(r)
            print("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                            for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=False)))
                  + ("  " + cells[-1] if len(cells) > len(COLUMNS) else ""))
    print("\nhit rate: prefix-cache hits / queries over the fleet; spread: most requests "
          "on one replica / the mean;\nlate: share of engine steps the simulator woke that "
          "long after their deadline; * : still distorted after every retry (busy machine),\n"
          "so that row measures the machine more than the router")


def verdicts(rows: list[RunRow]) -> list[dict[str, Any]]:
    """Print and return one verdict per (target, workload)."""
    out: list[dict[str, Any]] = []
    print()
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == workload and r.load is not None]
        out.append(_ttft_verdict(workload, mine))
        out.append(_hit_verdict(workload, mine))
        out.append(_workers_verdict(workload, mine))
    for v in out:
        print(f"{v['verdict']:<4}  {v['workload']}: {v['text']}")
    return out


def _ttft_verdict(workload: str, rows: list[RunRow]) -> dict[str, Any]:
    target = "dpserve default p99 TTFT <= best vllm-router p99 TTFT"
    ours = next((r for r in rows if r.router == "dpserve" and r.policy == DEFAULT_POLICY), None)
    theirs = [r for r in rows if r.router == "vllm-router" and r.ttft_p99 is not None]
    if ours is None or ours.ttft_p99 is None or not theirs:
        return _verdict("target 1", workload, "n/a", target, "not measured (both sides needed)")
    best = min(theirs, key=lambda r: r.ttft_p99)
    ok = ours.ttft_p99 <= best.ttft_p99
    return _verdict("target 1", workload, "PASS" if ok else "FAIL", target,
                    f"dpserve {DEFAULT_POLICY} p99 TTFT {ours.ttft_p99:,.0f} ms vs vllm-router "
                    f"{best.policy} {best.ttft_p99:,.0f} ms "
                    f"({ours.ttft_p99 / best.ttft_p99:.2f}x)",
                    ours=ours.ttft_p99, best=best.ttft_p99, best_policy=best.policy)


def _hit_verdict(workload: str, rows: list[RunRow]) -> dict[str, Any]:
    target = "dpserve prefix-affinity hit rate >= vllm-router cache_aware hit rate"
    ours = next((r for r in rows if r.router == "dpserve" and r.policy == PREFIX_POLICY), None)
    theirs = next((r for r in rows if r.router == "vllm-router" and r.policy == CACHE_AWARE),
                  None)
    if ours is None or theirs is None or ours.hit_rate is None or theirs.hit_rate is None:
        return _verdict("target 2", workload, "n/a", target, "not measured (both sides needed)")
    text = (f"dpserve {PREFIX_POLICY} hit rate {100 * ours.hit_rate:.1f}% vs vllm-router "
            f"{CACHE_AWARE} {100 * theirs.hit_rate:.1f}%")
    if theirs.hit_rate < MIN_SHARED_HIT_RATE:
        return _verdict("target 2", workload, "n/a", target,
                        text + " (no shared prefixes in this workload)",
                        ours=ours.hit_rate, best=theirs.hit_rate)
    ok = ours.hit_rate >= theirs.hit_rate
    return _verdict("target 2", workload, "PASS" if ok else "FAIL", target, text,
                    ours=ours.hit_rate, best=theirs.hit_rate)


def _workers_verdict(workload: str, rows: list[RunRow]) -> dict[str, Any]:
    target = "dpserve default p99 TTFT with --workers 2 within 5% of 1 worker"
    one = next((r for r in rows if r.router == "dpserve" and r.policy == DEFAULT_POLICY), None)
    two = next((r for r in rows if r.router == "dpserve-2w" and r.policy == DEFAULT_POLICY),
               None)
    if one is None or two is None or one.ttft_p99 is None or two.ttft_p99 is None:
        return _verdict("target 3", workload, "n/a", target, "not measured (both needed)")
    ratio = two.ttft_p99 / one.ttft_p99
    hits = ("" if one.hit_rate is None or two.hit_rate is None else
            f"; hit rate {100 * two.hit_rate:.1f}% vs {100 * one.hit_rate:.1f}%")
    return _verdict("target 3", workload, "PASS" if ratio <= 1.05 else "FAIL", target,
                    f"2 workers p99 TTFT {two.ttft_p99:,.0f} ms vs 1 worker "
                    f"{one.ttft_p99:,.0f} ms ({ratio:.2f}x){hits}",
                    ours=two.ttft_p99, best=one.ttft_p99)


def _verdict(name: str, workload: str, verdict: str, target: str, text: str,
             **numbers: Any) -> dict[str, Any]:
    return {"target": name, "description": target, "workload": workload, "verdict": verdict,
            "text": f"{name} ({target}): {text}", **numbers}
