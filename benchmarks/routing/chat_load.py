"""One multi-turn chat load of ``quality_kv.py``, in a process of its own.

    python -m benchmarks.routing.chat_load SPEC.json

SPEC holds ``base_urls`` (one router, or several in front of one fleet), ``conversations``
(a JSON file written by `write_conversations`), ``request_timeout_s``, ``result_json``,
and for a deploy mid-run ``reset_at_s`` and ``replica_urls``. Each conversation starts at
its ``start_s`` and sends its turns one after the other, each a think time after the
answer to the one before (``workloads.chat``), so unlike ``load.py``'s open loop a turn
waits on its predecessor. A turn's prompt is the whole conversation so far, spelled with
the simulator's tokenizer: the answer in it is the one the simulated model generates
(``tokenizer.output_ids``), so a turn that reaches the replica that served the one
before finds all of it cached but the new message. Requests go to the routers in turn,
by the order they are sent (clients behind a Kubernetes Service); each is a streamed
completion timed by loadtest's client.

The deploy: at ``reset_at_s`` every replica gets ``POST /reset_prefix_cache
?reset_running_requests=true``, as dpserve's rolling deploy sends it after reloading
weights (here to all replicas at once, under load).

The result: ``{"metrics"`` (loadtest's summary of every turn), ``"turns"`` (per turn:
conversation, turn, router, replica when the router names it, sent and TTFT seconds,
ok, and why not), ``"reset_s"`` (seconds from the start, or null)``}``. Exit status 0 when the run
completed (failed turns are in the result), 2 when it could not run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from benchmarks.routing.workloads import Conversation
from dpserve.sim.tokenizer import decode
from loadtest import harness
from loadtest.client import ENDPOINT_PATHS, Payload, RequestRecord, build_body, send
from loadtest.config import RunConfig
from loadtest.errors import LoadTestError
from loadtest.metrics import summarize

PERCENTILES = (50.0, 90.0, 99.0)


def write_conversations(convs: Sequence[Conversation], path: Path) -> Path:
    """The conversations as the load reads them: each turn's prompt spelled out."""
    path.write_text(json.dumps([
        {"start_s": c.start_s,
         "turns": [{"prompt": decode(t.ids), "prompt_tokens": len(t.ids),
                    "output_tokens": t.output_tokens, "think_s": t.think_s} for t in c.turns]}
        for c in convs]))
    return path


def schedule_s(convs: Sequence[Conversation], answer_s: float) -> float:
    """How long the conversations take if every answer takes ``answer_s``: the bound a
    caller puts on the run (a turn that times out ends its conversation no later)."""
    return max((c.start_s + sum(t.think_s + answer_s for t in c.turns) for c in convs),
               default=0.0)


def window_means(turns: Sequence[dict[str, Any]], start_s: float, width_s: float,
                 count: int) -> list[float | None]:
    """Mean TTFT (ms) of the successful turns sent in each of ``count`` windows of
    ``width_s`` from ``start_s``; None for a window where none was."""
    sums = [[0.0, 0] for _ in range(count)]
    for t in turns:
        k = math.floor((t["sent_s"] - start_s) / width_s)
        if 0 <= k < count and t["ok"]:
            sums[k][0] += t["ttft_s"] * 1e3
            sums[k][1] += 1
    return [s / n if n else None for s, n in sums]


@dataclasses.dataclass
class Turn:
    conversation: int
    turn: int
    router: int
    record: RequestRecord


async def run(spec: dict[str, Any], convs: list[dict[str, Any]]) -> dict[str, Any]:
    """Play ``convs`` (as `write_conversations` wrote them) through the routers."""
    urls = [str(u) for u in spec["base_urls"]]
    model = await harness.check_server(RunConfig(base_url=urls[0],
                                                 other_base_urls=tuple(urls[1:])))
    path = ENDPOINT_PATHS["completions"]
    sent = itertools.count()
    done: list[Turn] = []
    timeout = aiohttp.ClientTimeout(total=float(spec["request_timeout_s"]))
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def converse(c: int, conv: dict[str, Any]) -> None:
            await asyncio.sleep(conv["start_s"])
            for k, turn in enumerate(conv["turns"]):
                if k:
                    await asyncio.sleep(turn["think_s"])
                n = next(sent)
                record = RequestRecord(index=n, request_id=f"chat-{c}-{k}",
                                       scheduled_s=time.perf_counter() - t0)
                body = build_body("completions", model=model, prompt=turn["prompt"],
                                  max_tokens=turn["output_tokens"], stream=True,
                                  ignore_eos=True, extra_body={})
                payload = Payload(body, turn["prompt_tokens"], turn["output_tokens"])
                await send(session, urls[n % len(urls)] + path, payload, record, t0=t0)
                done.append(Turn(c, k, n % len(urls), record))

        reset = asyncio.create_task(_deploy(session, spec, t0))
        await asyncio.gather(*(converse(c, conv) for c, conv in enumerate(convs)))
        duration = time.perf_counter() - t0
        reset_s = await reset if reset.done() else None
        reset.cancel()
    records = [t.record for t in done]
    metrics = summarize(records, duration, percentiles=PERCENTILES)
    return {"metrics": dataclasses.asdict(metrics), "reset_s": reset_s,
            "turns": [{"conversation": t.conversation, "turn": t.turn, "router": t.router,
                       "replica": t.record.replica, "sent_s": t.record.start_s,
                       "ttft_s": t.record.ttft_s, "ok": t.record.ok,
                       "error": t.record.error, "detail": t.record.detail} for t in done]}


async def _deploy(session: aiohttp.ClientSession, spec: dict[str, Any], t0: float
                  ) -> float | None:
    """Every replica's prefix cache reset at ``reset_at_s``; when it was, from ``t0``."""
    if spec.get("reset_at_s") is None:
        return None
    await asyncio.sleep(max(0.0, t0 + float(spec["reset_at_s"]) - time.perf_counter()))
    at = time.perf_counter() - t0

    async def one(url: str) -> None:
        try:
            async with session.post(url + "/reset_prefix_cache",
                                    params={"reset_running_requests": "true"}) as resp:
                answer = f"HTTP {resp.status} {await resp.text()}"
                if resp.status == 200 and json.loads(answer.split(" ", 2)[2]) == {
                        "success": True}:
                    return
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            answer = f"{type(exc).__name__}: {exc}"
        print(f"chat_load: the reset of {url} failed: {answer}", file=sys.stderr, flush=True)

    await asyncio.gather(*(one(u) for u in spec["replica_urls"]))
    return at


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv in (["-h"], ["--help"]) else 2
    spec = json.loads(Path(argv[0]).read_text())
    convs = json.loads(Path(spec["conversations"]).read_text())
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(run(spec, convs))
    except LoadTestError as exc:
        print(f"chat_load: {exc}", file=sys.stderr)
        return 2
    out = Path(spec["result_json"])
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
