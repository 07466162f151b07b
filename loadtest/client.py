"""One OpenAI request, timed: the request bodies and the streaming reader.

Timing follows vLLM's benchmark client (`vllm/benchmarks/lib/endpoint_request_func.py`)
so that numbers compare one to one:

- the clock (``time.perf_counter``) starts just before the request is sent;
- **TTFT** ends at the first server-sent event that carries a non-empty
  ``choices`` list (its text may be empty);
- **ITL** is the gap between consecutive such events, each timestamped when
  its bytes are read from the socket;
- **E2E latency** ends at the last such event (not at ``[DONE]`` or the usage
  event after it);
- **output tokens** are ``usage.completion_tokens`` of the final event
  (requests ask for it with ``stream_options.include_usage``); the prompt
  tokens are ``usage.prompt_tokens`` when reported.

A request fails, with one of the reasons in `FAILURE_REASONS`, when the server
answers with an HTTP error status, sends an ``error`` event, ends the stream
without ``data: [DONE]`` or without any token, closes the connection, or when
the request runs past its timeout. Failures are recorded, never raised.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

REPLICA_HEADER = "x-dpserve-replica"
"""Response header naming the replica that served a request (set by dpserve's router)."""

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[Endpoint, str] = {
    "completions": "/v1/completions", "chat": "/v1/chat/completions"}

FAILURE_REASONS: dict[str, str] = {
    "http_<status>": "the server answered with an HTTP error status, e.g. http_503",
    "timeout": "no complete answer within the request timeout",
    "connect_error": "no connection could be made",
    "disconnected": "the server closed the connection before answering",
    "incomplete_stream": "the stream was cut, or ended without data: [DONE]",
    "stream_error": "the server sent an error event in the stream",
    "no_tokens": "the stream ended without a single token event",
    "bad_response": "the body was not what an OpenAI server sends",
    "client_error": "any other client-side failure (the detail says which)",
}
"""Why a request failed: the keys of ``metrics.failures`` in the results."""


@dataclass(frozen=True, slots=True)
class Payload:
    """A request body ready to send, serialized before the run starts."""

    body: bytes
    prompt_len: int
    output_len: int


@dataclass(slots=True, kw_only=True)
class RequestRecord:
    """What happened to one request. Times are seconds; offsets count from the run's start."""

    index: int
    request_id: str
    scheduled_s: float
    """When the arrival schedule said to send it."""
    start_s: float = 0.0
    """When it was sent (later than scheduled when it waited for a concurrency slot)."""
    end_s: float = 0.0
    """When it completed or failed."""
    ok: bool = False
    error: str | None = None
    """The failure reason (see `FAILURE_REASONS`); None when ok."""
    detail: str = ""
    status: int | None = None
    replica: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    text: str | None = None
    """The generated text, kept only when the server reported no usage (to count it)."""
    finish_reason: str | None = None
    """The last ``finish_reason`` the server gave: ``length``, ``stop``, or ``abort`` when
    the engine dropped the request (a stream that still ends with ``[DONE]``)."""


def build_body(
    endpoint: Endpoint,
    *,
    model: str,
    prompt: str,
    max_tokens: int,
    stream: bool,
    ignore_eos: bool,
    extra_body: dict[str, Any],
) -> bytes:
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        body |= {"messages": [{"role": "user", "content": prompt}],
                 "max_completion_tokens": max_tokens}
    else:
        body |= {"prompt": prompt, "max_tokens": max_tokens}
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    body |= extra_body
    return json.dumps(body).encode()


async def send(
    session: aiohttp.ClientSession,
    url: str,
    payload: Payload,
    record: RequestRecord,
    *,
    t0: float,
    stream: bool = True,
    headers: dict[str, str] | None = None,
) -> None:
    """Send ``payload`` and fill in ``record``; ``t0`` is the run's start (perf_counter)."""
    hdrs = {"content-type": "application/json", "x-request-id": record.request_id}
    if headers:
        hdrs |= headers
    record.prompt_tokens = payload.prompt_len
    st = time.perf_counter()
    record.start_s = st - t0
    try:
        async with session.post(url, data=payload.body, headers=hdrs) as resp:
            record.status = resp.status
            record.replica = resp.headers.get(REPLICA_HEADER)
            if resp.status != 200:
                _fail(record, f"http_{resp.status}", _error_message(await resp.read()))
            elif stream:
                await _read_stream(resp, record, st)
            else:
                await _read_whole(resp, record, st)
    except TimeoutError:
        _fail(record, "timeout", "no complete answer within the request timeout")
    except aiohttp.ClientConnectorError as exc:
        _fail(record, "connect_error", str(exc))
    except aiohttp.ServerDisconnectedError as exc:
        _fail(record, "disconnected", str(exc) or "server disconnected")
    except aiohttp.ClientPayloadError as exc:
        _fail(record, "incomplete_stream", str(exc))
    except aiohttp.ClientError as exc:
        _fail(record, "client_error", f"{type(exc).__name__}: {exc}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        _fail(record, "bad_response", f"{type(exc).__name__}: {exc}")
    except OSError as exc:
        _fail(record, "client_error", f"{type(exc).__name__}: {exc}")
    record.end_s = time.perf_counter() - t0


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord, st: float) -> None:
    first = True
    last = st
    done = False
    pieces: list[str] = []
    buffer = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments (": ping"), other SSE fields
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if choices := event.get("choices"):
                if first:
                    record.ttft_s = now - st
                    first = False
                else:
                    record.itl_s.append(now - last)
                last = now
                choice = choices[0]
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
                delta = choice.get("delta")
                pieces.append((delta.get("content") if delta else choice.get("text")) or "")
            elif usage := event.get("usage"):
                _take_usage(record, usage)
            elif "error" in event:
                _fail(record, "stream_error", _error_message(payload))
                return
    if buffer.strip() == b"data: [DONE]":
        done = True
    if first:
        _fail(record, "no_tokens", "the stream ended without a token")
    elif not done:
        _fail(record, "incomplete_stream", "the stream ended without data: [DONE]")
    else:
        record.ok = True
        record.latency_s = last - st
        if not record.usage_reported:
            record.output_tokens = len(pieces)
            record.text = "".join(pieces)


async def _read_whole(resp: aiohttp.ClientResponse, record: RequestRecord, st: float) -> None:
    raw = await resp.read()
    record.latency_s = time.perf_counter() - st
    body = json.loads(raw)
    if "error" in body or not body.get("choices"):
        _fail(record, "bad_response", _error_message(raw))
        return
    record.ok = True
    record.finish_reason = body["choices"][0].get("finish_reason")
    if usage := body.get("usage"):
        _take_usage(record, usage)
    else:
        choice = body["choices"][0]
        record.text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
        record.output_tokens = 1


def _take_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.usage_reported = True
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    if (prompt_tokens := usage.get("prompt_tokens")) is not None:
        record.prompt_tokens = int(prompt_tokens)


def _fail(record: RequestRecord, reason: str, detail: str) -> None:
    record.ok = False
    record.error = reason
    record.detail = detail[:300]


def _error_message(body: bytes) -> str:
    """The message of an OpenAI error envelope, else the start of the body."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace").strip()

