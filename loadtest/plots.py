"""PNG plots of a run or a sweep, drawn with matplotlib's Agg renderer.

Figures are built without ``pyplot``, so no global backend or figure state is
touched and nothing needs a display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loadtest.harness import RunResult, SweepParameter
from loadtest.metrics import percentile_key, tpot_s

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_PANELS = (("TTFT", "ms"), ("TPOT", "ms"), ("ITL", "ms"), ("E2E latency", "ms"))


def latency_cdfs(results: Sequence[RunResult], labels: Sequence[str], path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E latency, one line per result."""
    fig = _figure(2, 2, (11, 8))
    axes = fig.axes
    for result, label in zip(results, labels, strict=True):
        ok = [r for r in result.records if r.ok]
        series = (
            [r.ttft_s for r in ok if r.ttft_s is not None],
            [t for r in ok if (t := tpot_s(r)) is not None],
            [gap for r in ok for gap in r.itl_s],
            [r.latency_s for r in ok if r.latency_s is not None],
        )
        for ax, values in zip(axes, series, strict=True):
            if values:
                xs = np.sort(np.asarray(values)) * 1000.0
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)
    for ax, (name, unit) in zip(axes, _PANELS, strict=True):
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} ({unit})")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.lines and len(results) > 1:
            ax.legend(fontsize="small")
    return _save(fig, path)


def sweep_plot(results: Sequence[RunResult], parameter: SweepParameter, path: Path) -> Path:
    """Achieved throughput, and tail latencies, against the offered load of each point."""
    top = percentile_key(max(results[0].config.percentiles))
    xs = [_offered(r, parameter) for r in results]
    xlabel = "offered request rate (req/s)" if parameter == "request_rate" \
        else "max concurrency"
    fig = _figure(1, 2, (12, 4.5))
    left, right = fig.axes
    left.plot(xs, [r.metrics.request_throughput for r in results], "o-", label="requests/s")
    if parameter == "request_rate":
        left.plot(xs, xs, ":", color="grey", label="offered")
    left.set_ylabel("completed requests/s")
    tokens = left.twinx()
    tokens.plot(xs, [r.metrics.output_throughput for r in results], "s--", color="tab:orange",
                label="output tokens/s")
    tokens.set_ylabel("output tokens/s")
    left.set_title("Throughput")
    left.legend(loc="upper left", fontsize="small")
    tokens.legend(loc="lower right", fontsize="small")
    for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
        ys = [getattr(r.metrics, name).percentiles[top] for r in results]
        right.plot(xs, [math.nan if y is None else y for y in ys], "o-",
                   label=f"{name[:-3].upper()} {top}")
    right.set_yscale("log")
    right.set_ylabel("latency (ms)")
    right.set_title(f"{top} latency")
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _offered(result: RunResult, parameter: SweepParameter) -> float:
    if parameter == "max_concurrency":
        return float(result.config.max_concurrency or 0)
    rate = result.config.request_rate
    # An infinite rate cannot sit on an axis: plot it at the throughput reached.
    return result.metrics.request_throughput if math.isinf(rate) else rate


def _figure(rows: int, cols: int, size: tuple[float, float]) -> Figure:
    from matplotlib.figure import Figure  # heavy; only when plotting

    fig = Figure(figsize=size, layout="constrained")
    fig.subplots(rows, cols)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
    return path
