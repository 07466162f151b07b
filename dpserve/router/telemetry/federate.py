"""`GET /metrics/engines`: every replica's own vLLM metrics, each sample labelled `replica`.

Why the router serves them: `dpserve serve` binds replicas to loopback (their
dev endpoints must not be reachable), so Prometheus on another host cannot
scrape them, and their ports change on every restart. The router knows every
replica; on a scrape of `/metrics/engines` it fetches each replica's `/metrics`
concurrently (short timeout: a hung replica costs one scrape its series, never
the scrape), adds `replica="ID"` to every sample and merges the answers into
one exposition. On Kubernetes, where each engine is its own pod, Prometheus may
scrape the pods directly instead (and label them from pod metadata).

Only the engines' own families (`vllm:*`) are kept. A replica's `/metrics` also
holds its API server's `http_*` (per handler) and the Python client's
`python_*`/`process_*` series, hundreds of lines more per scrape that nothing
reads: requests are measured on the router's own `/metrics`, and so are the
replicas' GPUs or, for CPU replicas, their processes.

Merging keeps the text format valid: a metric family appears once, with one
`# HELP` and one `# TYPE` (the first replica's), followed by the samples of
every replica. vLLM's names are passed through unchanged; dpserve never
exports anything under `vllm:`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import httpx
from starlette.requests import Request
from starlette.responses import Response

from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.telemetry.metrics import CONTENT_TYPE, RouterMetrics

FETCH_TIMEOUT_S = 2.0
LABEL = "replica"
ENGINE_PREFIX = "vllm:"
"""The families `/metrics/engines` relays: the engine's own."""
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_info", "_gcount", "_gsum")


def escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _label_pairs(inside: str) -> list[tuple[str, str]]:
    """(name, quoted value) pairs of a label set's inside (`a="x",b="y"`), escapes honoured."""
    pairs, i, n = [], 0, len(inside)
    while (eq := inside.find("=", i)) >= 0:
        start = inside.find('"', eq)
        if start < 0:
            break
        j = start + 1
        while j < n and inside[j] != '"':
            j += 2 if inside[j] == "\\" else 1
        pairs.append((inside[i:eq].strip(), inside[start:j + 1]))
        i = j + 1
        while i < n and inside[i] in ", ":
            i += 1
    return pairs


def _split_sample(line: str) -> tuple[str, str, str]:
    """(name, inside of the braces, rest: ` value [timestamp]`) of one sample line."""
    brace = line.find("{")
    space = line.find(" ")
    if brace < 0 and space < 0:
        return line, "", ""  # no value: not a sample
    if brace < 0 or 0 <= space < brace:
        return line[:space], "", line[space:]
    i = brace + 1
    while i < len(line) and line[i] != "}":
        if line[i] == '"':  # skip a quoted value, whatever braces it holds
            i += 1
            while i < len(line) and line[i] != '"':
                i += 2 if line[i] == "\\" else 1
        i += 1
    return line[:brace], line[brace + 1:i], line[i + 1:]


def label_sample(line: str, value: str, label: str = LABEL) -> str:
    """One sample line with `label="value"` added first among its labels.

    A label of that name already on the sample is kept as `exported_<label>`,
    as Prometheus itself does on a clash.
    """
    name, labels, rest = _split_sample(line)
    pair = f'{label}="{escape_label_value(value)}"'
    if f"{label}=" in labels:  # possibly a clash: rebuild the label set
        labels = ",".join(f"exported_{k}={v}" if k == label else f"{k}={v}"
                          for k, v in _label_pairs(labels))
    inside = f"{pair},{labels}" if labels.strip() else pair
    return f"{name}{{{inside}}}{rest}"


@dataclass
class _Family:
    help: str | None = None
    type: str | None = None
    samples: list[str] = field(default_factory=list)


def merge_expositions(texts: Iterable[tuple[str, str]], label: str = LABEL,
                      prefix: str = ENGINE_PREFIX) -> str:
    """Merge (replica id, Prometheus text) pairs into one text, every sample labelled.

    Only families whose name starts with `prefix` are kept, with their HELP and TYPE.
    Families keep the order in which they first appear; HELP and TYPE come from
    the first replica that declared them. Other comments and blank lines are dropped.
    """
    families: dict[str, _Family] = {}
    for value, text in texts:
        current: str | None = None
        for raw in text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = parts[2]
                    if not current.startswith(prefix):
                        continue
                    family = families.setdefault(current, _Family())
                    if parts[1] == "HELP" and family.help is None:
                        family.help = line
                    elif parts[1] == "TYPE" and family.type is None:
                        family.type = line
                continue
            name, _, rest = _split_sample(line)
            if not rest.strip():
                continue
            if current is None or not (name == current or (
                    name.startswith(current) and name[len(current):] in _SUFFIXES)):
                current = name  # an untyped sample starts a family of its own
            if not current.startswith(prefix):
                continue
            families.setdefault(current, _Family()).samples.append(
                label_sample(line, value, label))
    out: list[str] = []
    for family in families.values():
        if not family.samples:
            continue
        out.extend(x for x in (family.help, family.type) if x is not None)
        out.extend(family.samples)
    return "\n".join(out) + "\n" if out else ""


async def fetch_engine_metrics(
    replicas: Iterable[Replica], client: httpx.AsyncClient, *, timeout_s: float,
) -> tuple[list[tuple[str, str]], list[str]]:
    """Every replica's /metrics text, concurrently: ([(id, text)], [ids that failed])."""
    async def one(r: Replica) -> str | None:
        try:
            resp = await client.get(r.url + "/metrics", timeout=timeout_s)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    replicas = list(replicas)
    texts = await asyncio.gather(*(one(r) for r in replicas))
    ok = [(r.id, t) for r, t in zip(replicas, texts, strict=True) if t is not None]
    failed = [r.id for r, t in zip(replicas, texts, strict=True) if t is None]
    return ok, failed


class EngineMetrics:
    """What `GET /metrics/engines` answers: every engine's series, fetched at most once
    per `max_age_s` however many callers ask, the callers meanwhile sharing one fetch.
    Uncached, each anonymous GET made the router query every engine; now the engines'
    cost is bounded by the router, not by who scrapes. A caller that leaves does not
    cancel the fetch the others wait for."""

    def __init__(self, pool: ReplicaPool, metrics: RouterMetrics, client: httpx.AsyncClient,
                 *, max_age_s: float, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        """`client`: the router's control-plane client (its owner closes it)."""
        self._pool = pool
        self._metrics = metrics
        self._client = client
        self._max_age_s = max_age_s
        self._timeout_s = timeout_s
        self._text: str | None = None
        self._fetched_at = 0.0
        self._pending: asyncio.Task[str] | None = None
        self.fetches = 0
        """Fetches of every engine made so far."""

    async def text(self) -> str:
        if self._text is not None and time.monotonic() - self._fetched_at < self._max_age_s:
            return self._text
        if self._pending is None:
            self._pending = asyncio.create_task(self._fetch(), name="dpserve-engine-metrics")
        return await asyncio.shield(self._pending)

    async def _fetch(self) -> str:
        try:
            self.fetches += 1
            ok, failed = await fetch_engine_metrics(self._pool, self._client,
                                                    timeout_s=self._timeout_s)
            for replica_id in failed:
                self._metrics.engine_scrape_errors.labels(replica_id).inc()
            self._text, self._fetched_at = merge_expositions(ok), time.monotonic()
            return self._text
        finally:
            self._pending = None


def engine_metrics_endpoint(source: EngineMetrics) -> Callable[[Request], Awaitable[Response]]:
    """The Starlette handler of `GET /metrics/engines`."""

    async def engine_metrics(request: Request) -> Response:
        return Response(await source.text(), media_type=CONTENT_TYPE)

    return engine_metrics
