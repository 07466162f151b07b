"""Forwarding one client request to one replica, as a pure ASGI endpoint.

The data plane: aiohttp for the upstream call (see ARCHITECTURE.md for why),
raw ASGI on the client side (no Starlette Request/Response objects, no
BaseHTTPMiddleware) so that a request costs as little as possible.

Order of events for one request:

1. read the body (bounded: 413 past the limit), parse it (400 unless a JSON object),
   check the model name against the replicas' (404);
2. choose a replica with the policy and hold a lease on it;
3. send upstream; if the replica cannot be reached, or drops the connection
   before a single byte went to the client, mark it and try another one
   (bounded attempts) — the client has seen nothing, so a retry is invisible;
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
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from dpserve.config import RouterConfig
from dpserve.metrics.router import RouterMetrics, status_class
from dpserve.router.errors import RouterError, error_body, sse_error_event
from dpserve.router.policies import Policy, RequestInfo
from dpserve.router.pool import Replica, ReplicaPool

log = logging.getLogger("dpserve.proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REQUEST_ID_HEADER = "x-request-id"
REPLICA_HEADER = "x-dpserve-replica"
WEIGHT_VERSION_HEADER = "x-dpserve-weight-version"

# Headers that describe one hop, not the message (RFC 9110 §7.6.1), plus the
# ones aiohttp/uvicorn recompute for us.
_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
})
_HOP_BY_HOP_STR = frozenset(h.decode() for h in _HOP_BY_HOP) | {"date", "server"}

# Errors that mean "this replica did not take the request": safe to retry elsewhere.
_UNREACHABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError, aiohttp.ClientPayloadError)


class _ClientGone(Exception):
    """The client disconnected; stop working on its request."""


@dataclass(slots=True)
class _Attempt:
    replica: Replica
    status: int = 0
    started_body: bool = False


class ProxyEndpoint:
    """ASGI app forwarding one route (`POST /v1/completions`, ...) to the replicas."""

    def __init__(
        self,
        route: str,
        *,
        pool: ReplicaPool,
        policy: Policy,
        config: RouterConfig,
        metrics: RouterMetrics,
        session: Callable[[], aiohttp.ClientSession],
        has_body: bool = True,
    ) -> None:
        self.route = route
        self._pool = pool
        self._policy = policy
        self._config = config
        self._metrics = metrics
        self._session = session
        self._has_body = has_body
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s,
            sock_read=config.first_byte_timeout_s,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        request_id = _request_id(scope)
        served_by = "none"
        status = 500
        replied = _ReplyTracker(send)
        watcher: asyncio.Task[None] | None = None
        try:
            body, info, stream = await self._read_request(scope, receive)
            watcher = _watch_disconnect(receive, asyncio.current_task(), replied)
            served_by, status = await self._forward(scope, body, info, stream, request_id,
                                                    replied, start)
        except RouterError as exc:
            status = exc.status
            if not replied.started:
                await _send_json_error(replied, exc, request_id)
        except _ClientGone:
            status = 499  # client closed request (nginx's convention)
            self._metrics.client_disconnects.labels(self.route).inc()
        except asyncio.CancelledError:
            if watcher is None or not watcher.done():
                raise  # shutdown, not the client
            # Our own watcher cancelled us because the client left: not an error.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            status = 499
            self._metrics.client_disconnects.labels(self.route).inc()
        finally:
            if watcher is not None:
                watcher.cancel()
            elapsed = time.perf_counter() - start
            self._metrics.requests.labels(self.route, served_by, status_class(status)).inc()
            self._metrics.request_duration.labels(self.route).observe(elapsed)

    async def _read_request(
        self, scope: Scope, receive: Receive
    ) -> tuple[bytes, RequestInfo, bool]:
        limit = self._config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise RouterError(413, f"request body is larger than the limit of {limit} bytes")
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
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if not self._has_body:
            return body, RequestInfo(route=self.route), False
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RouterError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise RouterError(400, "request body must be a JSON object")
        model = payload.get("model")
        if model is not None and not isinstance(model, str):
            raise RouterError(400, "'model' must be a string", param="model")
        known = self._pool.served_models()
        if model is not None and known and model not in known:
            raise RouterError(404, f"The model `{model}` does not exist.", param="model")
        return body, RequestInfo(route=self.route, model=model), payload.get("stream") is True

    async def _forward(
        self, scope: Scope, body: bytes, info: RequestInfo, stream: bool, request_id: str,
        replied: _ReplyTracker, start: float,
    ) -> tuple[str, int]:
        headers = _upstream_headers(scope, request_id, body_len=len(body))
        tried: set[str] = set()
        last_error = ""
        for attempt in range(self._config.max_attempts):
            candidates = [r for r in self._pool.ready() if r.id not in tried]
            replica = self._policy.select(candidates, info)
            if replica is None:
                break
            tried.add(replica.id)
            if attempt:
                self._metrics.retries.labels(self.route).inc()
            with self._pool.lease(replica):
                outcome = await self._try_replica(
                    replica, scope, body, headers, stream, request_id, replied, start
                )
            if isinstance(outcome, int):
                return replica.id, outcome
            last_error = f"replica {replica.id}: {outcome}"
            log.warning("request %s: %s; %s", request_id, last_error,
                        "retrying on another replica" if attempt + 1 < self._config.max_attempts
                        else "giving up")
        if not tried:
            raise RouterError(503, "no replica is ready to serve requests; retry later")
        raise RouterError(502, f"no replica could serve the request ({last_error})")

    async def _try_replica(
        self, replica: Replica, scope: Scope, body: bytes, headers: dict[str, str],
        stream: bool, request_id: str, replied: _ReplyTracker, start: float,
    ) -> int | str:
        """Returns the status sent to the client, or a reason to try another replica."""
        url = replica.url + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        session = self._session()
        try:
            resp = await session.request(
                scope["method"], url, data=body if self._has_body else None,
                headers=headers, timeout=self._timeout, allow_redirects=False,
            )
        except aiohttp.ClientConnectorError as exc:
            self._pool.mark_down(replica, f"connection failed: {exc.os_error or exc}")
            return f"connection failed ({exc.os_error or exc})"
        except aiohttp.ConnectionTimeoutError:
            # Not taken either, but a slow accept is no proof of death: the health
            # checks decide whether it leaves rotation.
            return f"no connection within {self._config.connect_timeout_s:g} s"
        except _UNREACHABLE as exc:
            return f"connection dropped before the response ({type(exc).__name__})"
        except TimeoutError:
            raise RouterError(
                504, f"replica {replica.id} sent no response within "
                f"{self._config.first_byte_timeout_s:g} s"
            ) from None
        try:
            out_headers = _downstream_headers(resp, request_id, replica)
            if stream and resp.content_type == "text/event-stream":
                return await self._pass_stream(resp, replica, out_headers, replied, start)
            try:
                payload = await resp.read()
            except _UNREACHABLE as exc:
                return f"connection dropped mid-response ({type(exc).__name__})"
            except TimeoutError:
                raise RouterError(504, f"replica {replica.id} stalled mid-response") from None
            out_headers.append((b"content-length", str(len(payload)).encode()))
            self._metrics.time_to_first_byte.labels(self.route).observe(time.perf_counter() - start)
            await replied.start(resp.status, out_headers)
            await replied.body(payload, more=False)
            return resp.status
        finally:
            resp.close()  # closes the connection if unread: vLLM sees the disconnect and aborts

    async def _pass_stream(
        self, resp: aiohttp.ClientResponse, replica: Replica, headers: list[tuple[bytes, bytes]],
        replied: _ReplyTracker, start: float,
    ) -> int | str:
        """Forward an SSE stream chunk by chunk; headers go out with the first chunk."""
        idle = self._config.stream_idle_timeout_s
        reader = resp.content
        try:
            async with asyncio.timeout(self._config.first_byte_timeout_s):
                first = await reader.readany()
        except _UNREACHABLE as exc:
            return f"stream dropped before its first chunk ({type(exc).__name__})"
        except TimeoutError:
            raise RouterError(504, f"replica {replica.id} sent no token within "
                                   f"{self._config.first_byte_timeout_s:g} s") from None
        self._metrics.time_to_first_byte.labels(self.route).observe(time.perf_counter() - start)
        await replied.start(resp.status, headers)
        chunk = first
        try:
            while chunk:
                await replied.body(chunk, more=True)
                async with asyncio.timeout(idle):
                    chunk = await reader.readany()
        except (*_UNREACHABLE, TimeoutError) as exc:
            reason = (f"no data for {idle:g} s" if isinstance(exc, TimeoutError)
                      else "the replica closed the stream early")
            log.warning("stream from replica %s cut: %s", replica.id, reason)
            self._metrics.stream_errors.labels(self.route, replica.id).inc()
            await replied.body(sse_error_event(502, f"stream interrupted: {reason}"), more=False)
            return resp.status
        await replied.body(b"", more=False)
        return resp.status


class _ReplyTracker:
    """Wraps ASGI `send` and remembers whether the response has started."""

    __slots__ = ("_send", "finished", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, *, more: bool) -> None:
        self.finished = not more
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


def _watch_disconnect(
    receive: Receive, task: asyncio.Task[Any] | None, replied: _ReplyTracker
) -> asyncio.Task[None]:
    """Cancel `task` if the client disconnects while its request is being served.

    The server also reports `http.disconnect` once the response is complete;
    that one must not cancel anything, hence the `finished` check.
    """

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if task is not None and not replied.finished:
                    task.cancel()
                return

    return asyncio.create_task(watch())


async def _send_json_error(replied: _ReplyTracker, exc: RouterError, request_id: str) -> None:
    body = error_body(exc.status, exc.message, param=exc.param)
    await replied.start(exc.status, [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (REQUEST_ID_HEADER.encode(), request_id.encode()),
    ])
    await replied.body(body, more=False)


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= 128 and text.isprintable():
                return text
            break
    return uuid.uuid4().hex


def _upstream_headers(scope: Scope, request_id: str, *, body_len: int) -> dict[str, str]:
    headers = {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in scope["headers"]
        if name not in _HOP_BY_HOP and name != b"x-request-id"
    }
    headers["x-request-id"] = request_id
    return headers


def _downstream_headers(
    resp: aiohttp.ClientResponse, request_id: str, replica: Replica
) -> list[tuple[bytes, bytes]]:
    out = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in resp.headers.items()
        if name.lower() not in _HOP_BY_HOP_STR and name.lower() != REQUEST_ID_HEADER
    ]
    out.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
    out.append((REPLICA_HEADER.encode(), replica.id.encode()))
    if replica.weight_version is not None:
        out.append((WEIGHT_VERSION_HEADER.encode(), replica.weight_version.encode("latin-1")))
    return out
