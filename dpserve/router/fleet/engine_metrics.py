"""What a vLLM engine says about its own load, read from its Prometheus text.

The router counts its own requests in flight, but only the engine knows how
many of them are queued rather than running, and how full its KV cache is.
:func:`parse_engine_metrics` turns one scrape of a replica's `/metrics` into an
:class:`EngineLoad`; the scraping itself (I/O) belongs to the health loop.

Names are those of vLLM 0.32 (`vllm/v1/metrics/loggers.py`). Every vLLM metric
carries `model_name` and `engine` labels (several engines when one server runs
data-parallel internally), so values are combined over label sets: request
counts and cache counters are summed, KV-cache usage (a fraction) takes the
fullest engine. A metric that is absent is None, never a guessed 0: an engine
that has not reported yet must not look idle.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
LORA_INFO = "vllm:lora_requests_info"
"""One sample per set of adapters seen (labels `running_lora_adapters`,
`waiting_lora_adapters`: comma-separated names; `max_lora`), its value the time that
set was last current: the newest sample is the engine's state now."""

_SUMMED = (RUNNING, WAITING, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS)
_WANTED = frozenset((*_SUMMED, KV_CACHE_USAGE))
_READ = (*_WANTED, LORA_INFO)
"""What a line must start with to be parsed at all: the rest (~600 lines of histograms
on a CPU engine) is skipped by one C-level prefix test per line. Parsing every line
cost the router's event loop ~5 ms per scrape of an idle engine (50 KB), and more with
the loop's core shared, twice a second with two replicas."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of one engine server; None where the metric was absent."""

    num_requests_running: int | None = None
    """Requests in the engine's running batch."""
    num_requests_waiting: int | None = None
    """Requests the engine accepted but cannot schedule yet (no KV space or batch slot)."""
    kv_cache_usage_perc: float | None = None
    """KV-cache usage as a fraction, 0.0 to 1.0 (vLLM's name says perc; it is not)."""
    prefix_cache_queries: float | None = None
    """Tokens looked up in the prefix cache since the engine started (a counter)."""
    prefix_cache_hits: float | None = None
    """Tokens found in the prefix cache since the engine started (a counter)."""
    lora_running: frozenset[str] | None = None
    """LoRA adapters (engine names) of the requests in the running batch."""
    lora_waiting: frozenset[str] | None = None
    """LoRA adapters of the requests waiting, e.g. for a free adapter slot."""
    max_loras: int | None = None
    """Adapters the engine computes with at once (its `--max-loras`)."""
    lora_at: float | None = None
    """Unix time the engine last reported those sets (at every step it runs): an idle
    engine keeps reporting the adapters of its last step, which are no longer running."""

    @property
    def num_requests(self) -> int | None:
        """Running plus waiting: the engine's whole queue, or None if it reported neither."""
        if self.num_requests_running is None and self.num_requests_waiting is None:
            return None
        return (self.num_requests_running or 0) + (self.num_requests_waiting or 0)

    @property
    def prefix_cache_hit_ratio(self) -> float | None:
        """Lifetime hits / queries; None before the first query."""
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


def parse_engine_metrics(text: str) -> EngineLoad:
    """Read an :class:`EngineLoad` from a vLLM `/metrics` response body.

    Tolerant by design: comments, unknown metrics, malformed lines and NaN
    samples are skipped, so a format change costs a metric, not the scrape.
    """
    sums: dict[str, float] = {}
    kv_usage: float | None = None
    lora: tuple[float, str] | None = None  # (newest time, its line)
    for line in text.split("\n"):  # the format's only line end; \r may be in a label
        if not line.lstrip().startswith(_READ):
            continue
        sample = _parse_sample(line)
        if sample is None:
            continue
        name, value = sample
        if name == LORA_INFO:
            if not math.isnan(value) and (lora is None or value >= lora[0]):
                lora = (value, line)
            continue
        if name.endswith("_total"):  # counters are exposed as NAME_total
            name = name[: -len("_total")]
        if name not in _WANTED or math.isnan(value):
            continue
        if name == KV_CACHE_USAGE:
            kv_usage = value if kv_usage is None else max(kv_usage, value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    return EngineLoad(
        num_requests_running=_count(sums.get(RUNNING)),
        num_requests_waiting=_count(sums.get(WAITING)),
        kv_cache_usage_perc=kv_usage,
        prefix_cache_queries=sums.get(PREFIX_CACHE_QUERIES),
        prefix_cache_hits=sums.get(PREFIX_CACHE_HITS),
        **(_lora_state(*lora) if lora is not None else {}),
    )


def _lora_state(at: float, line: str) -> dict[str, Any]:
    """The adapter fields of EngineLoad from a `vllm:lora_requests_info` sample."""
    labels = _labels(line)
    state: dict[str, Any] = {
        "lora_at": at,
        "lora_running": _names(labels.get("running_lora_adapters", "")),
        "lora_waiting": _names(labels.get("waiting_lora_adapters", "")),
    }
    with contextlib.suppress(ValueError):
        slots = int(labels.get("max_lora", ""))
        if slots >= 1:
            state["max_loras"] = slots
    return state


def _names(joined: str) -> frozenset[str]:
    return frozenset(n for n in joined.split(",") if n)


def _labels(line: str) -> dict[str, str]:
    """The labels of one sample line (`name{a="x",b="y"} v`); {} when it has none or
    they are malformed. Values are unescaped (backslash, quote and newline escapes)."""
    start = line.find("{")
    if start < 0:
        return {}
    block = line[start + 1:]
    labels: dict[str, str] = {}
    i = 0
    while i < len(block):
        eq = block.find("=", i)
        if eq < 0 or eq + 1 >= len(block) or block[eq + 1] != '"':
            return labels
        key = block[i:eq].strip(" ,")
        value, i = _quoted(block, eq + 2)
        if i < 0:
            return {}
        labels[key] = value
        while i < len(block) and block[i] in " ,":
            i += 1
        if i < len(block) and block[i] == "}":
            return labels
    return labels


def _quoted(block: str, i: int) -> tuple[str, int]:
    """The escaped string starting at `block[i]` (after its opening quote) and the
    index after its closing quote; -1 for an unterminated one."""
    out: list[str] = []
    while i < len(block):
        ch = block[i]
        if ch == '"':
            return "".join(out), i + 1
        if ch == "\\" and i + 1 < len(block):
            i += 1
            out.append({"n": "\n"}.get(block[i], block[i]))
        else:
            out.append(ch)
        i += 1
    return "", -1


def _count(value: float | None) -> int | None:
    return None if value is None or math.isinf(value) else max(0, round(value))


def _parse_sample(line: str) -> tuple[str, float] | None:
    """`name{labels} value [timestamp]` -> (name, value); None for anything else.

    Label values may hold spaces, `}` and escaped quotes, so the label block is
    skipped by scanning quotes rather than by splitting.
    """
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    end = 0
    while end < len(line) and line[end] not in "{ \t":
        end += 1
    name, rest = line[:end], line[end:]
    if rest.startswith("{"):
        close = _label_block_end(rest)
        if close < 0:
            return None
        rest = rest[close + 1:]
    fields = rest.split()
    if not name or not fields:
        return None
    try:
        return name, float(fields[0])
    except ValueError:
        return None


def _label_block_end(text: str) -> int:
    """Index of the `}` closing the label block that `text` starts with, or -1."""
    in_quotes = escaped = False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = in_quotes
        elif ch == '"':
            in_quotes = not in_quotes
        elif ch == "}" and not in_quotes:
            return i
    return -1
