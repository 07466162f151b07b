"""A response's head and its first body part in one socket write.

uvicorn's `RequestResponseCycle.send` writes the status line and headers when the
app sends `http.response.start`, then each body part when it comes: two writes
(two system calls, two TCP segments to the client) for every non-streaming
response. :class:`OneWriteCycle` keeps the head until the first
`http.response.body` and writes both together.

A head is never held back longer than the current turn of the event loop: if the
app has not sent a body part by then (a stream whose replica is still working
on its first token), the head goes out alone, as before. Clients see the same
bytes in the same order; only the number of writes changes.

The bytes are uvicorn's own: its `send` runs unchanged for the head and the first
body part against a `_Recorder` standing in for the transport, which keeps what
uvicorn writes (and a close it asks for) until both can go out in one write.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class _Recorder:
    """The transport, as uvicorn's `send` sees it while the head is held: writes are
    kept; a close writes them first (in uvicorn's order: before the next pipelined
    request is taken up); everything else is the real transport's."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        if self.parts and not self.transport.is_closing():
            self.transport.write(b"".join(self.parts))
        self.parts = []

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class OneWriteCycle(RequestResponseCycle):
    """uvicorn's cycle, writing a response's head together with its first body part.

    `GuardedProtocol` turns each cycle uvicorn creates into one (the class is
    swapped before the app runs: uvicorn builds the cycle inside its own header
    callback, with no factory to override)."""

    _held: _Recorder | None = None
    _flush: asyncio.Handle | None = None

    async def send(self, message: Any) -> None:
        try:
            await self._send(message)
        finally:
            if self.response_complete and self.body:
                # Answered before its body was read (a refusal: 401, 404, 413, 503):
                # what uvicorn buffered of it (up to its 64 KiB high-water mark plus one
                # socket read) would stay held until the body ends or the connection
                # closes; later bytes are dropped as they come.
                self.body = bytearray()

    async def _send(self, message: Any) -> None:
        held = self._held
        if held is not None:
            if message["type"] != "http.response.body" or self.flow.write_paused:
                self._write_held()
                await super().send(message)
                return
            self._stop_flush()
            try:
                await self._recorded(held, message)
            finally:
                self._write_held()
            return
        if self.response_started or self.disconnected or message["type"] != "http.response.start":
            await super().send(message)
            return
        held = _Recorder(self.transport)
        await self._recorded(held, message)
        if held.parts:
            self._held = held
            self._flush = asyncio.get_running_loop().call_soon(self._write_held)

    async def _recorded(self, recorder: _Recorder, message: Any) -> None:
        """uvicorn's `send`, writing into `recorder`."""
        self.transport = recorder  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = recorder.transport

    def _stop_flush(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None

    def _write_held(self) -> None:
        held, self._held = self._held, None
        self._stop_flush()
        if held is not None and not self.disconnected:
            held.flush()
