"""Forwarding one client request to the replicas, as a pure ASGI endpoint.

The data plane: raw ASGI on the client side (`dpserve.router.asgi`) and a
minimal HTTP/1.1 client on the replica side (`dpserve.router.upstream.client`), so
that a request costs as little as possible. (aiohttp's client, the fastest
general-purpose one measured for this, was still the largest cost per request.)

Order of events for one request:

1. read the body (bounded: 413 past the limit, 503 when all requests together hold
   too much), parse it (400 unless a JSON object), check the model name against the
   replicas' (404), read its affinity keys. A route without a body (`GET /v1/models`)
   refuses one (400): bytes the router does not frame itself never reach a replica;
2. ask the dispatcher for a replica (`dpserve.router.routing.dispatch`: policy, caps,
   admission queue, circuit breakers) and hold a slot on it for the attempt;
3. send upstream; if the attempt fails in a way `retry.is_retryable` allows —
   always before a single byte went to the client — try another replica after
   a short backoff (bounded attempts): the client has seen nothing, so a retry
   is invisible;
4. pass the response through: whole for JSON; a stream goes to its owner
   (`dpserve.router.forward.stream`), which relays it to its end, moving it to
   another replica if its own fails mid-way. A stream that breaks and cannot move
   ends with an SSE error event, never a hang, after whole events only
   (`dpserve.router.sse`);
5. if the client disconnects at any point, the upstream request is closed, so
   vLLM aborts the generation instead of computing it for nobody.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from dpserve.config import RouterConfig
from dpserve.router.asgi import DisconnectWatch, Receive, ReplyTracker, Scope, Send, send_json_error
from dpserve.router.errors import RouterError
from dpserve.router.fleet.adapters import (
    Adapters,
    list_models,
    rewrite_model,
    versioned,
)
from dpserve.router.fleet.breaker import Outcome, classify
from dpserve.router.fleet.pool import ReplicaPool
from dpserve.router.forward.assembled import RIDE, Assembler, assemblable, ride_body
from dpserve.router.forward.attempt import Answered, Attempt, StartOver, TryAnother
from dpserve.router.forward.budget import BodyBudget
from dpserve.router.forward.exchange import Exchange
from dpserve.router.forward.request import (
    ClientGone,
    check_model,
    parse_request,
    read_body,
    refuse_prompt_logprobs,
)
from dpserve.router.forward.retry import backoff, is_retryable
from dpserve.router.forward.stream import StreamOwner
from dpserve.router.forward.upstream_errors import relay_error
from dpserve.router.headers import downstream_headers, request_id, upstream_header_block
from dpserve.router.migration.continuation import upstream_body
from dpserve.router.migration.eligibility import refusal
from dpserve.router.migration.fields import coerce_fields
from dpserve.router.migration.migrator import Migrator
from dpserve.router.migration.replay import StreamState
from dpserve.router.migration.tracked import Stream
from dpserve.router.routing.dispatch import Dispatcher, Slot, Unavailable, logged_waiting
from dpserve.router.routing.policies import RequestInfo
from dpserve.router.routing.policies.base import Tokenize
from dpserve.router.telemetry.metrics import RouterMetrics, status_class
from dpserve.router.telemetry.tracing import Tracing
from dpserve.router.upstream.client import (
    Origin,
    ResponseTooLarge,
    UpstreamClient,
    UpstreamResponse,
)

log = logging.getLogger("dpserve.proxy")

# Errors that mean "the connection broke or never was": `upstream`'s ConnectFailed
# and Disconnected are OSErrors; its timeouts are TimeoutErrors.
_UNREACHABLE = (OSError,)

_MIGRATABLE = frozenset({"/v1/completions", "/v1/chat/completions"})


class ProxyEndpoint:
    """ASGI app forwarding one route (`POST /v1/completions`, ...) to the replicas."""

    def __init__(
        self,
        route: str,
        *,
        pool: ReplicaPool,
        dispatcher: Dispatcher,
        config: RouterConfig,
        metrics: RouterMetrics,
        upstream: UpstreamClient,
        bodies: BodyBudget,
        keys: frozenset[str] = frozenset(),
        method: str = "POST",
        adapters: Adapters | None = None,
        tracing: Tracing | None = None,
        tokenize: Tokenize | None = None,
    ) -> None:
        self.route = route
        self._tokenize = tokenize if "tokens" in keys else None
        """The prompt's token ids for the policy (`kv-aware`), computed off the loop."""
        self._tracing = tracing
        self.method = method
        self._bodies = bodies
        self._pool = pool
        self._dispatch = dispatcher
        self._config = config
        self._metrics = metrics
        self._upstream = upstream
        self._has_body = method == "POST"
        self._keys = keys
        self._adapters = adapters if adapters is not None else Adapters()
        self._lists_models = route == "/v1/models"
        """The affinity keys the policy reads (`Policy.needs`): no other is computed."""
        # Per-request costs kept out of the hot path: parsed replica URLs, the request
        # line, and the metric children of this route.
        self._origins: dict[str, Origin] = {}
        self._request_line = f"{method} {route}".encode()
        self._duration = metrics.request_duration.labels(route)
        self._first_byte = metrics.time_to_first_byte.labels(route)
        self._counted: dict[tuple[str, int], Any] = {}
        # A replica that leaves drops its series; one that comes back under the same id
        # gets new ones, which the cache must not hide.
        pool.on_membership(lambda r: None, lambda r: self._counted.clear())
        self._migrates = config.migration_limit > 0 and route in _MIGRATABLE
        self._rides = config.assemble_responses and route in _MIGRATABLE
        """Non-streamed requests ride on a stream (`dpserve.router.forward.assembled`)."""
        self._migrator = Migrator(pool=pool, dispatcher=dispatcher, upstream=upstream,
                                  origin=self._origin, config=config, metrics=metrics)
        self._streams = StreamOwner(route, config=config, metrics=metrics,
                                    first_byte=self._first_byte, migrator=self._migrator,
                                    dispatcher=dispatcher)

    def _origin(self, base: str) -> Origin:
        origin = self._origins.get(base)
        if origin is None:
            if len(self._origins) >= 1024:  # replicas come and go (discovery): stay bounded
                self._origins.clear()
            origin = self._origins[base] = Origin.parse(base)
        return origin

    def _count(self, served_by: str, status: int) -> None:
        key = (served_by, status)
        child = self._counted.get(key)
        if child is None:
            child = self._counted[key] = self._metrics.requests.labels(
                self.route, served_by, status_class(status))
        child.inc()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex = Exchange(request_id(scope), ReplyTracker(send), time.perf_counter())
        if self._tracing is not None:
            ex.span = self._tracing.begin(scope["method"], self.route, scope["headers"])
            ex.trace = self._tracing.header_lines(ex.span)
        served_by = "none"
        status = 500
        watch: DisconnectWatch | None = None
        try:
            if scope["method"] != self.method:  # HEAD of a GET route: never forwarded
                raise RouterError(405, f"method {scope['method']} is not allowed on "
                                       f"{self.route}")
            with self._bodies.hold() as hold:
                ex.body = await read_body(scope, receive, hold, allowed=self._has_body,
                                          limit=self._config.max_body_bytes)
                self._prepare(ex, scope)
                if ex.payload is not None and self._tokenize is not None:
                    tokens = await self._tokenize(self.route, ex.payload)
                    ex.payload = None
                    if tokens:
                        ex.info = dataclasses.replace(ex.info, tokens=tuple(tokens))
                watch = DisconnectWatch(receive, asyncio.current_task(), ex.replied)
                if ex.adapter is None:
                    served_by, status = await self._forward(ex)
                else:  # held to the response's end: a retiring version waits for it
                    with self._adapters.lease(ex.adapter):
                        served_by, status = await self._forward(ex)
        except RouterError as exc:
            status = exc.status
            if not ex.replied.started:
                await send_json_error(ex.replied, exc, ex.request_id)
        except ClientGone:
            status = 499  # client closed request (nginx's convention)
            self._metrics.client_disconnects.labels(self.route).inc()
        except asyncio.CancelledError:
            if watch is None or not watch.fired:
                raise  # shutdown, not the client
            # Our own watcher cancelled us because the client left: not an error.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            status = 499
            self._metrics.client_disconnects.labels(self.route).inc()
        except Exception:
            log.exception("request %s: unhandled error on %s", ex.request_id, self.route)
            status = 500
            if not ex.replied.started:
                await send_json_error(ex.replied, RouterError(500, "internal router error"),
                                      ex.request_id)
        finally:
            if watch is not None:
                watch.stop()
            self._count(served_by, status)
            self._duration.observe(time.perf_counter() - ex.start)
            if ex.span is not None:
                Tracing.end(ex.span, status, ex.span_attributes(served_by))

    def _prepare(self, ex: Exchange, scope: Scope) -> None:
        """What routing needs from the body, and the upstream request's line and head."""
        if self._has_body:
            # With adapters served, their names are resolved first (a replaced version
            # is a 404 that says which one serves), then anything else is checked.
            adapters = self._adapters.in_use
            known = self._pool.served_models()
            parsed = parse_request(ex.body, scope["headers"], route=self.route,
                                   known_models=frozenset() if adapters else known,
                                   keys=self._keys, prefix_chars=self._config.prefix_chars)
            ex.info, ex.stream = parsed.info, parsed.stream
            if self._config.enable_lora:
                refuse_prompt_logprobs(self.route, parsed.payload)
            if self._tokenize is not None:
                ex.payload = parsed.payload
            if adapters:
                self._resolve_adapter(ex, parsed.payload)
                if ex.adapter is None:  # listed by the names clients use
                    engine = {v.engine_name for v in self._adapters.versions()}
                    check_model(ex.info.model, known,
                                (known - engine) | self._adapters.names())
            if ex.span is not None:  # checked above: only a name the fleet serves
                ex.model = ex.client_model if ex.adapter is not None else (
                    ex.info.model if ex.info.model in known else None)
            if self._migrates if ex.stream else self._rides:
                self._track(ex, scope, parsed.payload)
        else:
            ex.info = RequestInfo(route=self.route)
        query = scope.get("query_string", b"")
        ex.line = self._request_line + (b"?" + query if query else b"")
        ex.headers = upstream_header_block(scope, ex.request_id,
                                           len(ex.body) if self._has_body else None, ex.trace)

    def _track(self, ex: Exchange, scope: Scope, payload: dict[str, Any]) -> None:
        """Make a stream migratable (its token ids asked for and kept), and have a
        non-streamed request ride on a stream where its answer can be assembled."""
        chat = self.route == "/v1/chat/completions"
        coerce_fields(payload, chat=chat)  # what the engine will read, the router reads
        why = refusal(payload, chat=chat)
        if not ex.stream:
            if not assemblable(payload, why):
                return  # forwarded as it came
            ex.stream = True
            ex.assembled = Assembler(ex.replied, chat=chat,
                                     limit=self._config.max_response_bytes)
        if ex.adapter is not None:
            payload["model"] = ex.adapter.engine_name
        migrates = self._migrates and why is None
        if ex.assembled is not None:
            ex.body = ride_body(payload, ex.body, ids=migrates)
            payload = payload | RIDE
        if not self._migrates:
            return
        if why is not None:
            ex.not_migratable = why
            return
        state = StreamState(chat=chat, body=payload,
                            wants_ids=payload.get("return_token_ids") is True)
        if ex.assembled is None:
            ex.body = upstream_body(payload, ex.body)
        adapter, client_model = ex.adapter, ex.client_model
        ex.migration = Stream(
            state=state, request_id=ex.request_id, replied=ex.assembled or ex.replied,
            info=ex.info, scope=scope, version_of=lambda r: adapter.version
            if adapter is not None else r.weight_version,
            finish=lambda data, version: versioned(data, adapter, client_model, version),
            trace=ex.trace)

    def _resolve_adapter(self, ex: Exchange, payload: dict[str, Any]) -> None:
        """A request naming an adapter runs on one version, named as the engines know it."""
        version = self._adapters.resolve(ex.info.model)
        if version is None:
            return
        ex.adapter = version
        ex.client_model = ex.info.model or ""
        self._metrics.adapter_requests.labels(version.name).inc()
        ex.body = rewrite_model(payload, version.engine_name)
        ex.info = dataclasses.replace(ex.info, adapter=version.engine_name)

    async def _forward(self, ex: Exchange) -> tuple[str, int]:
        attempts = self._config.max_attempts
        tried: list[str] = []
        last_error, last_status = "", 502
        attempt, restarted = 0, False
        while attempt < attempts:
            attempt += 1
            if attempt > 1 and not restarted:
                self._metrics.retries.labels(self.route).inc()
                await asyncio.sleep(backoff(attempt - 1, base=self._config.retry_backoff_s,
                                            cap=self._config.retry_backoff_max_s))
            waited_from = time.perf_counter()
            try:
                slot = await self._dispatch.choose(ex.info, tried, waiting=logged_waiting(
                    log, ex.request_id, "start over on", self._config.queue_timeout_s,
                ) if restarted else None)
            except Unavailable:
                if not tried:
                    raise
                break
            finally:
                if self._dispatch.queueing:
                    self._metrics.queue_wait.labels(self.route).observe(
                        time.perf_counter() - waited_from)
            if ex.span is not None:
                ex.queue_wait_s += time.perf_counter() - waited_from
            ex.attempts = attempt
            tried.append(slot.replica.id)
            with slot:
                result = await self._attempt(ex, slot, tried, last=attempt == attempts)
            if isinstance(result, Answered):
                return result.served_by, result.status
            last_error = f"replica {slot.replica.id}: {result.reason}"
            if isinstance(result, StartOver):  # drained before its first chunk: no failure
                log.info("request %s: %s; starting over on another replica",
                         ex.request_id, result.reason)
                # `tried` holds the replicas that failed this request: a drained one may
                # take it again once it serves (a later drain may move the stream back).
                tried.remove(slot.replica.id)
                attempt, restarted = attempt - 1, True
                continue
            restarted = False
            timed_out = slot.outcome in (Outcome.TIMEOUT, Outcome.CONNECT_TIMEOUT)
            last_status = 504 if timed_out else 502
            log.warning("request %s: %s; %s", ex.request_id, last_error,
                        "retrying on another replica" if attempt < attempts else "giving up")
            if ex.span is not None:
                ex.span.add_event("attempt failed", {"dpserve.replica": slot.replica.id,
                                                     "dpserve.reason": last_error})
        raise RouterError(last_status, f"no replica could serve the request ({last_error})")

    def _retry(self, slot: Slot, stream: bool, last: bool, status: int | None = None) -> bool:
        return not last and is_retryable(slot.outcome, status=status,
                                         bytes_sent_to_client=False, stream=stream)

    async def _attempt(self, ex: Exchange, slot: Slot, tried: list[str], *,
                       last: bool) -> Attempt:
        """Send the request to `slot`'s replica and answer the client, or say why to try
        another. Sets `slot.outcome` for the replica's breaker as it learns how the
        attempt went."""
        # vLLM answers a stream's head as soon as it has taken the request (its tokens
        # follow): a stream with no head after the idle timeout met a stuck server.
        head_s = self._config.first_byte_timeout_s
        if ex.stream:
            head_s = min(head_s, self._config.stream_idle_timeout_s)
        resp: UpstreamResponse | None = None
        try:
            # Leaving the block releases the response: a connection with its response
            # unread is closed, so vLLM sees the disconnect and aborts the generation.
            async with self._upstream.open(
                    self._origin(slot.replica.url), ex.line, ex.headers, ex.body,
                    connect_timeout_s=self._config.connect_timeout_s,
                    head_timeout_s=head_s) as resp:
                return await self._answer(ex, slot, resp, tried, last=last)
        except (*_UNREACHABLE, TimeoutError) as exc:
            if resp is not None:
                raise  # the answer's own, past what `_answer` handles
            return self._unanswered(ex, slot, exc, head_s, last=last)

    def _unanswered(self, ex: Exchange, slot: Slot, exc: BaseException, head_s: float, *,
                    last: bool) -> Attempt:
        """No response came: why, for another replica to be tried."""
        slot.outcome = classify(None, exc)
        if slot.outcome is Outcome.CONNECT_FAILED:
            self._pool.mark_down(slot.replica, f"connection failed: {exc}")
            return TryAnother(f"connection failed ({exc})")
        if slot.outcome is Outcome.CONNECT_TIMEOUT:
            # Not taken, but a slow accept is no proof of death: health checks decide.
            return TryAnother(f"no connection within {self._config.connect_timeout_s:g} s")
        if slot.outcome is Outcome.DISCONNECTED:
            return TryAnother(f"connection dropped before the response "
                              f"({type(exc).__name__})")
        reason = f"no response within {head_s:g} s"
        if self._retry(slot, ex.stream, last) or (ex.stream and not last):
            return TryAnother(reason)
        raise RouterError(504, f"replica {slot.replica.id} sent {reason}") from None

    async def _answer(self, ex: Exchange, slot: Slot, resp: UpstreamResponse,
                      tried: list[str], *, last: bool) -> Attempt:
        """Pass the replica's response on: a stream to its owner, the rest whole."""
        replica = slot.replica
        stream = ex.stream
        slot.outcome = classify(resp.status, None)
        if self._retry(slot, stream, last, resp.status):
            return TryAnother(f"answered {resp.status}")
        out_headers = downstream_headers(
            resp.raw_headers, ex.request_id, replica.id, replica.weight_version,
            ex.adapter.version if ex.adapter is not None else None)
        version = replica.weight_version  # what the header says answers
        if stream and resp.content_type == "text/event-stream":
            return await self._streams.serve(ex, resp, slot, out_headers, version, tried)
        cap = self._config.max_response_bytes
        try:
            if resp.complete:  # small responses arrive with their head
                payload = await resp.read(cap)
            else:
                async with asyncio.timeout(self._config.first_byte_timeout_s):
                    payload = await resp.read(cap)
        except ResponseTooLarge:
            slot.outcome = Outcome.ABORTED  # the replica worked; the router will not hold it
            raise RouterError(502, f"replica {replica.id}'s response is larger than the "
                                   f"router's limit of {cap} bytes") from None
        except (*_UNREACHABLE, TimeoutError) as exc:
            slot.outcome = classify(None, exc)
            if self._retry(slot, stream, last):
                return TryAnother(f"connection dropped mid-response ({type(exc).__name__})")
            raise RouterError(502 if slot.outcome is Outcome.DISCONNECTED else 504,
                              f"replica {replica.id} failed mid-response") from None
        status = resp.status
        if status >= 400:  # in the OpenAI envelope, whatever the replica's shape
            status, payload = relay_error(status, payload, out_headers, route=self.route,
                                          model=ex.info.model, served=replica.models)
        elif self._lists_models and status == 200 and ex.adapter is None:
            payload = list_models(payload, self._adapters)
        else:
            payload = versioned(payload, ex.adapter, ex.client_model, version)
        out_headers.append((b"content-length", str(len(payload)).encode()))
        ex.first_byte_s = slot.first_byte_s = time.perf_counter() - ex.start
        self._first_byte.observe(slot.first_byte_s)
        await ex.replied.start(status, out_headers)
        await ex.replied.body(payload, more=False)
        return Answered(status, replica.id)
