"""One simulated replica: an aiohttp server on loopback in front of one Engine.

Routes, as vLLM's OpenAI server has them: `POST /v1/completions`,
`POST /v1/chat/completions` (streamed as server-sent events or not),
`POST /tokenize`, `GET /v1/models`, `GET /health`, `GET /metrics`,
`GET /kv_event_sources` (`{}` unless `config.kv_events`; see kv_events.py), and
`POST /reset_prefix_cache[?reset_running_requests=true]`, the dev endpoint of vLLM
(`VLLM_SERVER_DEV_MODE=1`, which dpserve starts its replicas with) that a deploy calls
after reloading weights; `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(adapters.py), vLLM's run-time LoRA endpoints. With `control=True` also
`GET|PUT|DELETE /sim/fault` (see faults.py); off by default, so a router in front
cannot be told about the simulation.

A client that disconnects aborts its request in the engine, as in vLLM. Not one
of the test fakes: it models an engine's scheduler, KV cache and prefix cache in
time, so routing policies can be compared at fleet scale; its faults are
structured (`faults.Fault`: a mode, a status, a stall point) and settable over
HTTP, for fleets started as processes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Any

import zmq.asyncio
from aiohttp import web

from dpserve.config import ConfigError
from dpserve.router.errors import error_body
from dpserve.sim import exposition, protocol
from dpserve.sim.adapters import Adapters, Answer
from dpserve.sim.config import SimConfig
from dpserve.sim.engine import Engine, SimSequence
from dpserve.sim.faults import Fault
from dpserve.sim.kv_events import KVEventPublisher
from dpserve.sim.metrics import CONTENT_TYPE

log = logging.getLogger("dpserve.sim")

SHUTDOWN_GRACE_S = 0.2
"""On stop, time open requests get before their handlers are cancelled."""
_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True,
             "false": False, "0": False, "no": False, "off": False}
"""Query booleans as vLLM's server (FastAPI) reads them."""


class SimReplica:
    """Start with `await replica.start()`, stop with `await replica.stop()`."""

    def __init__(self, config: SimConfig, *, index: int = 0, control: bool = False) -> None:
        self.config = config
        self.index = index
        self.kv_events = KVEventPublisher(config) if config.kv_events else None
        """The event publisher (its `endpoint`, `replay_endpoint`), with `config.kv_events`."""
        self._own_context: zmq.asyncio.Context | None = None
        self.adapters = Adapters(config)
        """The LoRA adapters served (`--lora`, then `/v1/load_lora_adapter`)."""
        self.engine = Engine(config, seed=config.seed + index,
                             on_kv_events=self.kv_events.publish if self.kv_events else None)
        self.port = 0
        self._control = control
        self._fault: Fault | None = None
        self._ids = itertools.count()
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def fault(self) -> Fault | None:
        return self._fault

    @fault.setter
    def fault(self, fault: Fault | None) -> None:
        self._fault = None if fault is None or fault == Fault() else fault
        self.engine.slowdown = fault.slowdown if fault and fault.mode == "slow" else 1.0

    async def start(self, port: int = 0) -> SimReplica:
        """Serve HTTP on `port` (0: one the OS picks), then bind the event sockets to
        ports the OS picks, in a ZMQ context of the replica's own, unless
        `kv_events.bind` was called already (a fleet binds them first, in its context)."""
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kv_event_sources", self._kv_event_sources)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_post("/v1/load_lora_adapter", self._load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self._unload_lora_adapter)
        if self._control:
            app.router.add_route("*", "/sim/fault", self._fault_endpoint)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     handler_cancellation=True,
                                     shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        self._engine_task = asyncio.create_task(self.engine.run(), name=f"sim-engine-{self.index}")
        self._engine_task.add_done_callback(self._engine_ended)
        try:
            await web.TCPSite(self._runner, "127.0.0.1", port).start()
            if self.kv_events is not None and self.kv_events.endpoint is None:
                self._own_context = zmq.asyncio.Context()
                self.kv_events.bind(0, self._own_context)
        except BaseException:
            await self.stop()
            raise
        self.port = self._runner.addresses[0][1]
        return self

    def _engine_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            log.error("simulated engine %d died; /health now answers 500", self.index,
                      exc_info=task.exception())
        self._abort_all()

    def _abort_all(self) -> None:
        for seq in [*self.engine.running, *self.engine.waiting]:
            self.engine.abort(seq)

    @property
    def engine_alive(self) -> bool:
        return self._engine_task is not None and not self._engine_task.done()

    async def stop(self) -> None:
        """Close the port, end open requests, stop the engine. Idempotent."""
        self._stopping.set()
        self._abort_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._engine_task is not None:
            self._engine_task.cancel()
            # a crash was logged when it happened
            await asyncio.gather(self._engine_task, return_exceptions=True)
            self._engine_task = None
        if self.kv_events is not None:
            await self.kv_events.close()
        if self._own_context is not None:
            self._own_context.term()
            self._own_context = None

    # --- handlers ----------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: protocol.Kind) -> web.StreamResponse:
        fault = self._fault
        if fault is not None and fault.mode == "hang":
            return await self._hang()
        if fault is not None and fault.mode == "error":
            return _error(fault.status, f"simulated failure of replica {self.index}")
        if not self.engine_alive:
            return _error(500, "the simulated engine is not running")
        try:
            req = protocol.parse(kind, await _json(request), self.config, self.adapters.loaded)
        except protocol.ProtocolError as exc:
            return _error(exc.status, exc.message, param=exc.param)
        if not req.stream and self._stalled(0):
            return await self._hang()
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-sim{self.index}-{next(self._ids)}"
        lora = self.adapters.get(req.lora)
        seq = self.engine.add(req.prompt_ids, req.max_tokens, lora)
        self.adapters.request_started(lora)
        try:
            if req.stream:
                return await self._stream(request, req, rid, seq)
            if await seq.wait_beyond(req.max_tokens - 1) < req.max_tokens:  # aborted
                return _error(503, "aborted: the simulated replica stopped or its engine died")
            text = protocol.output_text(req.prompt_ids, 0, seq.output_count)
            return web.json_response(protocol.full_response(
                req, rid, int(time.time()), req.lora or self.config.model, text,
                seq.output_count, "length"))
        finally:
            self.engine.abort(seq)
            self.adapters.request_ended(lora)

    async def _stream(self, request: web.Request, req: protocol.GenerationRequest, rid: str,
                      seq: SimSequence) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunks = protocol.ChunkWriter(req, rid, int(time.time()), req.lora or self.config.model)
        if self._stalled(0):
            self.engine.abort(seq)
            await self._hang()
            return resp
        if head := chunks.start():
            await resp.write(head)
        sent = 0
        while sent < req.max_tokens:
            count = await seq.wait_beyond(sent)
            if count == sent:  # aborted: the replica is stopping or its engine died
                return resp
            if self._stalled(count):
                count = max(sent, min(count, self._fault.stall_after))  # type: ignore[union-attr]
                if count > sent:
                    await resp.write(chunks.tokens(sent, count - sent, None))
                self.engine.abort(seq)
                await self._hang()
                return resp
            finish = "length" if count >= req.max_tokens else None
            await resp.write(chunks.tokens(sent, count - sent, finish))
            sent = count
        await resp.write(chunks.end(sent))
        return resp

    def _stalled(self, tokens: int) -> bool:
        """True when a stall fault is set and a stream holding `tokens` must stop."""
        fault = self._fault
        return fault is not None and fault.mode == "stall" and tokens >= fault.stall_after

    async def _hang(self) -> web.Response:
        """Answer nothing until the replica stops."""
        await self._stopping.wait()
        return _error(503, "the simulated replica is shutting down")

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await _json(request)
        try:
            ids = protocol.tokenize_body(body)
        except protocol.ProtocolError as exc:
            return _error(exc.status, exc.message, param=exc.param)
        return web.json_response({"count": len(ids), "max_model_len": self.config.max_model_len,
                                  "tokens": ids, "token_strs": None})

    async def _models(self, request: web.Request) -> web.Response:
        model = self.config.model
        return web.json_response({"object": "list", "data": [{
            "id": model, "object": "model", "created": self._created, "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": self.config.max_model_len,
            "permission": []}, *self.adapters.model_cards(self._created)]})

    async def _health(self, request: web.Request) -> web.Response:
        if not self.engine_alive:
            return web.Response(status=500)  # as vLLM's /health when its engine core died
        return web.Response(status=self._fault.health_status if self._fault else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=exposition.render(self.engine, self.adapters),
                            headers={"Content-Type": CONTENT_TYPE})

    async def _kv_event_sources(self, request: web.Request) -> web.Response:
        # vLLM answers {} when its engines publish no events.
        return web.json_response(self.kv_events.sources() if self.kv_events else {})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        # As vLLM 0.32: {"success": false} when a running request holds cached blocks and
        # reset_running_requests is not set (nothing is dropped then).
        flag = request.query.get("reset_running_requests", "false").lower()
        if flag not in _BOOLEANS:
            return _error(400, f"reset_running_requests must be a boolean, not {flag!r}",
                          param="reset_running_requests")
        if not self.engine_alive:
            return _error(500, "the simulated engine is not running")
        try:
            success = await self.engine.reset_prefix_cache_between_steps(
                reset_running_requests=_BOOLEANS[flag])
        except RuntimeError as exc:  # the engine stopped before its step ended
            return _error(500, str(exc))
        return web.json_response({"success": success})

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        return _answer(self.adapters.load(request.headers.get("Content-Type", ""),
                                          await request.read()))

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        return _answer(self.adapters.unload(request.headers.get("Content-Type", ""),
                                            await request.read()))

    async def _fault_endpoint(self, request: web.Request) -> web.Response:
        if request.method == "PUT":
            try:
                self.fault = Fault.from_json(await _json(request))
            except ConfigError as exc:
                return _error(400, str(exc))
        elif request.method == "DELETE":
            self.fault = None
        elif request.method != "GET":
            return _error(405, f"{request.method} is not allowed on /sim/fault")
        return web.json_response((self._fault or Fault()).to_json())


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _answer(answer: Answer) -> web.Response:
    response = web.Response(status=answer.status, body=answer.body)
    if answer.content_type is not None:
        response.content_type = answer.content_type
    return response


def _error(status: int, message: str, *, param: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, param=param),
                        content_type="application/json")

