"""The results table of the router benchmark, the derived "added" numbers and the verdicts."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, NamedTuple

from benchmarks.router.overhead_measure import Env, Stats, TargetResult

TARGETS = ("direct", "dpserve", "dpserve-baseline", "dpserve-no-migration", "dpserve-workers",
           "vllm-router")
"""`dpserve-no-migration` (`--migration-off-too`): dpserve with `--migration-limit 0`;
`dpserve-baseline` (`--baseline-ref REF`): dpserve as committed at REF, for before/after;
`dpserve-workers` (`--workers-too N`): dpserve with `--workers N` (use with `--no-pin`)."""
TARGET_MIGRATION_CPU_RATIO = 1.15
"""Router CPU per streamed request with stream migration on (token ids tracked) over
off, at most."""
TARGET_THROUGHPUT_RATIO = 0.5
"""dpserve's req/s at c=C as a fraction of vllm-router's, at least."""
TARGET_ADDED_P50_MS = 0.3
"""dpserve's p50 at c=1 minus direct's, at most."""
TARGET_CHUNK_DELAY_MS = 1.0
"""Median delay dpserve adds to a streamed chunk on its way (upstream write to client read)."""
COALESCE_SLACK = 0.05
"""Share of events dpserve may deliver coalesced beyond what direct shows."""


class Row(NamedTuple):
    section: str
    metric: str
    values: dict[str, float | None]
    digits: int = 3
    sign: bool = False
    ratio: bool = True
    """Show dpserve/vllm-router (not for numbers near zero, where it is noise)."""


def _case(r: TargetResult | None, key: str, attr: str) -> float | None:
    stats: Stats | None = r.cases.get(key) if r else None
    return getattr(stats, attr) if stats else None


def _per_core(r: TargetResult, key: str) -> float | None:
    """1e6 / the router's CPU microseconds per request."""
    cpu = _case(r, key, "router_cpu_us_per_req")
    return 1e6 / cpu if cpu else None


def derived(results: dict[str, TargetResult]) -> dict[str, dict[str, Any]]:
    """Per router target: what it adds over direct, in ms."""
    direct = results.get("direct")
    out: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        if name == "direct" or direct is None:
            continue

        def added(key: str, attr: str, r: TargetResult = r) -> float | None:
            mine, base = _case(r, key, attr), _case(direct, key, attr)
            return None if mine is None or base is None else mine - base

        def paced(attr: str, r: TargetResult = r) -> float | None:
            mine = getattr(r.paced, attr) if r.paced else None
            base = getattr(direct.paced, attr) if direct.paced else None
            return None if mine is None or base is None else mine - base

        out[name] = {
            "added_p50_c1_ms": added("c1", "p50_ms"),
            "added_p50_c1_aiohttp_ms": added("c1_aiohttp", "p50_ms"),
            "added_first_byte_stream_c1_ms": added("stream_c1", "first_byte_p50_ms"),
            "added_last_byte_stream_c1_ms": added("stream_c1", "p50_ms"),
            "added_first_event_paced_ms": paced("first_delivery_p50_ms"),
            "added_per_chunk_p50_ms": paced("delivery_p50_ms"),
            "added_per_chunk_p99_ms": paced("delivery_p99_ms"),
        }
    return out


def table_rows(args: argparse.Namespace, results: dict[str, TargetResult]) -> list[Row]:
    add = derived(results)
    c = args.concurrency

    def each(get: Callable[[TargetResult], float | None]) -> dict[str, float | None]:
        return {name: get(r) for name, r in results.items()}

    def case(key: str, attr: str) -> dict[str, float | None]:
        return each(lambda r: _case(r, key, attr))

    def plus(key: str) -> dict[str, float | None]:
        return {name: add.get(name, {}).get(key) for name in results}

    tool = next((r.cases["c1"].tool for r in results.values() if "c1" in r.cases), "?")
    rows = [
        Row("completions c=1", f"p50 ms ({tool})", case("c1", "p50_ms")),
        Row("completions c=1", f"p99 ms ({tool})", case("c1", "p99_ms")),
        Row("completions c=1", "added p50 ms", plus("added_p50_c1_ms"), sign=True),
    ]
    if any("c1_aiohttp" in r.cases for r in results.values()):
        rows += [Row("completions c=1", "p50 ms (aiohttp)", case("c1_aiohttp", "p50_ms")),
                 Row("completions c=1", "added p50 ms (aiohttp)",
                     plus("added_p50_c1_aiohttp_ms"), sign=True)]
    section = f"completions c={c}"
    rows += [
        Row(section, "req/s", case("cN", "req_per_s"), 0),
        Row(section, "p50 ms", case("cN", "p50_ms")),
        Row(section, "p99 ms", case("cN", "p99_ms")),
        Row(section, "router CPU us/req", case("cN", "router_cpu_us_per_req"), 0),
        # What one core could do if the router had it all: least disturbed by other work.
        Row(section, "req/s per router core", each(lambda r: _per_core(r, "cN")), 0),
    ]
    if args.no_stream:
        return rows
    section = f"stream {args.chunks}ev c=1"
    rows += [
        Row(section, "first byte p50 ms", case("stream_c1", "first_byte_p50_ms")),
        Row(section, "last byte p50 ms", case("stream_c1", "p50_ms")),
        Row(section, "added first byte ms", plus("added_first_byte_stream_c1_ms"), sign=True),
        Row(section, "added last byte ms", plus("added_last_byte_stream_c1_ms"), sign=True),
        Row(f"stream {args.chunks}ev c={c}", "req/s", case("stream_cN", "req_per_s"), 0),
        Row(f"stream {args.chunks}ev c={c}", "router CPU us/req",
            case("stream_cN", "router_cpu_us_per_req"), 0),
    ]
    section = f"paced stream {args.chunk_delay_ms:g}ms"

    def paced(attr: str, scale: float = 1.0) -> dict[str, float | None]:
        def get(r: TargetResult) -> float | None:
            value = getattr(r.paced, attr) if r.paced else None
            return None if value is None else value * scale
        return each(get)

    rows += [
        Row(section, "chunk delivery p50 ms", paced("delivery_p50_ms")),
        Row(section, "chunk delivery p99 ms", paced("delivery_p99_ms")),
        Row(section, "added per chunk p50 ms", plus("added_per_chunk_p50_ms"), sign=True,
            ratio=False),
        Row(section, "added per chunk p99 ms", plus("added_per_chunk_p99_ms"), sign=True,
            ratio=False),
        Row(section, "added first chunk ms", plus("added_first_event_paced_ms"), sign=True,
            ratio=False),
        Row(section, "gap p50 ms", paced("gap_p50_ms"), ratio=False),
        Row(section, "gap p99 ms", paced("gap_p99_ms"), ratio=False),
        Row(section, "events coalesced %", paced("coalesced_ratio", 100.0), 1, ratio=False),
    ]
    return rows


def render(rows: list[Row], names: list[str]) -> str:
    """Sections down, targets across, then dpserve/vllm-router."""
    ratio = "dpserve" in names and "vllm-router" in names
    widths = {n: max(11, len(n)) for n in names}
    header = f"{'case':<22} {'metric':<24}" + "".join(f" {n:>{widths[n]}}" for n in names)
    header += f" {'dpserve/vllm-router':>20}" if ratio else ""
    lines = [header, "-" * len(header)]
    previous = ""
    for row in rows:
        spec = f"{'+' if row.sign else ''},.{row.digits}f"
        line = f"{row.section if row.section != previous else '':<22} {row.metric:<24}"
        for n in names:
            v = row.values.get(n)
            line += f" {'-' if v is None else format(v, spec):>{widths[n]}}"
        if ratio:
            a, b = row.values.get("dpserve"), row.values.get("vllm-router")
            shown = f"{a / b:.2f}x" if row.ratio and a is not None and b and b > 0 else "-"
            line += f" {shown:>20}"
        lines.append(line)
        previous = row.section
    return "\n".join(lines)


def verdicts(args: argparse.Namespace, results: dict[str, TargetResult]) -> dict[str, Any]:
    """PASS / FAIL / N/A for each target, with the numbers behind it."""
    add = derived(results).get("dpserve", {})
    out: dict[str, Any] = {}
    ours = _case(results.get("dpserve"), "cN", "req_per_s")
    theirs = _case(results.get("vllm-router"), "cN", "req_per_s")
    if ours is None or not theirs:
        out["throughput"] = {"verdict": "N/A", "why": "dpserve or vllm-router not measured"}
    else:
        ratio = ours / theirs
        mine_core, their_core = (_per_core(results[n], "cN") for n in ("dpserve", "vllm-router"))
        out["throughput"] = {"verdict": "PASS" if ratio >= TARGET_THROUGHPUT_RATIO else "FAIL",
                             "dpserve_req_per_s": ours, "vllm_router_req_per_s": theirs,
                             "ratio": ratio, "target_ratio": TARGET_THROUGHPUT_RATIO,
                             "per_core_ratio": mine_core / their_core
                             if mine_core and their_core else None}
    added = add.get("added_p50_c1_ms")
    out["added_latency"] = {
        "verdict": "N/A" if added is None else ("PASS" if added <= TARGET_ADDED_P50_MS else "FAIL"),
        "added_p50_ms": added, "target_ms": TARGET_ADDED_P50_MS,
    }
    chunk = add.get("added_per_chunk_p50_ms")
    mine = results["dpserve"].paced if "dpserve" in results else None
    base = results["direct"].paced if "direct" in results else None
    if chunk is None or mine is None or base is None or mine.coalesced_ratio is None:
        out["stream_buffering"] = {"verdict": "N/A", "why": "no paced stream measured"}
    else:
        coalesced_ok = mine.coalesced_ratio <= (base.coalesced_ratio or 0.0) + COALESCE_SLACK
        ok = chunk <= TARGET_CHUNK_DELAY_MS and coalesced_ok and not mine.errors
        out["stream_buffering"] = {
            "verdict": "PASS" if ok else "FAIL", "added_per_chunk_ms": chunk,
            "added_per_chunk_p99_ms": add.get("added_per_chunk_p99_ms"),
            "coalesced_ratio": mine.coalesced_ratio, "direct_coalesced_ratio": base.coalesced_ratio,
            "target_ms": TARGET_CHUNK_DELAY_MS,
        }
    on, off = (_case(results.get(n), "stream_cN", "router_cpu_us_per_req")
               for n in ("dpserve", "dpserve-no-migration"))
    if on is None or not off:
        out["migration_cost"] = {"verdict": "N/A", "why": "--migration-off-too not given"}
    else:
        out["migration_cost"] = {
            "verdict": "PASS" if on / off <= TARGET_MIGRATION_CPU_RATIO else "FAIL",
            "on_us": on, "off_us": off, "ratio": on / off,
            "target_ratio": TARGET_MIGRATION_CPU_RATIO}
    return out


def print_report(args: argparse.Namespace, env: Env, results: dict[str, TargetResult]) -> None:
    names = [n for n in TARGETS if n in results]
    cores = os.cpu_count() or 0
    upstream = "nginx " + env.versions.get("nginx", "") if env.nginx else "fixed_upstream.py"
    load = env.versions.get("wrk", "wrk") if env.wrk else "aiohttp client"
    rounds = f"; median of {args.rounds} interleaved rounds" if args.rounds > 1 else ""
    print(f"\nrouter overhead: {args.upstreams} fixed-response upstreams ({upstream}), "
          f"load: {load}; {cores} cores, {env.placement.describe()}{rounds}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in env.versions.items()))
    for name in names:
        r = results[name]
        if r.argv:
            print(f"{name}: ready after {r.ready_s:.1f} s: {' '.join(r.argv)}")
    if cores <= 2:
        print("on 2 cores the load generator and the upstreams share one core: absolute req/s "
              "are lower than on a big machine; compare routers with each other.")
    before = env.load_before
    if before is not None:
        busy = before > 0.5 * cores
        print(f"load average (1 min) before the run: {before:.2f}"
              + (" - other work is running: latencies and req/s are unreliable" if busy else ""))
    print()
    print(render(table_rows(args, results), names))
    errors = [(n, k, s) for n in names for k, s in results[n].cases.items() if s.errors]
    errors += [(n, "paced", p) for n in names if (p := results[n].paced) and p.errors]
    for name, key, stats in errors:
        print(f"errors: {name} {key}: {stats.errors} {'; '.join(stats.error_samples)}")
    prof = results.get("dpserve")
    if prof and prof.profile:
        print(f"\nprofile of the dpserve router at c={args.concurrency} "
              f"({prof.profile['req_per_s_under_profiler']:,.0f} req/s under py-spy): "
              f"{prof.profile['speedscope']} (open in https://www.speedscope.app)")
    print()
    for key, v in verdicts(args, results).items():
        print(f"target {_verdict_line(key, v)}")


def _verdict_line(key: str, v: dict[str, Any]) -> str:
    verdict = v["verdict"]
    if key == "throughput":
        if verdict == "N/A":
            return f"throughput: N/A ({v['why']})"
        per_core = v["per_core_ratio"]
        cpu = f"; by router CPU per request {per_core:.2f}x" if per_core else ""
        return (f"throughput at c=C >= {v['target_ratio']:.1f}x vllm-router: dpserve "
                f"{v['dpserve_req_per_s']:,.0f} req/s = {v['ratio']:.2f}x "
                f"({v['vllm_router_req_per_s']:,.0f}){cpu} -> {verdict}")
    if key == "added_latency":
        shown = "-" if v["added_p50_ms"] is None else f"{v['added_p50_ms']:+.3f} ms"
        return f"added p50 latency at c=1 <= {v['target_ms']:.1f} ms: dpserve {shown} -> {verdict}"
    if key == "migration_cost":
        if verdict == "N/A":
            return f"stream migration cost: N/A ({v['why']})"
        return (f"router CPU per streamed request, migration on / off <= "
                f"{v['target_ratio']:.2f}x: {v['on_us']:,.0f} / {v['off_us']:,.0f} us = "
                f"{v['ratio']:.2f}x -> {verdict}")
    if verdict == "N/A":
        return f"no per-chunk buffering: N/A ({v['why']})"
    return (f"no per-chunk buffering (<= {v['target_ms']:.1f} ms per chunk, no extra coalescing):"
            f" dpserve {v['added_per_chunk_ms']:+.3f} ms per chunk (p50; p99 "
            f"{v['added_per_chunk_p99_ms']:+.3f}), {v['coalesced_ratio']:.0%} events coalesced "
            f"(direct {v['direct_coalesced_ratio']:.0%}) -> {verdict}")
