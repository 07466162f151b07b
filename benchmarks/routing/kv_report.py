"""The tables of ``kv_study.py``: per arm, the targets' ratios, the timeline of the reset."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from benchmarks.routing.kv_study import Run
    from benchmarks.routing.workloads import Conversation
    from dpserve.sim.config import SimConfig

KV, PREFIX = "kv-aware", "prefix-affinity"
WINDOWS_BEFORE, WINDOWS_AFTER = 3, 6
"""Windows of the timeline shown before and from the reset."""


def spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """Median [min, max] of `values`."""
    return (f"{fmt.format(float(np.median(values)))} "
            f"[{fmt.format(min(values))}, {fmt.format(max(values))}]")


def report(pressure: float, replicas: int, convs: Mapping[int, Sequence[Conversation]],
           cfgs: Mapping[int, SimConfig], working_sets: Mapping[int, int],
           runs: Mapping[str, list[Run]], *, reset_at: float | None, window_s: float) -> None:
    """The tables of one cache size: every mapping is by workload seed, `runs` by arm."""
    seeds = list(convs)
    ws = [working_sets[s] for s in seeds]
    per = [cfgs[s].num_blocks for s in seeds]
    turns = [sum(len(c.turns) for c in convs[s]) for s in seeds]
    print(f"\n== working set / fleet KV cache = {pressure:g}; seeds {seeds}, "
          f"{len(convs[seeds[0]])} conversations ({int(np.median(turns))} turns), "
          f"{replicas} replicas")
    peak = [r.peak_open_blocks / w for rs in runs.values() for r, w in zip(rs, ws, strict=True)]
    print(f"working set {int(np.median(ws)):,} blocks (seeds {min(ws):,}-{max(ws):,}): the "
          f"sum over conversations of the blocks of the last prompt and answer; the open "
          f"conversations' contexts peaked at {spread(peak)} of it; KV cache "
          f"{int(np.median(per)):,} blocks of {cfgs[seeds[0]].block_size} tokens per replica")
    print(f"{'arm':<20}{'hit rate':>9}{'TTFT mean':>10}{'p50':>7}{'p99':>7}{'out tok/s':>10}"
          f"{'moved':>6}{'preempt':>8}{'fallbacks':>10}   p99 per seed")
    for name, rs in runs.items():
        t = [r.ttft_ms() for r in rs]
        print(f"{name:<20}{100 * _med([r.hit_rate for r in rs]):>8.1f}%"
              f"{_med([float(x.mean()) for x in t]):>10.0f}"
              f"{_med([float(np.median(x)) for x in t]):>7.0f}"
              f"{_med([float(np.percentile(x, 99)) for x in t]):>7.0f}"
              f"{_med([r.output_tok_s for r in rs]):>10.0f}"
              f"{_med([float(r.moved()) for r in rs]):>6.0f}"
              f"{_med([float(r.preemptions) for r in rs]):>8.0f}"
              f"{_med([float(r.fallbacks) for r in rs]):>10.0f}"
              f"   {[round(float(np.percentile(x, 99))) for x in t]}")
    _ratios(runs)
    if reset_at is not None:
        _timeline(runs, reset_at, window_s)


def _med(values: Sequence[float]) -> float:
    return float(np.median(values))


def _p99(r: Run) -> float:
    return float(np.percentile(r.ttft_ms(), 99))


def _mean(r: Run) -> float:
    return float(r.ttft_ms().mean())


def _ratio(runs: Mapping[str, list[Run]], a: str, b: str, f: Callable[[Run], float]
           ) -> list[float]:
    """Per seed, f(arm a) / f(arm b)."""
    return [f(x) / f(y) for x, y in zip(runs[a], runs[b], strict=True)]


def _ratios(runs: Mapping[str, list[Run]]) -> None:
    """Ratios per seed, median [min, max]."""
    print("ratios per seed, median [min, max]:")
    for two in (f"{KV} x2", f"{KV} x2 peers"):
        if KV in runs and two in runs:
            print(f"  {two} / {KV}: hit rate "
                  f"{spread(_ratio(runs, two, KV, lambda r: r.hit_rate), '{:.3f}')} (target "
                  f">= 0.97), mean TTFT {spread(_ratio(runs, two, KV, _mean), '{:.3f}')}"
                  f" (target <= 1.05)")
    peers = [n for n in runs if not n.startswith(KV)]
    if not peers:
        return
    best = min(peers, key=lambda n: _med([_p99(r) for r in runs[n]]))
    for kv in (n for n in runs if n.startswith(KV)):
        print(f"  {kv} p99 TTFT / best peer's ({best}): "
              f"{spread(_ratio(runs, kv, best, _p99))} (target <= 0.85 under pressure)")
        pa = kv.replace(KV, PREFIX)
        if pa in runs:
            print(f"  {kv} hit rate / {pa}'s: "
                  f"{spread(_ratio(runs, kv, pa, lambda r: r.hit_rate), '{:.3f}')}")


def _timeline(runs: Mapping[str, list[Run]], reset_at: float, window_s: float) -> None:
    first = max(0, int(reset_at // window_s) - WINDOWS_BEFORE)
    shown = range(first, int(reset_at // window_s) + WINDOWS_AFTER)
    label = "".join(f"{w * window_s:>6.0f}s" for w in shown)
    for what, get in (("hit rate %", lambda r: [100 * h for h in r.windows]),
                      ("mean TTFT ms", lambda r: r.window_ttft_ms(window_s))):
        print(f"{what} per {window_s:g} s window (median over seeds; window starts; "
              f"reset at {reset_at:g} s):")
        print(f"{'':<20}{label}")
        for name, rs in runs.items():
            per_seed = [get(r) for r in rs]
            cells = []
            for w in shown:
                values = [v[w] for v in per_seed if w < len(v) and not math.isnan(v[w])]
                cells.append(f"{_med(values):>7.0f}" if values else f"{'-':>7}")
            print(f"{name:<20}{''.join(cells)}")
