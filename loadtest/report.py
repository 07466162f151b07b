"""Results as a JSON document (stable keys, see loadtest/README.md) and as printed tables."""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.client import RequestRecord
from loadtest.harness import RunResult, SweepParameter
from loadtest.metrics import Distribution, Metrics, percentile_key, tpot_s

SCHEMA = "dpserve-loadtest/1"
SWEEP_SCHEMA = "dpserve-loadtest-sweep/1"


def run_document(result: RunResult, *, detailed: bool = False) -> dict[str, Any]:
    """``{"schema", "config", "metadata", "metrics"[, "requests"]}``."""
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "config": config_dict(result),
        "metadata": metadata_dict(result),
        "metrics": _jsonable(dataclasses.asdict(result.metrics)),
    }
    if detailed:
        doc["requests"] = [record_dict(r) for r in result.records]
    return doc


def sweep_document(results: Sequence[RunResult], parameter: SweepParameter,
                   values: Sequence[float], *, detailed: bool = False) -> dict[str, Any]:
    """``{"schema", "sweep": {"parameter", "values"}, "points": [run document, ...]}``."""
    return {
        "schema": SWEEP_SCHEMA,
        "sweep": {"parameter": parameter, "values": [_jsonable(v) for v in values]},
        "points": [run_document(r, detailed=detailed) for r in results],
    }


def config_dict(result: RunResult) -> dict[str, Any]:
    config = dataclasses.asdict(result.config)
    # Header values may hold credentials: keep their names only.
    config["headers"] = sorted(result.config.headers)
    config["model"] = result.model
    config["ignore_eos"] = result.config.sends_ignore_eos
    config["request_count"] = result.config.request_count
    out: dict[str, Any] = _jsonable(config)
    return out


def metadata_dict(result: RunResult) -> dict[str, Any]:
    return {
        "started_at": result.started_at,
        "finished_at": result.finished_at,
        "time_zero_unix_s": result.time_zero_unix_s,
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "labels": dict(result.config.metadata),
    }


def record_dict(r: RequestRecord) -> dict[str, Any]:
    return {
        "index": r.index, "request_id": r.request_id, "ok": r.ok, "error": r.error,
        "detail": r.detail, "status": r.status, "replica": r.replica,
        "scheduled_s": r.scheduled_s, "start_s": r.start_s, "end_s": r.end_s,
        "ttft_s": r.ttft_s, "tpot_s": tpot_s(r), "latency_s": r.latency_s, "itl_s": r.itl_s,
        "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def _jsonable(value: Any) -> Any:
    """Paths as strings, infinities as "inf" (JSON has no infinity), tuples as lists."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


# --- tables ---------------------------------------------------------------------------------

_WIDTH = 60


def summary_table(result: RunResult) -> str:
    m, c = result.metrics, result.config
    lines = [f"{' Load test result ':=^{_WIDTH}}"]
    rows: list[tuple[str, Any]] = [
        ("Successful requests", m.completed),
        ("Failed requests", m.failed),
        ("Request rate configured (req/s)", c.request_rate),
        ("Burstiness", c.burstiness),
        ("Maximum request concurrency", c.max_concurrency or "none"),
        ("Peak concurrency", m.peak_concurrency),
        ("Benchmark duration (s)", m.duration_s),
        ("Total input tokens", m.total_input_tokens),
        ("Total generated tokens", m.total_output_tokens),
        ("Request throughput (req/s)", m.request_throughput),
        ("Output token throughput (tok/s)", m.output_throughput),
        ("Total token throughput (tok/s)", m.total_token_throughput),
    ]
    if m.request_goodput is not None:
        rows.append(("Request goodput (req/s)", m.request_goodput))
    lines += [_row(name, value) for name, value in rows]
    for title, dist in (("Time to First Token", m.ttft_ms),
                        ("Time per Output Token (excl. 1st token)", m.tpot_ms),
                        ("Inter-token Latency", m.itl_ms), ("End-to-end Latency", m.e2el_ms)):
        short = {"Time to First Token": "TTFT", "Inter-token Latency": "ITL",
                 "End-to-end Latency": "E2EL"}.get(title, "TPOT")
        lines.append(f"{' ' + title + ' ':-^{_WIDTH}}")
        lines += _dist_rows(short, dist)
        if short == "ITL" and m.itl_read_together is not None:
            lines.append(_row("ITL gaps read together (%)", 100 * m.itl_read_together))
    if m.failures:
        lines.append(f"{' Failures ':-^{_WIDTH}}")
        lines += [_row(reason, count) for reason, count in m.failures.items()]
    if m.per_replica:
        lines.append(f"{' Per replica ':-^{_WIDTH}}")
        lines.append(f"{'replica':<12}{'ok':>6}{'failed':>8}{'share':>8}"
                     f"{'TTFT p50':>13}{'TPOT p50':>13}")
        for rid, rm in m.per_replica.items():
            lines.append(f"{rid:<12}{rm.completed:>6}{rm.failed:>8}{rm.share:>8.1%}"
                         f"{_ms(rm.ttft_ms.median):>13}{_ms(rm.tpot_ms.median):>13}")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def sweep_table(results: Sequence[RunResult], parameter: SweepParameter) -> str:
    """One row per point; tail latencies at the highest percentile asked for."""
    head = "rate" if parameter == "request_rate" else "conc"
    top = percentile_key(max(results[0].config.percentiles)) if results else "p99"
    lines = [f"{head:>8}{'ok':>7}{'fail':>6}{'req/s':>9}{'tok/s':>10}{'TTFT p50':>10}"
             f"{'TTFT ' + top:>11}{'TPOT p50':>10}{'TPOT ' + top:>11}{'E2EL ' + top:>11}"]
    for r in results:
        m = r.metrics
        x = r.config.request_rate if parameter == "request_rate" else r.config.max_concurrency
        lines.append(
            f"{_fmt(x):>8}{m.completed:>7}{m.failed:>6}{m.request_throughput:>9.2f}"
            f"{m.output_throughput:>10.1f}{_ms(m.ttft_ms.median):>10}"
            f"{_ms(m.ttft_ms.percentiles[top]):>11}{_ms(m.tpot_ms.median):>10}"
            f"{_ms(m.tpot_ms.percentiles[top]):>11}{_ms(m.e2el_ms.percentiles[top]):>11}")
    return "\n".join(lines + _sweep_notes(results, parameter))


def _sweep_notes(results: Sequence[RunResult], parameter: SweepParameter) -> list[str]:
    """What a point's req/s measures when it is not a steady state: a burst sent at once,
    or a run whose drain is a large part of it (a rate above what the fleet serves)."""
    if parameter != "request_rate":
        return []
    notes = []
    for r in results:
        m, rate = r.metrics, r.config.request_rate
        n = m.completed + m.failed
        drain = m.duration_s - m.sending_s
        if math.isinf(rate):
            notes.append(f"note: inf sends all {n} requests at once: its req/s is one "
                         f"burst's makespan, in the largest batches the fleet forms")
        elif m.duration_s > 0 and drain > 0.25 * m.duration_s:
            notes.append(
                f"note: at {_fmt(rate)} req/s the {n} requests were sent over "
                f"{m.sending_s:.2f} s and the last answers came {drain:.2f} s later: its "
                f"req/s is of a ramp and a drain, not a steady state (give --num-prompts "
                f"for arrivals of at least 10x the drain)")
    return notes


def _dist_rows(short: str, d: Distribution) -> list[str]:
    rows = [_row(f"Mean {short} (ms)", d.mean), _row(f"Median {short} (ms)", d.median),
            _row(f"Std {short} (ms)", d.std)]
    rows += [_row(f"{key.upper()} {short} (ms)", v) for key, v in d.percentiles.items()]
    return rows


def _row(name: str, value: Any) -> str:
    return f"{name + ':':<44}{_fmt(value)}"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def failures_line(metrics: Metrics) -> str:
    """``"3 of 100 requests failed: timeout 2, http_503 1"``."""
    total = metrics.completed + metrics.failed
    reasons = ", ".join(f"{k} {v}" for k, v in metrics.failures.items())
    return f"{metrics.failed} of {total} requests failed: {reasons}"
