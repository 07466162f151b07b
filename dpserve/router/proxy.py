"""Forwarding one client request to the replicas, as a pure ASGI endpoint.

The data plane: raw ASGI on the client side (`dpserve.router.asgi`) and a
minimal HTTP/1.1 client on the replica side (`dpserve.router.upstream`), so
that a request costs as little as possible. (aiohttp's client, the fastest
general-purpose one measured for this, was still the largest cost per request.)

Order of events for one request:

1. read the body (bounded: 413 past the limit, 503 when all requests together hold
   too much), parse it (400 unless a JSON object), check the model name against the
   replicas' (404), read its affinity keys. A route without a body (`GET /v1/models`)
   refuses one (400): bytes the router does not frame itself never reach a replica;
2. ask the dispatcher for a replica (`dpserve.router.dispatch`: policy, caps,
   admission queue, circuit breakers) and hold a slot on it for the attempt;
3. send upstream; if the attempt fails in a way `retry.is_retryable` allows —
   always before a single byte went to the client — try another replica after
   a short backoff (bounded attempts): the client has seen nothing, so a retry
   is invisible;
4. pass the response through: whole for JSON, chunk by chunk for streams.
   A stream that breaks after it started ends with an SSE error event, never a hang;
5. if the client disconnects at any point, the upstream request is closed, so
   vLLM aborts the generation instead of computing it for nobody.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from dpserve.config import RouterConfig
from dpserve.metrics.router import RouterMetrics, status_class
from dpserve.router.asgi import (
    DisconnectWatch,
    Receive,
    ReplyTracker,
    Scope,
    Send,
    downstream_headers,
    request_id,
    send_json_error,
    upstream_header_block,
)
from dpserve.router.breaker import Outcome, classify
from dpserve.router.budget import BodyBudget, BodyHold
from dpserve.router.dispatch import Dispatcher, Slot, Unavailable
from dpserve.router.errors import RouterError, sse_error_event
from dpserve.router.policies import RequestInfo
from dpserve.router.policies.keys import prompt_prefix, session_id
from dpserve.router.pool import ReplicaPool
from dpserve.router.retry import backoff, is_retryable
from dpserve.router.upstream import Origin, ResponseTooLarge, UpstreamPool, UpstreamResponse

log = logging.getLogger("dpserve.proxy")

# Errors that mean "the connection broke or never was": `upstream`'s ConnectFailed
# and Disconnected are OSErrors; its timeouts are TimeoutErrors.
_UNREACHABLE = (OSError,)


class _ClientGone(Exception):
    """The client disconnected; stop working on its request."""


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
        upstream: Callable[[], UpstreamPool],
        bodies: BodyBudget,
        method: str = "POST",
    ) -> None:
        self.route = route
        self.method = method
        self._bodies = bodies
        self._pool = pool
        self._dispatch = dispatcher
        self._config = config
        self._metrics = metrics
        self._upstream = upstream
        self._has_body = method == "POST"
        self._wants_session = config.policy == "session-affinity"
        self._wants_prefix = config.policy == "prefix-affinity"
        # Per-request costs kept out of the hot path: parsed replica URLs, the request
        # line, and the metric children of this route.
        self._origins: dict[str, Origin] = {}
        self._request_line = f"{method} {route}".encode()
        self._duration = metrics.request_duration.labels(route)
        self._first_byte = metrics.time_to_first_byte.labels(route)
        self._counted: dict[tuple[str, int], Any] = {}

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
        start = time.perf_counter()
        rid = request_id(scope)
        served_by = "none"
        status = 500
        replied = ReplyTracker(send)
        watch: DisconnectWatch | None = None
        try:
            with self._bodies.hold() as hold:
                body, info, stream = await self._read_request(scope, receive, hold)
                watch = DisconnectWatch(receive, asyncio.current_task(), replied)
                served_by, status = await self._forward(scope, body, info, stream, rid,
                                                        replied, start)
        except RouterError as exc:
            status = exc.status
            if not replied.started:
                extra = ([(b"retry-after", str(exc.retry_after_s).encode())]
                         if isinstance(exc, Unavailable) else None)
                await send_json_error(replied, exc, rid, extra)
        except _ClientGone:
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
            log.exception("request %s: unhandled error on %s", rid, self.route)
            status = 500
            if not replied.started:
                await send_json_error(replied, RouterError(500, "internal router error"), rid)
        finally:
            if watch is not None:
                watch.stop()
            self._count(served_by, status)
            self._duration.observe(time.perf_counter() - start)

    async def _read_request(
        self, scope: Scope, receive: Receive, hold: BodyHold
    ) -> tuple[bytes, RequestInfo, bool]:
        if scope["method"] != self.method:  # HEAD of a GET route: never forwarded
            raise RouterError(405, f"method {scope['method']} is not allowed on {self.route}")
        limit = self._config.max_body_bytes
        declared: bytes | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name == b"transfer-encoding":
                chunked = True
        if not self._has_body and (chunked or declared not in (None, b"0")):
            raise RouterError(400, f"{self.method} {self.route} takes no request body")
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                raise RouterError(413, f"request body is larger than the limit of {limit} bytes")
            self._hold(hold, int(declared))  # refuse before reading, not after
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RouterError(413, f"request body is larger than the limit of {limit} bytes")
            self._hold(hold, size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if not self._has_body:
            if size:
                raise RouterError(400, f"{self.method} {self.route} takes no request body")
            return b"", RequestInfo(route=self.route), False
        body = b"".join(chunks)
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RouterError(400, f"request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise RouterError(400, "request body is nested too deeply") from None
        if not isinstance(payload, dict):
            raise RouterError(400, "request body must be a JSON object")
        model = payload.get("model")
        if model is not None and not isinstance(model, str):
            raise RouterError(400, "'model' must be a string", param="model")
        stream = payload.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise RouterError(400, "'stream' must be a boolean", param="stream")
        known = self._pool.served_models()
        if model is not None and known and model not in known:
            raise RouterError(404, f"The model `{model}` does not exist.", param="model")
        info = RequestInfo(
            route=self.route, model=model,
            session_id=session_id(scope["headers"], payload) if self._wants_session else None,
            prefix=(prompt_prefix(payload, self._config.prefix_chars)
                    if self._wants_prefix else None),
        )
        return body, info, stream is True

    def _hold(self, hold: BodyHold, size: int) -> None:
        if not hold.grow_to(size):
            raise Unavailable(503, "the router holds as many request bytes as it may "
                                   "(max_inflight_body_bytes); retry shortly", retry_after_s=1)

    async def _forward(
        self, scope: Scope, body: bytes, info: RequestInfo, stream: bool, rid: str,
        replied: ReplyTracker, start: float,
    ) -> tuple[str, int]:
        query = scope.get("query_string", b"")
        line = self._request_line + (b"?" + query if query else b"")
        headers = upstream_header_block(scope, rid, len(body) if self._has_body else None)
        attempts = self._config.max_attempts
        tried: list[str] = []
        last_error, last_status = "", 502
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                self._metrics.retries.labels(self.route).inc()
                await asyncio.sleep(backoff(attempt - 1, base=self._config.retry_backoff_s,
                                            cap=self._config.retry_backoff_max_s))
            waited_from = time.perf_counter()
            try:
                slot = await self._dispatch.choose(info, tried)
            except Unavailable:
                if not tried:
                    raise
                break
            finally:
                if self._dispatch.queueing:
                    self._metrics.queue_wait.labels(self.route).observe(
                        time.perf_counter() - waited_from)
            tried.append(slot.replica.id)
            with slot:
                result = await self._attempt(slot, line, body, headers,
                                             stream, rid, replied, start,
                                             last=attempt == attempts)
            if isinstance(result, int):
                return slot.replica.id, result
            last_error = f"replica {slot.replica.id}: {result}"
            timed_out = slot.outcome in (Outcome.TIMEOUT, Outcome.CONNECT_TIMEOUT)
            last_status = 504 if timed_out else 502
            log.warning("request %s: %s; %s", rid, last_error,
                        "retrying on another replica" if attempt < attempts else "giving up")
        raise RouterError(last_status, f"no replica could serve the request ({last_error})")

    def _retry(self, slot: Slot, stream: bool, last: bool, status: int | None = None) -> bool:
        return not last and is_retryable(slot.outcome, status=status,
                                         bytes_sent_to_client=False, stream=stream)

    async def _attempt(
        self, slot: Slot, line: bytes, body: bytes, headers: bytes,
        stream: bool, rid: str, replied: ReplyTracker, start: float, *, last: bool,
    ) -> int | str:
        """The status sent to the client, or why to try another replica.

        Sets `slot.outcome` for the replica's breaker as it learns how the attempt went.
        """
        replica = slot.replica
        origin = self._origin(replica.url)
        head = b"%s HTTP/1.1\r\nhost: %s\r\n%s" % (line, origin.host_header, headers)
        try:
            resp = await self._upstream().request(
                origin, head, body, connect_timeout_s=self._config.connect_timeout_s,
                head_timeout_s=self._config.first_byte_timeout_s)
        except (*_UNREACHABLE, TimeoutError) as exc:
            slot.outcome = classify(None, exc)
            if slot.outcome is Outcome.CONNECT_FAILED:
                self._pool.mark_down(replica, f"connection failed: {exc}")
                return f"connection failed ({exc})"
            if slot.outcome is Outcome.CONNECT_TIMEOUT:
                # Not taken, but a slow accept is no proof of death: health checks decide.
                return f"no connection within {self._config.connect_timeout_s:g} s"
            if slot.outcome is Outcome.DISCONNECTED:
                return f"connection dropped before the response ({type(exc).__name__})"
            reason = f"no response within {self._config.first_byte_timeout_s:g} s"
            if self._retry(slot, stream, last):
                return reason
            raise RouterError(504, f"replica {replica.id} sent {reason}") from None
        try:
            slot.outcome = classify(resp.status, None)
            if self._retry(slot, stream, last, resp.status):
                return f"answered {resp.status}"
            out_headers = downstream_headers(resp, rid, replica)
            if stream and resp.content_type == "text/event-stream":
                return await self._pass_stream(resp, slot, out_headers, replied, start)
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
                    return f"connection dropped mid-response ({type(exc).__name__})"
                raise RouterError(502 if slot.outcome is Outcome.DISCONNECTED else 504,
                                  f"replica {replica.id} failed mid-response") from None
            out_headers.append((b"content-length", str(len(payload)).encode()))
            self._first_byte.observe(time.perf_counter() - start)
            await replied.start(resp.status, out_headers)
            await replied.body(payload, more=False)
            return resp.status
        finally:
            resp.release()  # closes the connection if unread: vLLM sees the disconnect, aborts

    async def _pass_stream(
        self, resp: UpstreamResponse, slot: Slot, headers: list[tuple[bytes, bytes]],
        replied: ReplyTracker, start: float,
    ) -> int | str:
        """Forward an SSE stream chunk by chunk; headers go out with the first chunk."""
        replica = slot.replica
        idle = self._config.stream_idle_timeout_s
        reader = resp
        try:
            async with asyncio.timeout(self._config.first_byte_timeout_s):
                first = await reader.readany()
        except _UNREACHABLE as exc:
            slot.outcome = Outcome.DISCONNECTED
            return f"stream dropped before its first chunk ({type(exc).__name__})"
        except TimeoutError:
            slot.outcome = Outcome.TIMEOUT
            raise RouterError(504, f"replica {replica.id} sent no token within "
                                   f"{self._config.first_byte_timeout_s:g} s") from None
        self._first_byte.observe(time.perf_counter() - start)
        await replied.start(resp.status, headers)
        chunk = first
        try:
            while chunk:
                await replied.body(chunk, more=True)
                async with asyncio.timeout(idle):
                    chunk = await reader.readany()
        except (*_UNREACHABLE, TimeoutError) as exc:
            slot.outcome = classify(None, exc)
            reason = (f"no data for {idle:g} s" if isinstance(exc, TimeoutError)
                      else "the replica closed the stream early")
            log.warning("stream from replica %s cut: %s", replica.id, reason)
            self._metrics.stream_errors.labels(self.route, replica.id).inc()
            await replied.body(sse_error_event(502, f"stream interrupted: {reason}"), more=False)
            return resp.status
        await replied.body(b"", more=False)
        return resp.status
