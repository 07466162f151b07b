"""Rows as the text a person reads: columns, cells and the fleet's summary line.

Pure, so what the screen says is tested without a terminal. A figure nobody
reported is `-`, never 0.

The `KV index` column and the summary's `kv-aware` part show only while the router
routes on KV events (it exports that policy's series): under another policy they
would be nothing but dashes.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpserve.top.window import WINDOW_S, KVSummary, Row

COLUMNS = ("replica", "state", "version", "adapters", "in-flight", "waiting", "tok/s",
           "TTFT p50", "TTFT p99", "KV", "prefix hit", "util", "memory")
"""Column headings; TTFT, tok/s and prefix hit are over the last `WINDOW_S` seconds."""
KV_INDEX = "KV index"
"""The column added under `kv-aware`, after `prefix hit`."""

GIB = 1024.0 ** 3


def _or_dash(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def seconds(value: float | None) -> str:
    """A latency: milliseconds below 10 s, seconds above."""
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"


def size(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / GIB:.1f} GiB" if value >= GIB else f"{value / 1024 ** 2:.0f} MiB"


def utilization(row: Row) -> str:
    return "-" if row.utilization is None else f"{row.utilization_of} {row.utilization:.0%}"


def memory(row: Row) -> str:
    if row.memory_used_bytes is None:
        return "-"
    if row.memory_total_bytes is None:
        return f"{size(row.memory_used_bytes)} rss"
    return f"{size(row.memory_used_bytes)} / {size(row.memory_total_bytes)}"


def percent(value: float | None) -> str:
    return _or_dash(value, ".0%")


def kv_index(row: Row) -> str:
    """Blocks the router knows the replica holds, or why it routes it blind: `off` (its
    events are not followed), `stale` (events were missed: it scores no cached prefix)."""
    if row.kv_events_following is False:
        return "off"
    if row.kv_index_stale:
        return "stale"
    return _or_dash(row.kv_index_blocks, ".0f")


def columns(kv_aware: bool) -> tuple[str, ...]:
    """The headings, with `KV index` when the router routes on KV events."""
    if not kv_aware:
        return COLUMNS
    at = COLUMNS.index("prefix hit") + 1
    return (*COLUMNS[:at], KV_INDEX, *COLUMNS[at:])


def cells(row: Row, kv_aware: bool = False) -> tuple[str, ...]:
    """One row's cells, in `columns(kv_aware)`' order."""
    kv = (kv_index(row),) if kv_aware else ()
    return (row.id, row.state, row.version, ",".join(row.adapters) or "-",
            str(row.in_flight), _or_dash(row.waiting, ".0f"),
            _or_dash(row.tokens_per_s, ".1f"), seconds(row.ttft_p50_s),
            seconds(row.ttft_p99_s), percent(row.kv_cache_usage),
            percent(row.prefix_hit_rate), *kv, utilization(row), memory(row))


def kv_routing(kv: KVSummary) -> str:
    """`kv-aware` in a phrase: decisions made on events, the prefix-cache hit rate the
    router expected beside the one the engines found, and event trouble if any."""
    text = (f"kv-aware: {percent(kv.on_events)} on events, hit "
            f"{percent(kv.expected_hit_rate)} expected / {percent(kv.found_hit_rate)} found")
    for count, word in ((kv.resyncs, "resync"), (kv.gaps, "gap")):
        if count:
            text += f", {count:.0f} {word}{'' if count == 1 else 's'}"
    return text


def summary(rows: Sequence[Row], span_s: float, kv: KVSummary | None = None) -> str:
    """The fleet in one line: replicas ready, requests in flight, tokens/s in total, and
    under `kv-aware` how its routing does."""
    ready = sum(r.state == "ready" for r in rows)
    rates = [r.tokens_per_s for r in rows if r.tokens_per_s is not None]
    line = (f"{len(rows)} replica{'' if len(rows) == 1 else 's'}, {ready} ready · "
            f"{sum(r.in_flight for r in rows)} in flight")
    if rates:
        line += f" · {sum(rates):.1f} tok/s"
    if kv is not None:
        line += f" · {kv_routing(kv)}"
    window = min(span_s, WINDOW_S)
    windowed = rates or (kv is not None and any(
        v is not None for v in (kv.on_events, kv.expected_hit_rate, kv.found_hit_rate)))
    line += f" · rates over the last {window:.0f} s" if windowed else ""
    return line
