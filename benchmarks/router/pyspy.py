"""Where a Python router's time goes: py-spy samples, grouped by function and by layer.

``py-spy record --format speedscope --function`` samples the router's Python
stacks (idle threads excluded, so percentages are of the time it was busy) and
writes a file https://www.speedscope.app opens as a flame graph. The same
samples are aggregated here by *self* time (the innermost Python frame of each
sample) per function and per layer. py-spy sees Python frames only: time in C
extensions (httptools' parser, uvloop's socket calls, the json scanner) is
billed to the Python function that called into them, which is why "uvicorn"
includes httptools' parsing and "asyncio/uvloop" the event loop's own work.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# (layer, module path prefixes); the first layer with a matching prefix wins.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("dpserve proxy", ("dpserve/router/forward/proxy.py",)),
    ("metrics (dpserve + prometheus_client)", ("dpserve/metrics/", "prometheus_client/")),
    ("dpserve other (auth, pool, policy, app)", ("dpserve/",)),
    ("uvicorn + httptools (server, parsing)", ("uvicorn/", "httptools/")),
    ("starlette (routing, middleware)", ("starlette/",)),
    ("aiohttp client (+ multidict, yarl)", ("aiohttp/", "multidict/", "yarl/", "propcache/",
                                            "aiohappyeyeballs/", "aiosignal/", "frozenlist/")),
    ("json", ("json/",)),
    ("logging", ("logging/",)),
    ("asyncio / uvloop (event loop, tasks)", ("asyncio/", "uvloop/")),
)
OTHER = "other"


@dataclass(frozen=True, kw_only=True)
class ProfileSummary:
    """Self-time shares of the busy samples; ``top`` is (function, file:line, share)."""

    samples: int
    busy_s: float
    """py-spy weighs each sample by the time it stands for."""
    layers: dict[str, float]
    top: list[tuple[str, str, float]]
    top_inclusive_dpserve: list[tuple[str, str, float]] = field(default_factory=list)


def layer_of(file: str) -> str:
    """The layer a source file belongs to, by its module path."""
    path = _short(file)
    for layer, prefixes in LAYERS:
        if path.startswith(prefixes):
            return layer
    return OTHER


def py_spy_argv(py_spy: str, pid: int, out: Path, duration_s: float, rate: int) -> list[str]:
    return [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s))),
            "--rate", str(rate), "--format", "speedscope", "--function", "--output", str(out)]


# Leaves where a thread waits in C without py-spy seeing it idle: an executor's worker
# blocked on its queue (the router has one, idle, for the event loop's default executor).
IDLE_LEAVES = frozenset({("_worker", "concurrent/futures/thread.py")})


def summarize_speedscope(path: Path, top_n: int = 12) -> ProfileSummary:
    """Aggregate a py-spy speedscope file by self time (and dpserve frames by inclusive time)."""
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    self_counts: Counter[int] = Counter()
    inclusive: Counter[int] = Counter()  # values are seconds: Counter sums any number
    total = 0.0
    n_samples = 0
    for profile in data["profiles"]:
        weights = profile.get("weights") or [1] * len(profile["samples"])
        for stack, weight in zip(profile["samples"], weights, strict=True):
            if not stack or _is_idle(frames[stack[-1]]):
                continue
            total += weight
            n_samples += 1
            self_counts[stack[-1]] += weight
            for index in set(stack):
                inclusive[index] += weight
    if not total:
        return ProfileSummary(samples=0, busy_s=0.0, layers={}, top=[])

    def where(index: int) -> tuple[str, str]:
        frame = frames[index]
        return frame["name"], f"{_short(frame.get('file') or '?')}:{frame.get('line') or '?'}"

    layers: Counter[str] = Counter()
    for index, count in self_counts.items():
        layers[layer_of(frames[index].get("file") or "")] += count
    top = [(*where(i), c / total) for i, c in self_counts.most_common(top_n)]
    # The router's own functions; the CLI frames around everything would all read 100%.
    ours = [(i, c) for i, c in inclusive.most_common()
            if _short(frames[i].get("file") or "").startswith(("dpserve/router/",
                                                                "dpserve/metrics/"))][:top_n]
    return ProfileSummary(
        samples=n_samples,
        busy_s=total,
        layers={k: v / total for k, v in layers.most_common()},
        top=top,
        top_inclusive_dpserve=[(*where(i), c / total) for i, c in ours],
    )


def _is_idle(frame: dict) -> bool:
    return (frame.get("name"), _short(frame.get("file") or "")) in IDLE_LEAVES


def write_collapsed(speedscope: Path, out: Path) -> None:
    """The same samples as collapsed stacks (``a;b;c count``), for flamegraph.pl or inferno."""
    data = json.loads(speedscope.read_text())
    frames = data["shared"]["frames"]
    stacks: Counter[str] = Counter()
    for profile in data["profiles"]:
        weights = profile.get("weights") or [1] * len(profile["samples"])
        for stack, weight in zip(profile["samples"], weights, strict=True):
            names = (f"{frames[i]['name']} ({_short(frames[i].get('file') or '?')})"
                     for i in stack)
            stacks[";".join(names)] += weight
    out.write_text("".join(f"{k} {v}\n" for k, v in stacks.most_common()))


def render(summary: ProfileSummary) -> str:
    lines = [f"router self time by layer ({summary.samples} samples, "
             f"{summary.busy_s:.1f} s busy; idle time not counted):"]
    lines += [f"  {share:6.1%}  {layer}" for layer, share in summary.layers.items()]
    lines.append("top functions by self time:")
    lines += [f"  {share:6.1%}  {name}  {where}" for name, where, share in summary.top]
    if summary.top_inclusive_dpserve:
        lines.append("dpserve functions by inclusive time (self + what they call):")
        lines += [f"  {share:6.1%}  {name}  {where}"
                  for name, where, share in summary.top_inclusive_dpserve]
    return "\n".join(lines)


def _short(file: str) -> str:
    """A source path as a module path: site-packages, the stdlib folder or the repo dropped."""
    path = file.replace("\\", "/")
    if "/site-packages/" in path:
        return path.rsplit("/site-packages/", 1)[1]
    stdlib = re.search(r"/lib/python3\.\d+/(.+)", path)
    if stdlib:
        return stdlib.group(1)
    # The checkout, or a tree exported by --dpserve-ref: from the last dpserve/ folder on.
    ours = re.search(r"(?:^|/)(dpserve/(?:(?!/dpserve/).)*)$", path)
    return ours.group(1) if ours else path


def as_json(summary: ProfileSummary) -> dict[str, object]:
    return {
        "samples": summary.samples,
        "busy_s": summary.busy_s,
        "self_by_layer": summary.layers,
        "top_self": [{"function": n, "where": w, "share": s} for n, w, s in summary.top],
        "top_inclusive_dpserve": [{"function": n, "where": w, "share": s}
                                  for n, w, s in summary.top_inclusive_dpserve],
    }

