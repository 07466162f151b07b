"""Replica error answers in the OpenAI error envelope, so the OpenAI SDK can show them.

The SDK puts only `error.message` of an error body into the exception's text: for
any other shape a user reads `NotFoundError: Error code: 404` and nothing else.
vLLM answers its own errors in the envelope, but not all of them: a route its model
does not mount is FastAPI's `{"detail": "Not Found"}`, a framework's validation
error is `{"detail": [...]}`, and a proxy in front of a remote replica answers
plain text or HTML. So a replica's non-streamed error answer (status >= 400) is
relayed by these rules (:func:`relay_error`):

- a body already in the envelope (`{"error": {"message": "...", ...}}`) passes
  byte for byte;
- a 404 `{"detail": "Not Found"}` on a route the model's tasks decide is the
  route not mounted: vLLM 0.32 mounts `/v1/embeddings` only for a model with the
  `embed` task and the completion routes only for one with `generate`
  (`vllm.entrypoints.launchers.api_server.routers`), and its handlers' own 404s
  are in the envelope. That is the request's fault, answered 400 with a message
  naming the model and the route (:data:`NOT_MOUNTED`);
- anything else is wrapped, the replica's status kept, its message taken from
  `detail`, `error` or `message`, or from the text (an HTML page's title).

Bounded and total: only bodies up to :data:`MAX_PARSED_BYTES` are parsed (a larger
one is wrapped with its first bytes as text, unless it starts like an envelope),
a message holds at most :data:`MAX_MESSAGE_CHARS` characters, and no input makes
these functions raise. A compressed body (`content-encoding`) is passed unread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from dpserve.router.errors import error_body

MAX_PARSED_BYTES = 64 * 1024
"""Largest error body parsed as JSON. vLLM's own (validation errors included, which
it bounds) are far smaller; parsing a replica's 100 MB answer would stall the loop."""
MAX_MESSAGE_CHARS = 1024
"""Longest message the router writes; longer ones are cut and end with `...`."""
_MAX_TEXT_BYTES = 4096
"""Of a text or HTML body, the bytes read for its message."""
_MAX_DETAILS = 10
"""Of a validation error's list, the entries described."""

NOT_MOUNTED: dict[str, tuple[str, str]] = {
    "/v1/embeddings": ("an embedding model", "model_not_embedding"),
    "/v1/completions": ("a generative model", "model_not_generative"),
    "/v1/chat/completions": ("a generative model", "model_not_generative"),
}
"""Route -> (what a model must be to serve it, the error `code`)."""

_ENVELOPE_START = re.compile(rb'\s*\{\s*"error"\s*:\s*\{')


def relay_error(status: int, body: bytes, headers: list[tuple[bytes, bytes]], *,
                route: str, model: str | None, served: Iterable[str] = ()
                ) -> tuple[int, bytes]:
    """The status and body a client gets for a replica's error answer; `headers` (the
    response's, lower-case names) get `content-type: application/json` when the body
    is rewritten. `model`: the model the request named; without one, the replica's
    (`served`: the names it serves) is the one it answered for."""
    if any(name == b"content-encoding" and value.strip().lower() != b"identity"
           for name, value in headers):
        return status, body
    answer = openai_error(status, body, route=route, model=model or min(served, default=None))
    if answer is None:
        return status, body
    headers[:] = [(n, v) for n, v in headers if n != b"content-type"]
    headers.append((b"content-type", b"application/json"))
    return answer


def openai_error(status: int, body: bytes, *, route: str, model: str | None
                 ) -> tuple[int, bytes] | None:
    """A replica's error answer in the envelope: (status, body), or None when `body`
    is in the envelope already and passes unchanged."""
    if len(body) > MAX_PARSED_BYTES:
        if _ENVELOPE_START.match(body, 0, 64):
            return None
        return status, error_body(status, _bounded(_text_message(body) or _phrase(status)))
    try:
        parsed: Any = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return status, error_body(status, _bounded(_text_message(body) or _phrase(status)))
    if not isinstance(parsed, dict):
        return status, error_body(status, _bounded(_compact(parsed)) or _phrase(status))
    error = parsed.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return None
    if status == 404 and parsed == {"detail": "Not Found"} and route in NOT_MOUNTED:
        kind, code = NOT_MOUNTED[route]
        name = f"the served model {_bounded(model, 200)}" if model else "the served model"
        return 400, error_body(400, f"{name} is not {kind}: {route} is not served",
                               param="model", code=code)
    message, param = _json_message(parsed)
    return status, error_body(status, _bounded(message) or _phrase(status), param=param)


def _json_message(parsed: dict[Any, Any]) -> tuple[str, str | None]:
    """(message, param) of a JSON error body in another shape than the envelope."""
    for key in ("detail", "error", "message"):
        value = parsed.get(key)
        if isinstance(value, str) and value:
            return value, None
        if key == "detail" and isinstance(value, list) and value:
            return _validation_message(value)
        if isinstance(value, dict) and isinstance(value.get("message"), str):
            return value["message"], None
    return _compact(parsed), None


def _validation_message(details: list[Any]) -> tuple[str, str | None]:
    """FastAPI's `{"detail": [{"loc": [...], "msg": "..."}]}`: each entry as
    `body.field: msg`, and the first entry's field as `param`."""
    parts: list[str] = []
    param: str | None = None
    for entry in details[:_MAX_DETAILS]:
        if not isinstance(entry, dict):
            parts.append(_bounded(_compact(entry), 200))
            continue
        loc = entry.get("loc")
        where = ".".join(str(p)[:100] for p in loc[:10] if isinstance(p, str | int)) if (
            isinstance(loc, list)) else ""
        msg = entry.get("msg")
        text = msg[:500] if isinstance(msg, str) else _bounded(_compact(entry), 200)
        parts.append(f"{where}: {text}" if where else text)
        if param is None and where:
            param = where.removeprefix("body.") if where != "body" else None
    if len(details) > _MAX_DETAILS:
        parts.append(f"and {len(details) - _MAX_DETAILS} more")
    return "; ".join(parts), param


def _text_message(body: bytes) -> str:
    """A text or HTML body's message: the page's title, else its text without tags."""
    text = body[:_MAX_TEXT_BYTES].decode("utf-8", "replace")
    lower = text.lower()
    start = lower.find("<title>")
    if start >= 0:
        end = lower.find("</title>", start)
        if end > start:
            text = text[start + len("<title>"):end]
    if "<" in text:
        text = _strip_tags(text)
    return " ".join(text.split())


def _strip_tags(text: str) -> str:
    """`text` without `<...>` tags; linear (a regex scan of `<<<<...` would not be)."""
    out: list[str] = []
    inside = False
    for ch in text:
        if ch == "<":
            inside = True
        elif ch == ">" and inside:
            inside = False
            out.append(" ")
        elif not inside:
            out.append(ch)
    return "".join(out)


def _compact(value: object) -> str:
    """Any parsed JSON value as short JSON text (bounded before it is written out)."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (ValueError, RecursionError):  # nested past Python's limit
        return ""
    return text[:MAX_MESSAGE_CHARS + 1]


def _bounded(text: str | None, limit: int = MAX_MESSAGE_CHARS) -> str:
    if not text:
        return ""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"the replica answered {status}"
