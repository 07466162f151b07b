"""The rows, tables and verdicts of ``quality_kv.py``.

Targets, each PASS/FAIL:

- **two routers on KV events** (on every workload both ran): `kv-aware` behind 2 routers
  keeps at least ``X2_MIN_HIT_RATIO`` of 1 router's prefix-cache hit rate (n/a where
  prompts share nothing) and at most ``X2_MAX_TTFT_RATIO`` of its mean TTFT;
- **under cache pressure** (``PRESSURE_WORKLOAD``): 1 `kv-aware` router's p99 TTFT is at
  most ``PRESSURE_MAX_P99_RATIO`` of the best vllm-router arm's, and its hit rate above
  prefix affinity's (1 router each). The same ratios for 2 routers are printed too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.routing.sim_fleet import FleetDelta

KV_AWARE, PREFIX = "kv-aware", "prefix-affinity"
PRESSURE_WORKLOAD = "chat-1.5x"
X2_MIN_HIT_RATIO, X2_MAX_TTFT_RATIO = 0.97, 1.05
PRESSURE_MAX_P99_RATIO = 0.85
MIN_SHARED_HIT_RATE = 0.01
"""Below this hit rate a workload shares no prefixes and hit-rate ratios mean nothing."""
KV_SERIES = ("dpserve_kv_routing_decisions_total", "dpserve_kv_routed_tokens_total",
             "vllm_router_kv_placement_lookups_total", "vllm_router_kv_routing_inputs_total")
"""The routers' own account of what KV-aware routing did (counters, summed over routers)."""
_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)')


@dataclass(frozen=True)
class Arm:
    """A router and policy, behind ``routers`` processes that clients reach in turn."""

    kind: str
    """``dpserve`` or ``vllm-router``."""
    policy: str
    routers: int = 1
    peers: bool = False
    """dpserve routers told of each other (`--peer`, `dpserve.router.peers`)."""
    workers: int = 1
    """Data-plane processes per dpserve router (`--workers`)."""

    @property
    def name(self) -> str:
        """As given on the command line: ``kind:policy``, then ``:N`` routers when more
        than one, ``:peers``, ``:wN`` workers when more than one."""
        return (f"{self.kind}:{self.policy}" + (f":{self.routers}" if self.routers > 1 else "")
                + (":peers" if self.peers else "")
                + (f":w{self.workers}" if self.workers > 1 else ""))

    @property
    def label(self) -> str:
        return (f"{self.kind} {self.policy}" + (f" x{self.routers}" if self.routers > 1 else "")
                + (" peers" if self.peers else "")
                + (f" w{self.workers}" if self.workers > 1 else ""))


ARM_FORM = "KIND:POLICY[:ROUTERS][:peers][:wWORKERS]"


def parse_arm(text: str) -> Arm:
    """``dpserve:kv-aware``, ``dpserve:kv-aware:2``, ``dpserve:kv-aware:2:peers``,
    ``dpserve:kv-aware:w2`` (one router, two data-plane workers) and so on, in that
    order (ValueError otherwise)."""
    parts = text.strip().split(":")
    if len(parts) < 2 or not all(parts[:2]):
        raise ValueError(f"{text!r}: expected {ARM_FORM}")
    kind, policy, rest = parts[0], parts[1], parts[2:]
    routers, peers, workers = 1, False, 1
    if rest and rest[0].isdigit():
        routers = int(rest.pop(0))
        if routers < 1:
            raise ValueError(f"{text!r}: ROUTERS must be at least 1")
    if rest and rest[0] == "peers":
        peers = bool(rest.pop(0))
    if rest and re.fullmatch(r"w[0-9]+", rest[0]):
        workers = int(rest.pop(0)[1:])
        if workers < 1:
            raise ValueError(f"{text!r}: WORKERS must be at least 1")
    if rest:
        raise ValueError(f"{text!r}: expected {ARM_FORM}")
    if peers and (kind != "dpserve" or routers < 2):
        raise ValueError(f"{text!r}: peers are dpserve routers, two or more")
    if workers > 1 and kind != "dpserve":
        raise ValueError(f"{text!r}: workers are a dpserve router's (--workers)")
    return Arm(kind, policy, routers, peers, workers)


def kv_series(text: str) -> dict[str, float]:
    """The `KV_SERIES` samples of a Prometheus text page, keyed ``name{labels}`` (labels
    as exposed), one router's."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in KV_SERIES:
            key = m.group(1) + (m.group(2) or "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def add_series(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


@dataclass(kw_only=True)
class Row:
    """One (workload, arm) run."""

    workload: str
    arm: Arm
    load: dict[str, Any] | None = None
    """The load's result: loadtest's document, or chat_load's (``metrics`` in both)."""
    fleet: FleetDelta | None = None
    cpu_s: float | None = None
    """CPU seconds the router process(es) used over the measured window."""
    kv: dict[str, float] = field(default_factory=dict)
    deploy_windows: list[float | None] = field(default_factory=list)
    """With a deploy: mean TTFT (ms) of the turns sent in the 10 s windows from 20 s
    before the reset to 20 s after it."""
    error: str | None = None
    load_average: float | None = None
    wall_s: float | None = None

    def metric(self, *path: str) -> Any:
        node: Any = (self.load or {}).get("metrics")
        for key in path:
            if not isinstance(node, dict):
                return None
            node = node.get(key)
        return node

    @property
    def hit_rate(self) -> float | None:
        return self.fleet.hit_rate if self.fleet else None

    @property
    def ttft_mean(self) -> float | None:
        return _float(self.metric("ttft_ms", "mean"))

    @property
    def ttft_p99(self) -> float | None:
        return _float(self.metric("ttft_ms", "percentiles", "p99"))

    @property
    def cpu_ms_per_request(self) -> float | None:
        done = self.metric("completed")
        return None if self.cpu_s is None or not done else 1e3 * self.cpu_s / done

    def kv_summary(self) -> str:
        """What the router(s) say KV-aware routing did: dpserve's decisions by basis and
        the share of prompt tokens it routed to a cached prefix; vllm-router's lookups."""
        k = self.kv
        basis = {b: k.get(f'dpserve_kv_routing_decisions_total{{basis="{b}"}}', 0.0)
                 for b in ("events", "no_events", "no_tokens")}
        prompt = k.get('dpserve_kv_routed_tokens_total{kind="prompt"}', 0.0)
        if sum(basis.values()):
            cached = k.get('dpserve_kv_routed_tokens_total{kind="cached"}', 0.0)
            return (f"{basis['events']:.0f}/{basis['no_events']:.0f}/{basis['no_tokens']:.0f}"
                    f" {100 * cached / prompt if prompt else 0:.0f}%")
        hits = k.get('vllm_router_kv_placement_lookups_total{result="hit"}', 0.0)
        misses = k.get('vllm_router_kv_placement_lookups_total{result="miss"}', 0.0)
        return f"lookups {hits:.0f} hit/{misses:.0f} miss" if hits + misses else "-"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["arm"] = self.arm.name
        d["fleet"] = ({k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
                       for k, v in self.fleet.as_dict().items()} if self.fleet else None)
        return d


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


COLUMNS = (("arm", 30), ("hit rate", 8), ("TTFT mean", 9), ("p50", 6), ("p99", 6),
           ("out tok/s", 9), ("failed", 6), ("CPU ms/req", 10), ("load avg", 8),
           ("late>10ms", 9), ("mean miss", 9), ("kv: events/none/no-tok cached", 30))


def _fmt(value: float | None, spec: str = ",.0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def row_cells(r: Row) -> list[str]:
    f = r.fleet
    label = r.arm.label + (" *" if f is not None and f.distorted else "")
    if r.load is None:
        return [label, r.error or "no result"]
    return [label, _fmt(None if r.hit_rate is None else 100 * r.hit_rate, ".1f", "%"),
            _fmt(r.ttft_mean), _fmt(r.metric("ttft_ms", "median")), _fmt(r.ttft_p99),
            _fmt(r.metric("output_throughput")), _fmt(r.metric("failed")),
            _fmt(r.cpu_ms_per_request, ".2f"), _fmt(r.load_average, ".1f"),
            _fmt(None if f is None or f.very_late_share is None else 100 * f.very_late_share,
                 ".1f", "%"),
            _fmt(None if f is None else f.mean_error_ms, ".1f", " ms"), r.kv_summary()]


def print_tables(rows: Sequence[Row], headers: dict[str, str]) -> None:
    """One table per workload; ``headers[workload]`` says what was offered."""
    for workload in dict.fromkeys(r.workload for r in rows):
        print(f"\n{workload}: {headers.get(workload, '')} (TTFT in ms)")
        print("  ".join(n.ljust(w) if i == 0 else n.rjust(w)
                        for i, (n, w) in enumerate(COLUMNS)))
        for r in (r for r in rows if r.workload == workload):
            cells = row_cells(r)
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                            for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=False))))
        windows = [r for r in rows if r.workload == workload and r.deploy_windows]
        if windows:
            print("  mean TTFT (ms) of the turns sent around the reset, by 10 s window: "
                  "-20..-10 / -10..0 / 0..10 / 10..20 s")
            for r in windows:
                print(f"    {r.arm.label:<30} "
                      + " / ".join(_fmt(w) for w in r.deploy_windows))
    print("\nhit rate: the fleet's prefix-cache hits / queries; CPU: the router process(es)' "
          "CPU seconds over the run / requests completed;\nlate>10ms, mean miss: the "
          "simulator's step timing error (* : past sim_fleet's distortion bars); kv: "
          "dpserve's decisions by basis\n(events / no events yet / no tokens) and the share "
          "of prompt tokens it routed to a cached prefix, or vllm-router's lookups")


def _find(rows: Sequence[Row], workload: str, kind: str, policy: str, routers: int
          ) -> Row | None:
    return next((r for r in rows if r.workload == workload and r.arm == Arm(kind, policy, routers)
                 and r.load is not None), None)


def verdicts(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Print and return every target's verdict."""
    out: list[dict[str, Any]] = []
    for workload in dict.fromkeys(r.workload for r in rows):
        one, two = (_find(rows, workload, "dpserve", KV_AWARE, n) for n in (1, 2))
        if one is None or two is None:
            continue
        if one.hit_rate is None or two.hit_rate is None or one.hit_rate < MIN_SHARED_HIT_RATE:
            out.append(_verdict("x2 hit rate", workload, None, None,
                                "n/a (no shared prefixes)" if one.hit_rate is not None
                                else "n/a (not measured)"))
        else:
            ratio = two.hit_rate / one.hit_rate
            out.append(_verdict("x2 hit rate", workload, ratio, ratio >= X2_MIN_HIT_RATIO,
                                f"kv-aware x2 / x1 hit rate {100 * two.hit_rate:.1f}% / "
                                f"{100 * one.hit_rate:.1f}% = {ratio:.3f} "
                                f"(target >= {X2_MIN_HIT_RATIO})"))
        if one.ttft_mean and two.ttft_mean is not None:
            ratio = two.ttft_mean / one.ttft_mean
            out.append(_verdict("x2 mean TTFT", workload, ratio, ratio <= X2_MAX_TTFT_RATIO,
                                f"kv-aware x2 / x1 mean TTFT {two.ttft_mean:,.0f} / "
                                f"{one.ttft_mean:,.0f} ms = {ratio:.3f} "
                                f"(target <= {X2_MAX_TTFT_RATIO})"))
    for n in (1, 2):
        out += _pressure(rows, n)
    print()
    for v in out:
        print(f"{v['verdict']:<4}  {v['workload']}: {v['target']}: {v['text']}")
    return out


def _pressure(rows: Sequence[Row], routers: int) -> list[dict[str, Any]]:
    """kv-aware against the best vllm-router arm (any number of routers) and against
    prefix affinity behind as many routers, under cache pressure. Only 1 router is a
    target; 2 are reported as information."""
    w, tag = PRESSURE_WORKLOAD, "" if routers == 1 else f" x{routers}"
    ours = _find(rows, w, "dpserve", KV_AWARE, routers)
    if ours is None:
        return []
    out = []
    theirs = [r for r in rows if r.workload == w and r.arm.kind == "vllm-router"
              and r.ttft_p99 is not None]
    if theirs and ours.ttft_p99 is not None:
        best = min(theirs, key=lambda r: r.ttft_p99 or math.inf)
        assert best.ttft_p99 is not None
        ratio = ours.ttft_p99 / best.ttft_p99
        out.append(_verdict(f"p99 vs best vllm-router{tag}", w, ratio,
                            ratio <= PRESSURE_MAX_P99_RATIO if routers == 1 else None,
                            f"kv-aware{tag} p99 TTFT {ours.ttft_p99:,.0f} ms / {best.arm.label}"
                            f" {best.ttft_p99:,.0f} ms = {ratio:.2f} "
                            f"(target <= {PRESSURE_MAX_P99_RATIO})"))
    base = _find(rows, w, "dpserve", PREFIX, routers)
    if base is not None and base.hit_rate is not None and ours.hit_rate is not None:
        ok = ours.hit_rate > base.hit_rate
        out.append(_verdict(f"hit rate vs prefix-affinity{tag}", w,
                            ours.hit_rate / base.hit_rate if base.hit_rate else None,
                            ok if routers == 1 else None,
                            f"kv-aware{tag} {100 * ours.hit_rate:.1f}% vs prefix-affinity{tag}"
                            f" {100 * base.hit_rate:.1f}% (target: above)"))
    return out


def _verdict(target: str, workload: str, ratio: float | None, ok: bool | None, text: str
             ) -> dict[str, Any]:
    verdict = "n/a" if ratio is None and ok is None else (
        "info" if ok is None else "PASS" if ok else "FAIL")
    return {"target": target, "workload": workload, "ratio": ratio, "verdict": verdict,
            "text": text}
