"""Raw ASGI plumbing of the data plane: types, the reply tracker, the disconnect
watcher and the error answer (the header rules of a proxy hop: `dpserve.router.headers`).

Raw ASGI rather than Starlette's Request/Response objects so a forwarded
request costs as little as possible.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from dpserve.router.errors import RouterError, error_body
from dpserve.router.headers import REQUEST_ID_HEADER

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Reply(Protocol):
    """Where a response goes: the client (`ReplyTracker`), or the router's assembly of
    a non-streamed answer from a stream (`dpserve.router.forward.assembled`)."""

    started: bool
    finished: bool

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def body(self, data: bytes, *, more: bool) -> None: ...


class ReplyTracker:
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


class DisconnectWatch:
    """Cancels the request's task if its client disconnects while it is served.

    The watching task (awaiting the server's `http.disconnect`) starts only once
    the request has lasted `after_s`: most proxied requests end sooner and pay for
    a timer instead of a task. A client that leaves earlier is noticed then.
    The server also reports `http.disconnect` once the response is complete;
    that one must not cancel anything, hence the `finished` check.
    """

    __slots__ = ("_receive", "_replied", "_task", "_timer", "_watcher", "fired")

    def __init__(self, receive: Receive, task: asyncio.Task[Any] | None,
                 replied: ReplyTracker, *, after_s: float = 0.05) -> None:
        self._receive = receive
        self._task = task
        self._replied = replied
        self._watcher: asyncio.Task[None] | None = None
        self.fired = False
        """Whether this watch cancelled the task (the client left)."""
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            after_s, self._start)

    def _start(self) -> None:
        self._timer = None
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if self._task is not None and not self._replied.finished:
                    self.fired = True
                    self._task.cancel()
                return

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


async def send_json_error(replied: ReplyTracker, exc: RouterError, request_id: str) -> None:
    body = error_body(exc.status, exc.message, param=exc.param)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (REQUEST_ID_HEADER.encode(), request_id.encode()),
    ]
    if exc.retry_after_s is not None:
        headers.append((b"retry-after", str(exc.retry_after_s).encode()))
    await replied.start(exc.status, headers)
    await replied.body(body, more=False)
