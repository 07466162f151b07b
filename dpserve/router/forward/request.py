"""Reading a forwarded request: its body, bounded, then what routing needs from it.

`read_body` takes the body from the ASGI server whole (it is parsed for routing
and kept for retries), within the size limit and the router-wide budget of
request bytes; a route without a body refuses one, so bytes the router does not
frame itself never reach a replica. `parse_request` (pure, no I/O) turns a JSON
body into what routing needs: the model it names (checked against the models
the replicas serve), whether it asks for a stream, and the affinity keys the
policy declared it needs. Everything else in the body is the replica's business
and is forwarded untouched, as bytes. Every refusal is a :class:`RouterError`
with the status and message the client gets, naming the field at fault.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dpserve.router.asgi import Receive, Scope
from dpserve.router.errors import RouterError
from dpserve.router.forward.budget import BodyHold
from dpserve.router.jsonbody import TOO_DEEP
from dpserve.router.routing.policies import RequestInfo
from dpserve.router.routing.policies.keys import prompt_prefix, session_id


class ClientGone(Exception):
    """The client disconnected; stop working on its request."""


async def read_body(scope: Scope, receive: Receive, hold: BodyHold, *, limit: int,
                    allowed: bool) -> bytes:
    """The request's whole body, held in `hold`. RouterError: 413 past `limit` (before
    reading when the length is declared), 503 when the budget is spent, 400 for a body
    where none is `allowed`. ClientGone if the client left."""
    declared: bytes | None = None
    chunked = False
    for name, value in scope["headers"]:
        if name == b"content-length":
            declared = value
        elif name == b"transfer-encoding":
            chunked = True
    if not allowed and (chunked or declared not in (None, b"0")):
        raise _no_body(scope)
    if declared is not None and declared.isdigit():
        if int(declared) > limit:
            raise _too_large(limit)
        if not hold.grow_to(int(declared)):  # refuse before reading, not after
            raise _budget_spent()
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        if not hold.grow_to(size):
            raise _budget_spent()
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if size and not allowed:
        raise _no_body(scope)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _no_body(scope: Scope) -> RouterError:
    return RouterError(400, f"{scope['method']} {scope['path']} takes no request body")


def _budget_spent() -> RouterError:
    return RouterError(503, "the router holds as many request bytes as it may "
                            "(max_inflight_body_bytes); retry shortly", retry_after_s=1)


def _too_large(limit: int) -> RouterError:
    return RouterError(413, f"request body is larger than the limit of {limit} bytes")


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    info: RequestInfo
    """What the policy may know of the request."""
    stream: bool
    """The client asked for a stream (`"stream": true`)."""
    payload: dict[str, Any]
    """The body as parsed."""


LISTED_MODELS = 8
"""Served names an unknown model's 404 lists at most (the rest: GET /v1/models)."""


def check_model(model: str | None, known_models: frozenset[str],
                listed: frozenset[str] | None = None) -> None:
    """RouterError 404 (OpenAI's words, then the names served: `listed`, else
    `known_models`) for a model no replica serves; `known_models` empty means not known
    yet: anything passes."""
    if model is None or not known_models or model in known_models:
        return
    names = sorted(known_models if listed is None else listed)
    served = ", ".join(f"`{n}`" for n in names[:LISTED_MODELS])
    if len(names) > LISTED_MODELS:
        served += f" and {len(names) - LISTED_MODELS} more (GET /v1/models)"
    shown = model if len(model) <= 200 else model[:200] + "..."
    raise RouterError(404, f"The model `{shown}` does not exist. Served here: {served}.",
                      param="model")


def refuse_prompt_logprobs(route: str, payload: dict[str, Any]) -> None:
    """RouterError 400 for a request asking for the prompt's log-probabilities
    (`prompt_logprobs`, or `echo` with `logprobs` / chat's `top_logprobs`, which vLLM
    turns into them), for engines with LoRA enabled: vLLM 0.32 fails the whole engine
    when such a request is batched with another (issue #16668; measured on the CPU
    build: three at once, or one beside generating requests), so one client could take
    every replica down in turn."""
    echoed = "top_logprobs" if route == "/v1/chat/completions" else "logprobs"
    if payload.get("prompt_logprobs") is not None:
        param = "prompt_logprobs"
    elif payload.get("echo") not in (None, False) and payload.get(echoed) is not None:
        param = "echo"
    else:
        return
    raise RouterError(400, "the prompt's log-probabilities (prompt_logprobs, or echo with "
                           f"{echoed}) are not served here: these engines run with LoRA "
                           "enabled, and vLLM fails the engine on such requests when they "
                           "are batched (vLLM issue #16668)", param=param)


def parse_request(
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    route: str,
    known_models: frozenset[str],
    keys: frozenset[str] = frozenset(),
    prefix_chars: int = 256,
) -> ParsedRequest:
    """Parse a JSON request body for routing; RouterError (400, 404) if it cannot be.

    `known_models` empty means not known yet (no replica reported): any model passes.
    `keys` holds the affinity keys the policy needs (`session_id`, `prefix`); others
    are not computed.
    """
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RouterError(400, TOO_DEEP) from None
    if not isinstance(payload, dict):
        raise RouterError(400, "request body must be a JSON object")
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise RouterError(400, "'model' must be a string", param="model")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise RouterError(400, "'stream' must be a boolean", param="stream")
    check_model(model, known_models)
    info = RequestInfo(
        route=route, model=model, size=len(body),
        session_id=session_id(headers, payload) if "session_id" in keys else None,
        prefix=prompt_prefix(payload, prefix_chars) if "prefix" in keys else None,
    )
    return ParsedRequest(info, stream is True, payload)
