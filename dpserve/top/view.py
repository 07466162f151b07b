"""Rows as the text a person reads: columns, cells and the fleet's summary line.

Pure, so what the screen says is tested without a terminal. A figure nobody
reported is `-`, never 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpserve.top.window import WINDOW_S, Row

COLUMNS = ("replica", "state", "version", "adapters", "in-flight", "waiting", "tok/s",
           "TTFT p50", "TTFT p99", "KV", "prefix hit", "util", "memory")
"""Column headings; TTFT, tok/s and prefix hit are over the last `WINDOW_S` seconds."""

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


def cells(row: Row) -> tuple[str, ...]:
    """One row's cells, in COLUMNS' order."""
    return (row.id, row.state, row.version, ",".join(row.adapters) or "-",
            str(row.in_flight), _or_dash(row.waiting, ".0f"),
            _or_dash(row.tokens_per_s, ".1f"), seconds(row.ttft_p50_s),
            seconds(row.ttft_p99_s), percent(row.kv_cache_usage),
            percent(row.prefix_hit_rate), utilization(row), memory(row))


def summary(rows: Sequence[Row], span_s: float) -> str:
    """The fleet in one line: replicas ready, requests in flight, tokens/s in total."""
    ready = sum(r.state == "ready" for r in rows)
    rates = [r.tokens_per_s for r in rows if r.tokens_per_s is not None]
    line = (f"{len(rows)} replica{'' if len(rows) == 1 else 's'}, {ready} ready · "
            f"{sum(r.in_flight for r in rows)} in flight")
    if rates:
        line += f" · {sum(rates):.1f} tok/s"
    window = min(span_s, WINDOW_S)
    line += f" · rates over the last {window:.0f} s" if rates else ""
    return line
