"""Raw HTTP/1.1 on a socket, for tests that must send what no client library would.

`exchange` writes bytes exactly as given (smuggling attempts, pipelined requests,
broken framing) and reads what comes back until the server closes or goes quiet;
`parse_responses` splits that into responses with httptools, so a test can say
how many responses came back and what each held.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httptools


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error_message(self) -> str:
        """The OpenAI envelope's message (fails the test if the body is not one)."""
        return self.json()["error"]["message"]


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def exchange(port: int, *parts: bytes, quiet_s: float = 1.0, until_closed: bool = False,
                   deadline_s: float = 15.0, gap_s: float = 0.0,
                   connection: Connection | None = None) -> tuple[bytes, bool]:
    """Send `parts` (with `gap_s` between them) on one connection while reading what
    comes back; return it and whether the server closed the connection. Reading stops
    when the server closes it, or (unless `until_closed`) after `quiet_s` without a
    byte once everything was sent. A server that hangs up mid-send is no error.
    `connection`: one already open (it is closed at the end), instead of a new one."""
    reader, writer = connection or await asyncio.open_connection("127.0.0.1", port)
    sent = asyncio.Event()

    async def send() -> None:
        try:
            for i, part in enumerate(parts):
                if i and gap_s:
                    await asyncio.sleep(gap_s)  # a slow client, on purpose
                writer.write(part)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            sent.set()

    sender = asyncio.create_task(send())
    try:
        if not until_closed:
            await sent.wait()
        return await read_all(reader, quiet_s=None if until_closed else quiet_s,
                              deadline_s=deadline_s)
    finally:
        sender.cancel()
        writer.close()


async def read_all(reader: asyncio.StreamReader, *, quiet_s: float | None,
                   deadline_s: float) -> tuple[bytes, bool]:
    """Bytes until EOF (closed=True), `quiet_s` of silence, or the deadline."""
    data = bytearray()
    end = time.monotonic() + deadline_s
    while (left := end - time.monotonic()) > 0:
        wait = left if quiet_s is None else min(left, quiet_s)
        try:
            chunk = await asyncio.wait_for(reader.read(65536), wait)
        except TimeoutError:
            if quiet_s is not None:
                return bytes(data), False
            continue
        except ConnectionResetError:
            return bytes(data), True
        if not chunk:
            return bytes(data), True
        data += chunk
    return bytes(data), False


async def first_response(reader: asyncio.StreamReader, *, deadline_s: float
                         ) -> RawResponse | None:
    """The first complete response `reader` gives, or None if none came by the deadline
    or before the server closed (for a request whose body is held back: its answer
    must come without it)."""
    data = bytearray()
    end = time.monotonic() + deadline_s
    while (left := end - time.monotonic()) > 0:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), left)
        except (TimeoutError, ConnectionResetError):
            return None
        if not chunk:
            return None
        data += chunk
        if answers := parse_responses(bytes(data)):
            return answers[0]
    return None


class _Collector:
    def __init__(self) -> None:
        self.responses: list[RawResponse] = []
        self._current: RawResponse | None = None
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._current = RawResponse(0)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._current is not None
        self._current.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self._current is not None
        self._current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        assert self._current is not None
        self._current.body += body

    def on_message_complete(self) -> None:
        assert self._current is not None
        self.responses.append(self._current)
        self._current = None


def parse_responses(data: bytes) -> list[RawResponse]:
    """Every complete response in `data`, in order."""
    collector = _Collector()
    collector.parser.feed_data(data)
    return collector.responses


def request(method: str, path: str, *headers: str, body: bytes = b"",
            length: bool = True) -> bytes:
    """One request's bytes; a Content-Length for `body` unless `length` is False or
    `headers` frame it already."""
    lines = [f"{method} {path} HTTP/1.1", "host: router", *headers]
    framed = any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers)
    if length and not framed and (body or method == "POST"):
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def completion(prompt: str = "hi") -> bytes:
    body = json.dumps({"model": "fake-model", "prompt": prompt}).encode()
    return request("POST", "/v1/completions", "content-type: application/json", body=body)
