"""Deploys against the load's request records: which requests each window holds, and
the table and verdicts of `adapter.py`.

Windows, on `time.perf_counter()`'s clock (the load records offsets from its start):

- a **deploy window** runs from the deploy request to done — for an adapter, on to the
  unload of the version it replaced, the last thing it changes in the engines. Its
  TTFT sample is every successful request that was waiting for its first token at
  any moment of it (one sent earlier and held up counts); failed and aborted
  requests are those in flight at any moment of it;
- a **steady window** is the `--steady-s` just before: the requests whose whole wait
  for a first token fell inside it.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from loadtest.client import RequestRecord
from loadtest.metrics import distribution, percentile_key
from loadtest.runner import RunOutcome

ABORTED = "abort"
WARM_UP = "warm-up"


@dataclass(frozen=True)
class Deploy:
    label: str
    kind: str
    """adapter | full"""
    round: str
    """1, 2, ... or WARM_UP (not in the medians)."""
    t_steady: float | None
    """Start of the steady window (None: deployed before the load started)."""
    t0: float
    """The deploy request."""
    t_started: float
    """`Rollout.start` returned: snapshot taken and checked."""
    t_done: float
    t_end: float
    """End of the deploy window: done, or the replaced adapter version unloaded."""
    replaced: bool = False
    """An adapter deploy that replaced a version (unloaded by `t_end`)."""
    per_replica: list[float] = field(default_factory=list)
    """Seconds each replica was out of rotation (full hot-loads)."""
    steps: dict[str, float] = field(default_factory=dict)
    """Seconds per hot-load step, the slowest replica's."""
    events: list[str] = field(default_factory=list)
    """The deploy record's events, each with its time since the deploy began."""

    @property
    def seconds(self) -> float:
        return self.t_done - self.t0


@dataclass(frozen=True)
class Window:
    steady_ttft_s: list[float]
    ttft_s: list[float]
    failed: list[str]
    """Why each request in flight during the deploy failed."""
    aborted: int


def _first_token_wait(r: RequestRecord, t_base: float) -> tuple[float, float]:
    start = t_base + r.start_s
    return start, (start + r.ttft_s) if r.ttft_s is not None else t_base + r.end_s


def window(d: Deploy, records: Iterable[RequestRecord], t_base: float) -> Window:
    steady, during, failed, aborted = [], [], [], 0
    for r in records:
        start, first = _first_token_wait(r, t_base)
        in_flight = start <= d.t_end and t_base + r.end_s >= d.t0
        if not r.ok:
            if in_flight:
                failed.append(r.error or "?")
            continue
        if in_flight and r.finish_reason == ABORTED:
            aborted += 1
        assert r.ttft_s is not None
        if start <= d.t_end and first >= d.t0:
            during.append(r.ttft_s)
        elif d.t_steady is not None and d.t_steady <= start and first < d.t0:
            steady.append(r.ttft_s)
    return Window(steady, during, failed, aborted)


def percentile_ms(values_s: Sequence[float], p: float) -> float | None:
    return distribution(values_s, (p,)).percentiles[percentile_key(p)]


def ms(values_s: Sequence[float], p: float) -> str:
    value = percentile_ms(values_s, p)
    return "-" if value is None else f"{value:.0f}"


def report(deploys: list[Deploy], outcome: RunOutcome,
           export_s: list[float]) -> None:
    records, t_base = outcome.records, outcome.started_perf_s
    windows = [window(d, records, t_base) for d in deploys]
    rows = [("round", "deploy", "total", "validate", "apply", "per replica", "unload",
             "failed", "aborted", "TTFT p50 ms", "TTFT p99 ms", "requests")]
    for d, w in zip(deploys, windows, strict=True):
        loaded = d.t_steady is not None
        rows.append((
            d.round, d.label, f"{d.seconds:.2f} s", f"{d.t_started - d.t0:.2f} s",
            f"{d.t_done - d.t_started:.2f} s",
            " / ".join(f"{s:.2f}" for s in d.per_replica) + " s" if d.per_replica else "-",
            f"{d.t_end - d.t_done:.2f} s" if d.replaced else "-",
            str(len(w.failed)) if loaded else "-", str(w.aborted) if loaded else "-",
            f"{ms(w.steady_ttft_s, 50)} -> {ms(w.ttft_s, 50)}" if loaded else "(no load)",
            f"{ms(w.steady_ttft_s, 99)} -> {ms(w.ttft_s, 99)}" if loaded else "",
            f"{len(w.steady_ttft_s)} / {len(w.ttft_s)}" if loaded else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print("(total: deploy request to done = validate (snapshot, checks) + apply; per replica: "
          "out of rotation; unload: after done, until the replaced version left the engines; "
          "TTFT: steady window -> deploy window; requests: TTFT samples in each)")
    for d in deploys:
        if d.steps:
            print(f"{d.label} steps, slowest replica: "
                  + ", ".join(f"{step} {took:.3f} s" for step, took in d.steps.items()))

    measured = {kind: [(d, w) for d, w in zip(deploys, windows, strict=True)
                       if d.kind == kind and d.round != WARM_UP] for kind in ("adapter", "full")}
    medians = {kind: statistics.median(d.seconds for d, _ in pairs)
               for kind, pairs in measured.items()}
    print()
    added: dict[str, float | None] = {}
    for kind, pairs in measured.items():
        steady = [t for _, w in pairs for t in w.steady_ttft_s]
        during = [t for _, w in pairs for t in w.ttft_s]
        failed = [why for _, w in pairs for why in w.failed]
        before, after = percentile_ms(steady, 99), percentile_ms(during, 99)
        added[kind] = after - before if after is not None and before is not None else None
        print(f"{kind}: median {medians[kind]:.2f} s over {len(pairs)} rounds ("
              + " / ".join(f"{d.seconds:.2f}" for d, _ in pairs) + f" s); {len(failed)} failed"
              + (f" {dict(Counter(failed))}" if failed else "")
              + f", {sum(w.aborted for _, w in pairs)} aborted while deploying (target 0)")
        print(f"  TTFT, steady -> deploy windows, pooled over rounds: p50 {ms(steady, 50)} -> "
              f"{ms(during, 50)} ms, p99 {ms(steady, 99)} -> {ms(during, 99)} ms "
              f"({len(steady)} -> {len(during)} requests)")
    bad = [r.error or "?" for r in records if not r.ok]
    print(f"whole run: {len(records)} requests, {len(bad)} failed"
          + (f" {dict(Counter(bad))}" if bad else "")
          + f", {sum(r.finish_reason == ABORTED for r in records)} aborted")
    print(f"export-merged took {statistics.median(export_s):.2f} s (median of {len(export_s)}; "
          "not in the full time: `dpserve deploy --merge` adds it)")
    ratio = medians["full"] / medians["adapter"]
    print(f"\nfull hot-load / adapter deploy: {ratio:.1f}x (medians; target >= 10x: "
          f"{'met' if ratio >= 10 else 'missed'})")
    print("p99 TTFT added by deploying: " + ", ".join(
        f"{kind} " + ("-" if delta is None else f"{delta:+.0f} ms")
        for kind, delta in added.items())
          + " (target: none for the adapter: " + ("-" if added["adapter"] is None else
                                                   "met" if added["adapter"] <= 0 else "missed")
          + ")")
