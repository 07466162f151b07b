"""What `dpserve deploy` and `dpserve status` do: call the router's admin API, print.

    dpserve deploy CHECKPOINT_DIR [--router URL] [--batch 1] [--canary-prompt P]
    dpserve deploy --watch OUTPUT_DIR [--interval-s 10] [--max-deploys N] [--timeout-s T]
    dpserve status [--router URL]

The admin key comes from `--admin-key-file` or DPSERVE_ADMIN_KEY (without one the
router answers `/admin` to loopback clients only). The checkpoint path is sent
absolute: the router and the replicas read it from their own filesystem (the
same machine, or a shared volume).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import httpx

from dpserve.checkpoint import latest_checkpoint

DEFAULT_ROUTER = "http://127.0.0.1:8000"
ADMIN_KEY_ENV = "DPSERVE_ADMIN_KEY"
# Validation hashes every byte of the checkpoint before the router answers.
VALIDATE_TIMEOUT_S = 1800.0
CANARY_EVERY_S = 5
"""`dpserve deploy` prints the canary's progress this often."""
POLL_S = 0.25


class AdminError(Exception):
    """The router refused or could not be reached; the message says why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def read_admin_key(path: str | None, environ: dict[str, str] | None = None) -> str | None:
    environ = dict(os.environ) if environ is None else environ
    if path is None:
        return environ.get(ADMIN_KEY_ENV) or None
    lines = [ln.strip() for ln in Path(path).read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise AdminError(f"{path} holds no key")
    return lines[0]


class AdminClient:
    """The router's `/admin` API over httpx; the caller closes it (`async with`)."""

    def __init__(self, router_url: str, admin_key: str | None = None, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.router_url = router_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.router_url, headers=headers,
                                       transport=transport, timeout=30.0)

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def start_deploy(self, checkpoint: Path, options: dict[str, Any]) -> dict[str, Any]:
        """`checkpoint` must be absolute (the router reads it from its own filesystem)."""
        body = {"checkpoint": str(checkpoint), **options}
        return _object(await self._call("POST", "/admin/deploy", json=body,
                                        timeout=VALIDATE_TIMEOUT_S))

    async def deploy(self, deploy_id: str) -> dict[str, Any]:
        return _object(await self._call("GET", f"/admin/deploy/{deploy_id}"))

    async def latest_deploy(self) -> dict[str, Any] | None:
        try:
            return _object(await self._call("GET", "/admin/deploy"))
        except AdminError as exc:
            if exc.status in (404, 503):
                return None
            raise

    async def replicas(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/admin/replicas"))["replicas"])

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            resp = await self._http.request(method, path, **kw)
        except httpx.ConnectError:
            raise AdminError(f"no router answers at {self.router_url}: start one with "
                             "`dpserve serve --model MODEL`, or point --router (or "
                             "$DPSERVE_ROUTER_URL) at the one running") from None
        except httpx.HTTPError as exc:
            raise AdminError(f"cannot reach the router at {self.router_url}: "
                             f"{type(exc).__name__} {exc}") from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            message = (body or {}).get("error", {}).get("message") if isinstance(
                body, dict) else None
            raise AdminError(f"HTTP {resp.status_code}: {message or resp.text[:300]}",
                             resp.status_code)
        return body


def _object(body: Any) -> dict[str, Any]:
    """A JSON object the router answered; AdminError for anything else."""
    if not isinstance(body, dict):
        raise AdminError(f"the router answered {type(body).__name__}, not a JSON object")
    return body


def shown_path(path: str) -> str:
    """`path` relative to the working directory when it is below it (as the user most
    likely typed it), else whole."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


async def run_deploy(client: AdminClient, checkpoint: Path, options: dict[str, Any],
                     out: TextIO) -> int:
    """Start a deploy, print each replica's progress until it ends; 0 if it succeeded."""
    try:
        record = await client.start_deploy(checkpoint, options)
    except AdminError as exc:
        print(f"deploy refused: {exc}", file=out, flush=True)
        return 1
    n = len(record["replicas"])
    what = (f"adapter {record['adapter']} version {record['version']} (was "
            f"{record['previous_version'] or 'not served'}), {n} replica(s), one at a time"
            if record.get("adapter") else
            f"version {record['version']} (was {record['previous_version']}), {n} "
            f"replica(s), {record['options']['batch']} at a time")
    print(f"deploy {record['id']}: {shown_path(record['checkpoint'])}\n  {what}", file=out,
          flush=True)
    shown: dict[str, tuple[Any, ...]] = {}
    replicas = ReplicaLines()
    started = time.monotonic()
    while True:
        for line in replicas.update(record["replicas"], time.monotonic()):
            print("  " + line, file=out, flush=True)
        canary = record.get("canary")
        if canary and "canary" in canary:  # a line every CANARY_EVERY_S and at the end
            key = ("canary", int(canary["elapsed_s"] // CANARY_EVERY_S), "passed" in canary)
            if shown.get("canary") != key:
                shown["canary"] = key
                print("  " + _canary_line(canary), file=out, flush=True)
        if record["done"]:
            break
        await asyncio.sleep(POLL_S)
        record = await client.deploy(record["id"])
    took = time.monotonic() - started
    if record.get("quality"):
        print("  " + _quality_line(record["quality"]), file=out, flush=True)
    if record["state"] == "succeeded":
        mixed = record.get("mixed_versions") or 0
        print(f"succeeded in {took:.1f} s: {record['version']} is deployed"
              + (f"; up to {mixed} response(s) in flight at a pause finished on the new "
                 "weights (--no-mixed-versions to avoid)" if mixed else ""),
              file=out, flush=True)
        return 0
    print(f"{record['state']} after {took:.1f} s: {record['error']}", file=out, flush=True)
    if record["state"] == "rolled_back":
        print(f"  the replicas serve {record['previous_version']} again", file=out, flush=True)
    return 1


def _canary_line(c: dict[str, Any]) -> str:
    def side(s: dict[str, Any]) -> str:
        ttft = ("-" if s["ttft_p50_ms"] is None
                else f"{s['ttft_p50_ms']:.0f}/{s['ttft_p90_ms']:.0f} ms")
        return f"{s['requests']} req, {s['error_rate']:.1%} errors, TTFT p50/p90 {ttft}"

    b = c.get("baseline")
    line = (f"canary {c['replica']} {c['elapsed_s']:.0f}/{c['duration_s']:g} s at "
            f"{c['weight']:g}%: {side(c['canary'])}"
            + (f" · baseline {b['replica']} at {b['weight']:g}%: {side(b)}" if b else "")
            + (f" · others {side(c['others'])}" if c["others"]["requests"] or not b else ""))
    verdict = c.get("verdict")
    if verdict is not None and "outcome" not in c:
        line += f"; look {c['looks']}: {verdict_line(verdict)}"
    if "outcome" in c:
        line += f"; {c['outcome']}" + (
            f" ({'promoted' if c['passed'] else 'rolled back'})"
            if c["outcome"] == "inconclusive" else "") + f": {c['reason']}"
    return line


def verdict_line(v: dict[str, Any]) -> str:
    """A look's verdict in a few words: `unsure (TTFT 1.12x [0.91-1.40], errors +0.0
    points [-1.2..+1.3])`."""
    t, e = v["ttft_ratio"], v["error_rate_difference"]
    ttft = ("TTFT ?" if t["estimate"] is None else
            f"TTFT {t['estimate']:.2f}x [{t['low']:.2f}-"
            f"{'inf' if t['high'] is None else format(t['high'], '.2f')}]")
    errors = ("errors ?" if e["estimate"] is None else
              f"errors {100 * e['estimate']:+.1f} points [{100 * e['low']:+.1f}.."
              f"{100 * e['high']:+.1f}]")
    return f"{v['outcome']} ({ttft}, {errors})"


def _quality_line(q: dict[str, Any]) -> str:
    """The eval's outcome in one line: `quality gate failed: exact_match 0.5 for the new
    version against 1 for the current one over 20 examples, a difference of -0.5 (95%
    interval -0.75..-0.25; two runs of one version differed by up to 0)`."""
    metric = q["metric"]
    head = ("quality gate " + ("passed" if q["passed"] else "failed") if "passed" in q
            else "eval (not a gate)")
    new, current, c = q.get("candidate"), q.get("current"), q.get("comparison")
    if not new:
        return f"{head}: scoring the new version on {q.get('eval_data', 'the eval set')}"
    line = (f"{head}: {metric} {new[metric]:.4g} for the new version"
            + (f" against {current[metric]:.4g} for the current one" if current else "")
            + f" over {new['examples']} examples")
    if c:
        runs = "one run" if c["repeats"] == 1 else f"{c['repeats']} runs"
        line += (f", a difference of {c['difference']:+.4g} ({c['confidence']:.0%} interval "
                 f"{c['low']:+.4g}..{c['high']:+.4g}; {runs} of one version differed by up "
                 f"to {c['spread']:.4g})")
    return line


STEP_NAMES = {"precheck": "pre-check canary", "drain": "drain", "pause": "pause",
              "reload": "reload", "reset_prefix_cache": "cache reset", "resume": "resume",
              "canary": "canary", "eval": "eval", "update_weight_version": "version"}
"""How `dpserve deploy` names the timed steps of a replica's hot-load."""
STILL_EVERY_S = 10.0
"""A replica in one phase this long gets a line saying so, and again each time."""


class ReplicaLines:
    """Each replica's progress as lines: one per phase it enters, with the steps that
    finished since the last line and their times, and a line every `STILL_EVERY_S`
    while a phase goes on (what the deploy is waiting for)."""

    def __init__(self) -> None:
        self._shown: dict[str, tuple[Any, ...]] = {}
        self._steps: dict[str, set[str]] = {}
        self._since: dict[str, float] = {}
        self._nagged: dict[str, int] = {}

    def update(self, replicas: list[dict[str, Any]], now: float) -> list[str]:
        lines = []
        for r in replicas:
            if r["phase"] == "pending":
                continue
            key = (r["phase"], r["note"], r["error"])
            if self._shown.get(r["id"]) != key:
                self._shown[r["id"]] = key
                self._since[r["id"]], self._nagged[r["id"]] = now, 0
                lines.append(self._line(r))
                continue
            waited = now - self._since[r["id"]]
            if r["phase"] in _ACTIVE and waited >= STILL_EVERY_S * (self._nagged[r["id"]] + 1):
                self._nagged[r["id"]] += 1
                lines.append(f"{r['id']:<4} {r['phase']:<11} still, after {waited:.0f} s")
        return lines

    def _line(self, r: dict[str, Any]) -> str:
        line = f"{r['id']:<4} {r['phase']:<11}"
        if r["phase"] in ("done", "rolled_back") and r["seconds"] is not None:
            line += f" in {r['seconds']:.2f} s, now serving {r['version']}"
        seen = self._steps.setdefault(r["id"], set())
        new = [(k, v) for k, v in (r.get("steps") or {}).items() if k not in seen]
        seen.update(k for k, _ in new)
        if new:
            line += " (" + ", ".join(f"{STEP_NAMES.get(k, k)} {v:.2f} s" for k, v in new) + ")"
        if r["note"]:
            line += f" {r['note']}"
        if r["error"]:
            line += f" error: {r['error']}"
        return line.rstrip()


_ACTIVE = frozenset({"precheck", "draining", "reloading", "canary", "restarting"})


async def run_watch(client: AdminClient, output_dir: Path, options: dict[str, Any],
                    out: TextIO, *, interval_s: float, max_deploys: int | None,
                    timeout_s: float | None) -> int:
    """Deploy the newest complete checkpoint of `output_dir` whenever a new one appears.

    Only the newest is deployed when several appeared during a deploy; a refused or
    rolled-back checkpoint is not retried. Stops after `max_deploys` deploys or
    `timeout_s` seconds (or on Ctrl-C); 0 if every deploy succeeded.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    attempted: set[Path] = set()
    failures = deploys = 0
    print(f"watching {output_dir} every {interval_s:g} s", file=out, flush=True)
    while True:
        latest = await asyncio.to_thread(latest_checkpoint, output_dir)
        if latest is not None and latest not in attempted:
            current = await client.latest_deploy()
            if current is not None and not current["done"]:
                print(f"deploy {current['id']} is in progress; {latest.name} waits",
                      file=out, flush=True)
            else:
                attempted.add(latest)
                deploys += 1
                if await run_deploy(client, latest, options, out) != 0:
                    failures += 1
                if max_deploys is not None and deploys >= max_deploys:
                    break
        if deadline is not None and time.monotonic() >= deadline:
            break
        await asyncio.sleep(interval_s)
    print(f"stopped watching: {deploys} deploy(s), {failures} not succeeded", file=out,
          flush=True)
    return 1 if failures else 0


async def run_status(client: AdminClient, out: TextIO) -> int:
    """Print every replica's state, load, weight version and adapters, and the last
    deploy."""
    try:
        replicas = await client.replicas()
        last = await client.latest_deploy()
    except AdminError as exc:
        print(f"status: {exc}", file=out, flush=True)
        return 1
    # Adapter versions are served as NAME@VERSION: a column of their own when there are.
    loaded = [",".join(m for m in r.get("models", ()) if "@" in m) for r in replicas]
    rows: list[tuple[str, ...]] = [
        ("replica", "state", "in-flight", "weight version", *(("adapters",) if any(loaded)
                                                              else ()), "device", "url")]
    rows += [(r["id"], r["state"], str(r["in_flight"]), r["weight_version"] or "unknown",
              *((adapters or "-",) if any(loaded) else ()), r["device"], r["url"])
             for r, adapters in zip(replicas, loaded, strict=True)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(),
              file=out)
    if last is not None:
        print(f"last deploy {last['id']}: {last['state']}, {shown_path(last['checkpoint'])}"
              + (f" ({last['version']})" if last["version"] else "")
              + (f": {last['error']}" if last["error"] else ""), file=out)
        if last.get("canary") and "canary" in last["canary"]:
            print("  " + _canary_line(last["canary"]), file=out)
        if last.get("quality"):
            print("  " + _quality_line(last["quality"]), file=out)
    out.flush()
    return 0


def run_admin_command(ns: argparse.Namespace, out: TextIO | None = None) -> int:
    """`dpserve deploy` / `dpserve status` from parsed arguments; the exit code."""
    out = sys.stdout if out is None else out
    try:
        key = read_admin_key(ns.admin_key_file)
    except (OSError, AdminError) as exc:
        print(f"dpserve {ns.command}: cannot read the admin key: {exc}", file=sys.stderr)
        return 2
    client = AdminClient(ns.router or DEFAULT_ROUTER, key)
    watched = Path(os.path.abspath(ns.watch)) if getattr(ns, "watch", None) else None
    checkpoint = Path(os.path.abspath(ns.checkpoint)) if getattr(ns, "checkpoint", None) else None
    # the router reads it: absolute
    eval_data = os.path.abspath(ns.eval) if getattr(ns, "eval", None) else None

    async def main() -> int:
        async with client:
            if ns.command == "status":
                return await run_status(client, out)
            options = {name: getattr(ns, name) for name in
                       ("batch", "canary_prompt", "drain_wait_s", "name", "drop_adapters",
                        "no_mixed_versions", "gate_metric", "gate_min_score",
                        "gate_vs_current", "gate_margin", "gate_repeats", "canary_weight",
                        "canary_duration_s", "canary_max_error_rate_delta",
                        "canary_max_ttft_ratio", "canary_ttft_slack_ms",
                        "canary_min_requests", "canary_max_duration_s",
                        "canary_confidence", "canary_inconclusive")
                       if getattr(ns, name, None) is not None}
            if eval_data is not None:
                options["eval_data"] = eval_data
            if watched is not None:
                return await run_watch(client, watched, options, out,
                                       interval_s=ns.interval_s, max_deploys=ns.max_deploys,
                                       timeout_s=ns.timeout_s)
            assert checkpoint is not None  # argparse: a checkpoint or --watch
            return await run_deploy(client, checkpoint, options, out)

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        print("\ninterrupted; a deploy already started goes on in the router "
              "(`dpserve status` shows it)", file=out, flush=True)
        return 130
