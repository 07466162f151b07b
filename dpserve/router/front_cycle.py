"""A response's head and its first body part in one socket write.

uvicorn's `RequestResponseCycle.send` writes the status line and headers when the
app sends `http.response.start`, then each body part when it comes: two writes
(two system calls, two TCP segments to the client) for every non-streaming
response. They were the largest item in the router's profile. :class:`OneWriteCycle`
keeps the head until the first `http.response.body` and writes both together.

A head is never held back longer than the current turn of the event loop: if the
app has not sent a body part by then (a stream whose replica is still working
on its first token), the head goes out alone, as before. Clients see the same
bytes in the same order; only the number of writes changes.

The head is built with uvicorn's rules (its header name and value checks, run
once over all the names and once over all the values,
content-length or chunked framing, `connection: close` when the connection will
not be kept alive); body parts after the first are uvicorn's own code.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string


class OneWriteCycle(RequestResponseCycle):
    """uvicorn's cycle, writing a response's head together with its first body part.

    `GuardedProtocol` turns each cycle uvicorn creates into one (the class is
    swapped before the app runs: uvicorn builds the cycle inside its own header
    callback, with no factory to override)."""

    _held_head: bytes | None = None
    _flush: asyncio.Handle | None = None

    async def send(self, message: Any) -> None:
        if self._held_head is not None:
            if (message["type"] == "http.response.body" and not self.flow.write_paused
                    and not self.disconnected):
                self._send_first_body(message)
                return
            self._write_held_head()
            await super().send(message)
            return
        if self.response_started or self.disconnected or message["type"] != "http.response.start":
            await super().send(message)
            return
        if self.flow.write_paused:
            await self.flow.drain()
        if self.disconnected:
            return
        self._held_head = self._build_head(message)
        self._flush = asyncio.get_running_loop().call_soon(self._write_held_head)

    def _write_held_head(self) -> None:
        head, self._held_head = self._held_head, None
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if head is not None and not self.disconnected and not self.transport.is_closing():
            self.transport.write(head)

    def _build_head(self, message: Any) -> bytes:
        """uvicorn's `http.response.start` handling, returning the bytes it would write."""
        self.response_started = True
        self.waiting_for_100_continue = False
        status_code = message["status"]
        headers = self.default_headers + list(message.get("headers", []))
        if self.access_log:
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(self.scope),
                                    self.scope["method"], get_path_with_query_string(self.scope),
                                    self.scope["http_version"], status_code)
        # uvicorn's checks are character classes: one search over all the names (and one
        # over all the values) finds what a search per header would.
        if HEADER_RE.search(b"".join([name for name, _ in headers])):
            raise RuntimeError("Invalid HTTP header name.")
        if HEADER_VALUE_RE.search(b"".join([value for _, value in headers])):
            raise RuntimeError("Invalid HTTP header value.")
        content = [STATUS_LINE[status_code]]
        has_connection_close = False
        for name, value in headers:
            name = name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection":
                if b"close" in [token.lower().strip() for token in value.split(b",")]:
                    self.keep_alive = False
                    has_connection_close = True
            content.extend([name, b": ", value, b"\r\n"])
        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        if (self.chunked_encoding is None and self.scope["method"] != "HEAD"
                and status_code not in (204, 304)):
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        return b"".join(content)

    def _send_first_body(self, message: Any) -> None:
        """The first body part, written with the held head; then uvicorn's completion."""
        head = self._held_head
        assert head is not None
        self._held_head = None
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
            data = b""
        elif self.chunked_encoding:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more_body:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self.expected_content_length:
                self.transport.write(head)  # what uvicorn would have sent before failing
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            data = body
        self.transport.write(head + data if data else head)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()
