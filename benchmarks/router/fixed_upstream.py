"""A fake OpenAI upstream that answers every request with the same fixed bytes.

This is a *fake* replica for benchmarking the router's data plane: it does no
inference, so the time it spends per request is as small and as constant as an
aiohttp server allows, and whatever a client measures through the router on
top of a direct call is the router's own cost. Separate from the test fakes
because it has no faults, no bookkeeping and pre-serialized bodies: any work it
did would be counted against the router.

    python -m benchmarks.router.fixed_upstream --port 9001 [--model NAME] [--chunks 16]
        [--chunk-delay-ms 0] [--stamp]

Routes:
- ``GET /health`` -> 200, empty body.
- ``GET /v1/models`` -> one model, ``NAME``.
- ``POST /v1/completions`` and ``POST /v1/chat/completions`` -> a small fixed
  completion JSON; with ``"stream": true`` in the body, ``--chunks`` fixed SSE
  ``data: {...}`` events followed by ``data: [DONE]``, with ``--chunk-delay-ms``
  between two events (0: written back to back), like tokens leaving an engine.
  With ``--stamp`` each event's JSON starts with ``"sent_ns"``: the
  ``time.monotonic_ns()`` at which it was written, so a client on the same
  machine can tell how long each chunk took to reach it.
- ``GET /metrics`` -> 200, empty body.

Bodies are serialized once at start-up. The request body is parsed only to read
``stream``, as a real server would. Runs on uvloop when it is importable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from loadtest.fakes import start_app

JSON_TYPE = "application/json"
SSE_TYPE = "text/event-stream"
DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True, kw_only=True)
class FixedBodies:
    """Every byte string the server sends, built once."""

    models: bytes
    completion: bytes
    completion_chunks: tuple[bytes, ...]
    chat: bytes
    chat_chunks: tuple[bytes, ...]


def _sse(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def build_bodies(model: str, chunks: int) -> FixedBodies:
    """Build the fixed OpenAI-shaped bodies for ``model`` and ``chunks`` SSE events."""
    usage = {"prompt_tokens": 4, "completion_tokens": chunks, "total_tokens": 4 + chunks}
    completion = {
        "id": "cmpl-fixed",
        "object": "text_completion",
        "created": 0,
        "model": model,
        # With logprobs, as vLLM answers the router's warm-up request before it admits a
        # replica (a fixed body cannot depend on the request's `logprobs`).
        "choices": [
            {"index": 0, "text": " hello world", "finish_reason": "length",
             "logprobs": {"tokens": [" hello", " world"], "token_logprobs": [-0.5, -0.25]}}
        ],
        "usage": usage,
    }
    chat = {
        "id": "chatcmpl-fixed",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello world"},
                "finish_reason": "length",
            }
        ],
        "usage": usage,
    }

    def completion_chunk(i: int) -> bytes:
        last = i == chunks - 1
        choice = {
            "index": 0,
            "text": f" t{i}",
            "logprobs": None,
            "finish_reason": "length" if last else None,
        }
        return _sse(
            {
                "id": "cmpl-fixed",
                "object": "text_completion",
                "created": 0,
                "model": model,
                "choices": [choice],
            }
        )

    def chat_chunk(i: int) -> bytes:
        # With vLLM's `return_token_ids` fields (the router asks for them to migrate
        # streams), so that the router's work on them is measured.
        last = i == chunks - 1
        delta = {"role": "assistant", "content": f" t{i}"} if i == 0 else {"content": f" t{i}"}
        choice = {"index": 0, "delta": delta, "finish_reason": "length" if last else None,
                  "token_ids": [100 + i]}
        return _sse(
            {
                "id": "chatcmpl-fixed",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": [choice],
                "prompt_token_ids": [1, 2, 3, 4] if i == 0 else None,
            }
        )

    models = {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "dpserve"}],
    }
    return FixedBodies(
        models=json.dumps(models).encode(),
        completion=json.dumps(completion).encode(),
        completion_chunks=tuple(completion_chunk(i) for i in range(chunks)),
        chat=json.dumps(chat).encode(),
        chat_chunks=tuple(chat_chunk(i) for i in range(chunks)),
    )


async def _wants_stream(request: web.Request) -> bool:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(body, dict) and body.get("stream") is True


_EVENT_START = b"data: {"


def stamped(event: bytes) -> bytes:
    """``event`` with ``"sent_ns":NOW,`` as its JSON's first member (``[DONE]`` unchanged)."""
    if not event.startswith(_EVENT_START):
        return event
    stamp = b'"sent_ns":%d,' % time.monotonic_ns()
    return _EVENT_START + stamp + event[len(_EVENT_START):]


async def _stream(
    request: web.Request, events: tuple[bytes, ...], delay_s: float, stamp: bool
) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200, headers={"Content-Type": SSE_TYPE, "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    for i, event in enumerate((*events, DONE_EVENT)):
        if i and delay_s:
            await asyncio.sleep(delay_s)
        await response.write(stamped(event) if stamp else event)
    await response.write_eof()
    return response


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _generation_handler(
    body: bytes, events: tuple[bytes, ...], delay_s: float, stamp: bool
) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        if await _wants_stream(request):
            return await _stream(request, events, delay_s, stamp)
        return web.Response(body=body, content_type=JSON_TYPE)

    return handle


def build_app(
    bodies: FixedBodies, *, chunk_delay_s: float = 0.0, stamp: bool = False
) -> web.Application:
    """The aiohttp application serving ``bodies``, streams paced by ``chunk_delay_s``."""

    async def empty(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        return web.Response(body=bodies.models, content_type=JSON_TYPE)

    app = web.Application()
    app.router.add_get("/health", empty)
    app.router.add_get("/metrics", empty)
    app.router.add_get("/v1/models", models)
    app.router.add_post(
        "/v1/completions",
        _generation_handler(bodies.completion, bodies.completion_chunks, chunk_delay_s, stamp),
    )
    app.router.add_post(
        "/v1/chat/completions",
        _generation_handler(bodies.chat, bodies.chat_chunks, chunk_delay_s, stamp),
    )
    return app


async def serve(
    host: str, port: int, bodies: FixedBodies, chunk_delay_s: float = 0.0, stamp: bool = False
) -> None:
    """Serve until SIGTERM or SIGINT."""
    app = build_app(bodies, chunk_delay_s=chunk_delay_s, stamp=stamp)
    runner, _ = await start_app(app, host, port)
    try:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fixed-model")
    parser.add_argument("--chunks", type=int, default=16, help="SSE events per streamed reply")
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0,
                        help="pause between two SSE events of a streamed reply")
    parser.add_argument("--stamp", action="store_true",
                        help='put "sent_ns" (monotonic clock at write) in every SSE event')
    args = parser.parse_args()
    if args.chunks < 1:
        parser.error("--chunks must be at least 1")
    if args.chunk_delay_ms < 0:
        parser.error("--chunk-delay-ms must be >= 0")
    bodies = build_bodies(args.model, args.chunks)
    coro = serve(args.host, args.port, bodies, args.chunk_delay_ms / 1000, args.stamp)
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


if __name__ == "__main__":
    main()
