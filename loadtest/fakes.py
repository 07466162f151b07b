"""A fake OpenAI streaming server with scripted timing and faults, to check the harness.

Why a fake of its own: it is the load-test package's (which must not depend on
dpserve), its job is timing that is known to the microsecond (the harness's
accuracy is measured against it), and it runs alone as a process for benchmarks.
dpserve's other fakes: tests/fakes.py (a replica that misbehaves on cue for the
router's tests), tests/fake_vllm_server.py (a replica *process* for the
supervisor), benchmarks/router/fixed_upstream.py (the cheapest possible upstream, for
the router's overhead), dpserve/sim (a model of an engine's scheduler and prefix
cache, for routing quality at fleet scale).

`FakeOpenAIServer` is an aiohttp server (127.0.0.1 by default) that answers
``/v1/completions`` and ``/v1/chat/completions`` as vLLM's OpenAI server does
when streaming: one SSE event per token, the last with a ``finish_reason``,
then a usage event (``choices: []``) and ``data: [DONE]``. It does no
inference; its timing is the script's:

- the first token is written ``ttft_s`` after the request body was read, token
  ``k`` at ``ttft_s + k * itl_s`` (absolute deadlines, so sleep overshoot does
  not accumulate); so the true TTFT is ``ttft_s`` and the true TPOT ``itl_s``;
- it writes ``output_tokens`` tokens, or the request's ``max_tokens``; with no
  inter-token delay the whole answer goes out in one write (a fixed-response
  server, fast enough to load-test the client);
- ``faults`` maps the n-th request the server receives (from 0) to a fault:
  ``error500``/``error429`` (an error envelope with that status), ``drop``
  (close the connection before answering), ``cut`` (close it after the first
  token), ``error_event`` (an error event after the first token), ``hang``
  (stall after the first token until the server stops), ``no_done`` (end
  without ``data: [DONE]``). The same words as dpserve's test fake replica
  (tests/fakes.py) where the faults are the same;
- with ``replicas`` it names a replica in the ``x-dpserve-replica`` header,
  round-robin, as dpserve's router does.

Run alone (in its own process, e.g. for a benchmark)::

    python -m loadtest.fakes --port 9100 --ttft-ms 200 --itl-ms 20

With ``record_timings`` it keeps, per ``x-request-id``, the ``perf_counter``
time at which it had read the request and those at which it wrote each token
(``GET /timings``: ``{id: {"received": t, "tokens": [t, ...]}}``). They are
what the server really did, sleep overshoot included: the truth a client's
measurements are checked against, also from another process on the same
machine (``perf_counter`` is CLOCK_MONOTONIC, shared by all processes on Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

Fault = Literal["error500", "error429", "drop", "cut", "error_event", "hang", "no_done"]
DEFAULT_MODEL = "fake-model"
_DEFAULT_TOKENS = 16


async def start_app(app: web.Application, host: str = "127.0.0.1",
                    port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve `app` in the running event loop: its runner (`cleanup()` stops it) and the
    port it bound (`port` 0: any free one). The one server set-up of the in-process
    fakes (this one, tests/fakes.py, benchmarks/router/fixed_upstream.py): no access log, no
    signal handlers, and a short shutdown so a hanging answer cannot hold up a stop."""
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


@dataclass(kw_only=True)
class Script:
    ttft_s: float = 0.0
    itl_s: float = 0.0
    output_tokens: int | None = None
    """Tokens per answer; None: the request's max_tokens."""
    faults: Mapping[int, Fault] = field(default_factory=dict)
    replicas: Sequence[str] = ()
    usage: bool = True
    """Send the usage event (with ``stream_options.include_usage``)."""


class FakeOpenAIServer:
    """Start with ``async with FakeOpenAIServer(Script(...)) as server: server.url``."""

    def __init__(self, script: Script | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, model: str = DEFAULT_MODEL,
                 record_timings: bool = False) -> None:
        self.script = script or Script()
        self.host, self.port, self.model = host, port, model
        self.record_timings = record_timings
        self.received = 0
        self.bodies: list[dict[str, Any]] = []
        self.timings: dict[str, dict[str, Any]] = {}
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()
        self._chunks = {"completions": _chunks(model, chat=False),
                        "chat": _chunks(model, chat=True)}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FakeOpenAIServer:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/timings", self._timings)
        app.router.add_post("/timings/reset", self._reset)
        self._runner, self.port = await start_app(app, self.host, self.port)
        return self

    async def stop(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeOpenAIServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "root": self.model}]})

    async def _timings(self, request: web.Request) -> web.Response:
        return web.json_response(self.timings)

    async def _reset(self, request: web.Request) -> web.Response:
        self.timings.clear()
        return web.json_response({})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await request.json()
        begin = time.perf_counter()
        n = self.received
        self.received += 1
        self.bodies.append(body)
        script = self.script
        fault = script.faults.get(n)
        headers = {"x-dpserve-replica": script.replicas[n % len(script.replicas)]} \
            if script.replicas else {}
        if fault in ("error500", "error429"):
            status = int(fault[5:])
            return web.json_response({"error": {
                "message": f"scripted {status}", "type": "ServerError", "param": None,
                "code": status}}, status=status, headers=headers)
        if fault == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        tokens = script.output_tokens or int(
            body.get("max_tokens") or body.get("max_completion_tokens") or _DEFAULT_TOKENS)
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": tokens,
                 "total_tokens": _prompt_tokens(body) + tokens}
        if not body.get("stream"):
            await _sleep_until(begin + script.ttft_s + (tokens - 1) * script.itl_s)
            return web.json_response({"object": "text_completion", "model": self.model,
                                      "choices": [{"index": 0, "text": "x" * tokens,
                                                   "finish_reason": "length"}],
                                      "usage": usage}, headers=headers)

        first, token, last = self._chunks[kind]
        sent: list[float] | None = None
        if self.record_timings:
            sent = []
            self.timings[request.headers.get("x-request-id", str(n))] = {
                "received": begin, "tokens": sent}
        with_usage = script.usage and (body.get("stream_options") or {}).get("include_usage")
        if script.itl_s == 0 and fault is None:
            # Nothing to wait for between tokens: the whole answer in one write.
            await _sleep_until(begin + script.ttft_s)
            events = [first, *[token] * (tokens - 2), last][:tokens]
            if with_usage:
                events.append(_event({"model": self.model, "choices": [], "usage": usage}))
            if sent is not None:
                sent.extend([time.perf_counter()] * tokens)
            return web.Response(body=b"".join([*events, b"data: [DONE]\n\n"]),
                                headers={"content-type": "text/event-stream", **headers})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", **headers})
        await resp.prepare(request)
        for k in range(tokens):
            await _sleep_until(begin + script.ttft_s + k * script.itl_s)
            if k == 1 and fault == "cut":
                assert request.transport is not None
                request.transport.close()
                return resp
            if k == 1 and fault == "error_event":
                await resp.write(_event({"error": {"message": "scripted error event",
                                                   "type": "InternalServerError", "code": 500}}))
                break
            if k == 1 and fault == "hang":
                await self._stopping.wait()
                return resp
            if sent is not None:
                sent.append(time.perf_counter())
            await resp.write(first if k == 0 else last if k == tokens - 1 else token)
        if with_usage:
            await resp.write(_event({"model": self.model, "choices": [], "usage": usage}))
        if fault != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _chunks(model: str, *, chat: bool) -> tuple[bytes, bytes, bytes]:
    """Pre-encoded token events: the first, a middle one, the last (with finish_reason)."""
    def chunk(first: bool, finish: str | None) -> bytes:
        if chat:
            delta = {"role": "assistant", "content": " tok"} if first else {"content": " tok"}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice, obj = {"index": 0, "text": " tok"}, "text_completion"
        choice["finish_reason"] = finish
        return _event({"id": "fake-1", "object": obj, "model": model, "choices": [choice]})
    return chunk(True, None), chunk(False, None), chunk(False, "length")


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _prompt_tokens(body: dict[str, Any]) -> int:
    """A stand-in count: whitespace-separated words of the prompt or messages."""
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    return len(str(body.get("prompt", "")).split())


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _serve(args: argparse.Namespace) -> None:
    script = Script(ttft_s=args.ttft_ms / 1e3, itl_s=args.itl_ms / 1e3,
                    output_tokens=args.output_tokens)
    server = await FakeOpenAIServer(script, port=args.port, model=args.model,
                                    record_timings=args.record_timings).start()
    print(f"fake OpenAI server listening on {server.url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.fakes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--record-timings", action="store_true")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.run(_serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
