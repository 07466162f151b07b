"""The request that carries a broken stream on: a completion of the ids so far.

A continuation is asked of another replica with the prompt's ids and every id the
client has (`StreamState`), `max_tokens`/`min_tokens` reduced by what was generated, and
every sampling parameter that means the same on a completion of ids carried over
(`_CARRIED`). Its body, like any client JSON the router writes again, is encoded with a
guard (`dpserve.router.jsonbody`): parsing bounded the depth, writing runs deeper.
"""

from __future__ import annotations

from typing import Any

from dpserve.router.errors import RouterError
from dpserve.router.jsonbody import TOO_DEEP, encode
from dpserve.router.migration.eligibility import CARRIED, FIELDS
from dpserve.router.migration.fields import COMPLETION_MAX_TOKENS
from dpserve.router.migration.replay import StreamState

_CARRIED = tuple(name for name, place in FIELDS.items() if place == CARRIED)
"""Request fields that mean the same on the continuation (a completion of ids); the
place of every other field is `eligibility.FIELDS`."""


def continuation(state: StreamState) -> dict[str, Any] | None:
    """The completion request that goes on where `state` stopped; None if nothing
    is left to generate (the limit was reached exactly at the seam)."""
    body = state.body
    out: dict[str, Any] = {"model": body.get("model"),
                           "prompt": [*(state.prompt_ids or ()), *state.ids],
                           "stream": True, "return_token_ids": True}
    for key in _CARRIED:
        if key in body:
            out[key] = body[key]
    if state.stops:  # its text unheld, for the router's own check (`stops`)
        out |= {"stop": state.stops, "include_stop_str_in_output": True}
    limit = limit_of(body, chat=state.chat)
    if limit is None:
        # A chat without a limit runs to the context length. A completion has no way to
        # say so (without the field, or with null, it stops at 16): the migrator sets
        # what the target's context length leaves (vLLM 0.32 would clamp its context
        # length to that; earlier versions refused a limit past the context).
        out["max_tokens"] = None
    else:
        if limit - len(state.ids) <= 0:
            return None
        out["max_tokens"] = limit - len(state.ids)
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - len(state.ids))
    return out


def limit_of(body: dict[str, Any], *, chat: bool) -> int | None:
    """The most tokens a request may generate as vLLM reads it (its fields coerced,
    `dpserve.router.migration.fields`); None: no limit but the context length. A chat's
    `max_completion_tokens` wins over its `max_tokens`; a completion without
    `max_tokens`, or with null, gets vLLM's default."""
    limit: int | None
    if chat:
        limit = body.get("max_completion_tokens")
        return limit if limit is not None else body.get("max_tokens")
    limit = body.get("max_tokens")  # null too: vLLM reads it as its default
    return COMPLETION_MAX_TOKENS if limit is None else limit


def upstream_body(body: dict[str, Any], raw: bytes) -> bytes:
    """The request as forwarded while migration may be needed: with token ids. `raw`
    is `body` as received (a JSON object with fields): the field goes in front of
    its first, unless the client set it (then it is written again)."""
    start = raw.find(b"{")
    if "return_token_ids" in body or start < 0:
        encoded = encode(body | {"return_token_ids": True})
        if encoded is None:
            raise RouterError(400, TOO_DEEP)
        return encoded
    return raw[:start + 1] + b'"return_token_ids":true,' + raw[start + 1:]
