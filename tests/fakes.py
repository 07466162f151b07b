"""Fake replicas for the cases a real vLLM cannot show on cue.

The fault words (`error<STATUS>`, `drop`, `cut`, `hang`) are the load-test fake's
(loadtest/fakes.py) where the faults are the same; each of the project's other
fakes says there why it is separate (one job each: timing, processes, overhead,
fleet-scale scheduling).

`FakeReplica` is an in-process aiohttp server that speaks just enough of
vLLM's OpenAI API (`/health`, `/v1/models`, completions, chat, or embeddings for an
embedding model; FastAPI's `{"detail": "Not Found"}` on a path it does not mount) and of its
Prometheus `/metrics` (a few `vllm:` series, vLLM's names and labels, among its API
server's and Python process's own) and can be told
to misbehave: refuse work with an error, drop the connection before answering,
cut a stream halfway, or stream slowly. Every test that uses it says so by
name; the real-vLLM behaviour is covered in tests/integration.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from loadtest.fakes import start_app
from tests import fake_tokens

MODEL = "fake-model"
FINGERPRINT = "vllm-0.32.0-fake"
"""What vLLM writes in `system_fingerprint` (its version and a config hash)."""
_compact = functools.partial(json.dumps, separators=(",", ":"))
"""JSON as FastAPI writes it (no spaces)."""


def as_sent(body: dict[str, Any]) -> dict[str, Any]:
    """A request the fake got, less what the router adds to a non-streamed completion it
    asks for as a stream (`dpserve.router.forward.assembled`): what the client sent."""
    return {k: v for k, v in body.items()
            if k not in ("stream", "stream_options", "return_token_ids")}


def fake_engine_metrics(running: int, served: int) -> str:
    """A small exposition shaped like vLLM 0.32's: a gauge, a counter, a histogram, and a
    few of its API server's `http_*` and Python client's `process_*`/`python_*` series."""
    labels = f'engine="0",model_name="{MODEL}"'
    return (
        "# HELP python_gc_objects_collected_total Objects collected during gc\n"
        "# TYPE python_gc_objects_collected_total counter\n"
        'python_gc_objects_collected_total{generation="0"} 1234.0\n'
        "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n"
        "# TYPE process_cpu_seconds_total counter\n"
        "process_cpu_seconds_total 12.5\n"
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running:.1f}\n"
        "# HELP vllm:request_success_total Count of successfully processed requests.\n"
        "# TYPE vllm:request_success_total counter\n"
        f'vllm:request_success_total{{{labels},finished_reason="stop"}} {served:.1f}\n'
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n"
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} {served:.1f}\n'
        f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {served:.1f}\n'
        f"vllm:time_to_first_token_seconds_count{{{labels}}} {served:.1f}\n"
        f"vllm:time_to_first_token_seconds_sum{{{labels}}} {0.01 * served:.2f}\n"
        "# HELP http_requests_total Total number of requests by method, status and handler.\n"
        "# TYPE http_requests_total counter\n"
        f'http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} '
        f"{served:.1f}\n"
    )


def _open_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass
class FakeReplica:
    name: str
    mode: str = "ok"
    """ok | error<STATUS> (error400, error500, ...: answer that status, in the OpenAI
    envelope unless `error_answer` says otherwise) | drop (close before answering)
    | cut (stream 2 chunks and half of a third, then close: a replica killed mid-event)
    | hang (answer nothing; streams hang after their first chunk)
    | mute (answer nothing, streams included: a stopped server that still accepts)"""
    error_answer: tuple[str, bytes] | None = None
    """(content type, body) of the error modes' answers instead of the OpenAI envelope:
    another server's shape (FastAPI's `{"detail": [...]}`, a proxy's HTML page)."""
    task: str = "generate"
    """generate | embed: the model's task, which decides its routes as in vLLM 0.32
    (completions and chat for `generate`, `/v1/embeddings` for `embed`)."""
    chunks: int = 4
    chunk_delay_s: float = 0.0
    requests: list[dict] = field(default_factory=list)
    headers_seen: list[CIMultiDict[str]] = field(default_factory=list)
    open_streams: int = 0
    closed_streams: int = 0
    healthy: bool = True
    metrics: str | None = None
    """Served at /metrics as is; None: `fake_engine_metrics` of this replica's counts."""
    serve_metrics: bool = True
    """False: /metrics answers 404, like a server started without metrics."""
    metrics_scrapes: int = 0
    """GETs of /metrics so far."""
    metrics_gate: asyncio.Event = field(default_factory=lambda: _open_event())
    """/metrics answers once it is set (set from the start): a slow scrape, on cue."""
    weights: str | None = None
    """Path of the last `reload_weights` (None: the weights it started with)."""
    weight_version: str = "default"
    paused: bool = False
    fail: dict[str, str] = field(default_factory=dict)
    """Hot-load step (`pause`, `reload`, `reset_prefix_cache`, `resume`, `canary`,
    `update_weight_version`) -> how it fails: `error` (500), `error_once`, or for the
    canary `nan` (vLLM's 400 when logprobs are NaN). A canary (a request asking for
    logprobs) fails only once weights were reloaded."""
    dev_calls: list[str] = field(default_factory=list)
    """Dev endpoint calls in order, as `path?query`."""
    reload_gate: asyncio.Event | None = None
    """If set, a `reload_weights` call waits for it (a slow reload, held on cue)."""
    bad_weights: str | None = None
    """A part of a reloaded weights path (e.g. `step-000001`): weights that serve
    client requests (not the canary's) badly, as `bad_mode` says, after `bad_delay_s`."""
    bad_mode: str | None = None
    bad_delay_s: float = 0.0
    cold_requests: int = 0
    """A prefix cache's cold start: after each `reset_prefix_cache`, the next this many
    client requests each take `cold_delay_s` longer (their prompts' KV computed afresh,
    where a warm cache would have held it)."""
    cold_delay_s: float = 0.0
    _cold_left: int = 0
    skill: dict[str | None, tuple[dict[str, str], float]] = field(default_factory=dict)
    """For a deploy's eval set, by the weights loaded (None: those it started with; else
    a part of their path, e.g. `step-000001`):
    (prompt text -> its greedy answer, the log-probability of every prompt token). The
    fake's tokenizer is one token per character (`ord`); a chat renders its messages'
    contents joined by newlines. An unknown prompt is answered `?`."""
    tokens: bool = False
    """Streams speak the token model of `tests.fake_tokens` (predictable greedy output,
    vLLM's `return_token_ids`), for migration."""
    cut_after_tokens: int | None = None
    """With `tokens`: streams close their connection after this many tokens."""
    hang_after_tokens: int | None = None
    """With `tokens`: streams send nothing more after this many tokens."""
    tokens_per_chunk: int = 1
    """With `tokens`: tokens merged into one chunk (vLLM's reader fell behind)."""
    hang_at_end: bool = False
    """With `tokens`: streams send `[DONE]`, then nothing, never ending the response."""
    max_model_len: int | None = None
    """With `tokens`: the context length, and request limits read as vLLM reads them
    (`fake_tokens.length`); None: 16 tokens whenever no limit is given."""
    first_chunk_gate: asyncio.Event | None = None
    """If set, streams send their head at once and their first chunk once it is set:
    a request queued or in prefill in a busy engine (vLLM answers the head first)."""
    seen: list[str] = field(default_factory=list)
    """Every request that reached the replica, as `METHOD path?query`, health checks
    and scrapes left out: what a smuggled request would show up in."""
    _unpaused: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeReplica:
        app = web.Application(middlewares=[self._log_request])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        generative = ("/v1/completions", "/v1/chat/completions") if self.task == "generate" else ()
        for path in (*generative, "/tokenize", "/detokenize"):
            app.router.add_post(path, self._generate)
        if self.task == "embed":
            app.router.add_post("/v1/embeddings", self._embed)
        self._add_dev_endpoints(app)
        self._runner, self.port = await start_app(app)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _log_request(self, request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                           ) -> web.StreamResponse:
        if request.path not in ("/health", "/metrics", "/is_paused"):
            self.seen.append(f"{request.method} {request.path_qs}")
        try:
            return await handler(request)
        except web.HTTPNotFound:  # vLLM's FastAPI app on a path it does not mount
            return web.json_response({"detail": "Not Found"}, status=404, dumps=_compact)

    def reached(self) -> list[str]:
        """`seen`, less the router's own `GET /v1/models` (its health checker reads the
        served model names there): what clients' requests brought to the replica."""
        return [line for line in self.seen if line != "GET /v1/models"]

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        if not self.metrics_gate.is_set():
            await self.metrics_gate.wait()
        if not self.serve_metrics:
            raise web.HTTPNotFound
        text = self.metrics if self.metrics is not None else fake_engine_metrics(
            self.open_streams, len(self.requests))
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def _models(self, request: web.Request) -> web.Response:
        card: dict[str, object] = {"id": MODEL, "object": "model"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    # -- vLLM's dev endpoints (VLLM_SERVER_DEV_MODE=1), as a hot-load uses them ---------

    def _add_dev_endpoints(self, app: web.Application) -> None:
        self._unpaused.set()
        for path, step in (("/pause", "pause"), ("/resume", "resume"), ("/sleep", "sleep"),
                           ("/collective_rpc", "reload"),
                           ("/reset_prefix_cache", "reset_prefix_cache"),
                           ("/update_weight_version", "update_weight_version")):
            app.router.add_post(path, self._dev_endpoint(step))
        app.router.add_get("/weight_info", self._weight_info)
        app.router.add_get("/is_paused", self._is_paused)

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    def _dev_endpoint(self, step: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            raw = await request.read()
            body = json.loads(raw) if raw else {}
            self.requests.append(body)  # anything that reached the replica
            self.dev_calls.append(request.path_qs)
            failure = self._failure(step)
            if failure is not None:
                return failure
            if step == "pause":
                self.paused = True
                self._unpaused.clear()
                return web.json_response({"status": "paused"})
            if step == "resume":
                self.paused = False
                self._unpaused.set()
                return web.json_response({"status": "resumed"})
            if step == "reload":
                if self.reload_gate is not None:
                    await self.reload_gate.wait()
                self.weights = body["kwargs"]["weights_path"]
                return web.json_response({"results": [None]})
            if step == "reset_prefix_cache":
                self._cold_left = self.cold_requests
                return web.json_response({"success": True})
            if step == "update_weight_version":
                self.weight_version = body["new_version"]
                return web.json_response({"success": True, "new_version": body["new_version"]})
            return web.json_response({})
        return handle

    def _failure(self, step: str) -> web.Response | None:
        mode = self.fail.get(step)
        if mode is None:
            return None
        if mode == "error_once":
            del self.fail[step]
        if mode == "nan":
            message = "Out of range float values are not JSON compliant"
            return web.json_response({"error": {"message": message, "type": "BadRequestError",
                                                "param": None, "code": 400}}, status=400)
        return web.json_response({"error": f"fake {step} failure on {self.name}"}, status=500)

    def _completion_choice(self, body: dict) -> dict:
        choice = {"index": 0, "text": f"from {self.name}", "finish_reason": "stop"}
        if body.get("logprobs") is not None:
            n = int(body.get("max_tokens") or 1)
            choice |= {"finish_reason": "length",
                       "logprobs": {"token_logprobs": [-1.5] * n, "tokens": ["x"] * n}}
        return choice

    def _eval_answer(self, request: web.Request, body: dict) -> web.Response | None:
        """`/tokenize`, and completions of token ids (what an eval set sends)."""
        answers, logprob = next((v for k, v in self.skill.items() if k == self.weights or (
            k is not None and self.weights is not None and k in self.weights)), ({}, -1.0))
        if request.path == "/detokenize":
            return web.json_response({"prompt": fake_tokens.detokenize(body["tokens"])})
        if request.path == "/tokenize":
            text = (fake_tokens.rendered(body["messages"]) if "messages" in body
                    else body["prompt"])
            return web.json_response({"count": len(text), "tokens": [ord(c) for c in text]})
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt):
            return None
        text = "".join(map(chr, prompt))
        choice: dict = {"index": 0, "text": answers.get(text, "?"), "finish_reason": "stop"}
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = [None, *({str(t): {"logprob": logprob}}
                                                 for t in prompt[1:])]
        return web.json_response({"object": "text_completion", "model": MODEL,
                                  "choices": [choice]})

    async def _embed(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        return web.json_response({
            "object": "list", "model": MODEL,
            "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}],
            "usage": {"prompt_tokens": 1, "total_tokens": 1}})

    async def _first_chunk(self, request: web.Request) -> bool:
        """Until `first_chunk_gate` is set (True), or the client leaves (False, counted
        in `closed_streams`, as vLLM aborts a request whose client left)."""
        assert self.first_chunk_gate is not None
        while not self.first_chunk_gate.is_set():
            if request.transport is None or request.transport.is_closing():
                self.closed_streams += 1
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.first_chunk_gate.wait(), 0.02)
        return True

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        # The fake runs in the router's process: a body the router parsed must parse
        # here too, however deep the fake's handler sits in the stack (a real engine is
        # another process). No await in between, so nothing else runs meanwhile.
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + 2000)
        try:
            body = json.loads(raw)
        finally:
            sys.setrecursionlimit(limit)
        if (not (self.tokens and body.get("stream"))
                and (answer := self._eval_answer(request, body)) is not None):
            return answer
        self.requests.append(body)
        self.headers_seen.append(request.headers.copy())  # case-insensitive
        await self._unpaused.wait()  # like pause(mode=keep): held, not failed
        if (body.get("logprobs") is not None and self.weights is not None
                and (failure := self._failure("canary"))):
            return failure  # the new weights misbehave: only after a reload
        if self._cold_left and body.get("logprobs") is None:
            self._cold_left -= 1
            await asyncio.sleep(self.cold_delay_s)
        mode = self.mode
        if (self.bad_weights is not None and self.weights is not None
                and self.bad_weights in self.weights and body.get("logprobs") is None):
            mode = self.bad_mode or mode
            await asyncio.sleep(self.bad_delay_s)
        if mode.startswith("error") and mode[5:].isdigit():
            code = int(mode[5:])
            if self.error_answer is not None:
                content_type, answer = self.error_answer
                return web.Response(status=code, body=answer,
                                    headers={"content-type": content_type})
            return web.json_response(
                {"error": {"message": f"{self.name} says no", "type": "FakeError",
                           "param": None, "code": code}}, status=code)
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
            raise web.HTTPInternalServerError
        if self.mode == "mute" or (self.mode == "hang" and not body.get("stream")):
            await asyncio.sleep(3600)
        if self.tokens and body.get("stream"):
            return await fake_tokens.stream(
                request, body, name=self.name, fingerprint=FINGERPRINT,
                cut_after=self.cut_after_tokens, hang_after=self.hang_after_tokens,
                delay_s=self.chunk_delay_s, hang_at_end=self.hang_at_end,
                before_first=self._first_chunk if self.first_chunk_gate else None,
                max_model_len=self.max_model_len, per_chunk=self.tokens_per_chunk)
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-1", "object": "text_completion", "model": MODEL,
                "choices": [self._completion_choice(body)], "system_fingerprint": FINGERPRINT,
            })
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        self.open_streams += 1
        try:
            if self.first_chunk_gate is not None and not await self._first_chunk(request):
                return resp
            for i in range(self.chunks):
                if self.mode == "hang" and i == 1:
                    await asyncio.sleep(3600)
                await self._unpaused.wait()
                last = i == self.chunks - 1
                chunk = {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                         "choices": [{"index": 0, "text": f"t{i}",
                                      "finish_reason": "stop" if last else None}],
                         "system_fingerprint": FINGERPRINT}
                if self.mode == "cut" and i == 2:
                    assert request.transport is not None
                    await resp.write(f"data: {json.dumps(chunk)}"[:20].encode())
                    request.transport.close()
                    return resp
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                         "choices": [], "usage": {"prompt_tokens": 1, "total_tokens": 1
                                                  + self.chunks, "completion_tokens": self.chunks},
                         "system_fingerprint": FINGERPRINT}
                await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.closed_streams += 1
            raise
        finally:
            self.open_streams -= 1
        return resp
