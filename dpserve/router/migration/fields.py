"""The request fields the router reads beyond `model` and `stream`, coerced as vLLM does.

A stream that may migrate (`dpserve.router.migration.replay`) is read by the router: whether
it can move (`n`, `echo`, penalties, logprobs, `seed` with `temperature`), how many
tokens its continuation may still generate (`max_tokens`, `max_completion_tokens`,
`min_tokens`), whether the client wants token ids. vLLM validates the same fields
with pydantic in lax mode, which takes `"3"` and `3.0` for an integer and `"true"`
for a boolean. A router that read only JSON integers would disagree with the engine
about the request it forwards: `"max_tokens": "3"` ran its continuation to the
engine's default instead of the 3 left, and `"n": "2"` passed the "can this migrate"
check as if it were one sequence.

So each field is coerced once, before routing, by pydantic with vLLM 0.32's own
declaration of it (`COMPLETION`, `CHAT`; tests/router/migration/test_fields.py checks them
against vLLM's request models), and written back into the parsed body: the router's
checks and the continuation read what the engine will. What vLLM would refuse is
refused here, with a 400 naming the field. Values already of the declared type (what
clients send) skip pydantic: the check costs a type test per field present.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

from dpserve.router.errors import RouterError

_INT64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]

COMPLETION: dict[str, Any] = {
    "echo": bool | None, "logprobs": int | None, "max_tokens": int | None, "n": int,
    "presence_penalty": float | None, "frequency_penalty": float | None,
    "seed": _INT64 | None, "temperature": float | None, "use_beam_search": bool,
    "min_tokens": int, "prompt_logprobs": int | None, "return_token_ids": bool | None,
}
"""vLLM 0.32's `CompletionRequest` declarations of the fields the router reads."""

CHAT: dict[str, Any] = {
    "echo": bool, "logprobs": bool | None,
    "top_logprobs": Annotated[int, BeforeValidator(lambda v: 0 if v is None else v)],
    "max_tokens": int | None, "max_completion_tokens": int | None, "n": int | None,
    "presence_penalty": float | None, "frequency_penalty": float | None,
    "seed": _INT64 | None, "temperature": float | None, "use_beam_search": bool,
    "min_tokens": int, "prompt_logprobs": int | None, "return_token_ids": bool | None,
}
"""vLLM 0.32's `ChatCompletionRequest` declarations of the fields the router reads."""

COMPLETION_MAX_TOKENS = 16
"""vLLM's `max_tokens` for a completion without one: it also reads a null as this."""

_FAST: dict[Any, tuple[type, ...]] = {int: (int,), bool: (bool,), float: (float,)}
"""Types a value may already have to be taken as it is, by the declared base type
(`None` is fine wherever the declaration allows it). An integer for a float is made
one here, as pydantic does (`2**53 + 1` is not a float)."""


@functools.cache
def _adapter(declared: Any) -> TypeAdapter[Any]:
    return TypeAdapter(declared)


@functools.cache
def _fast_types(declared: Any) -> tuple[tuple[type, ...], bool]:
    """(types taken as they are, whether None is allowed) of a declaration."""
    args = getattr(declared, "__args__", (declared,))
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), declared)
    base = getattr(base, "__origin__", base)  # Annotated[int, ...] -> int
    return _FAST.get(base, ()), optional


def coerce_fields(payload: dict[str, Any], *, chat: bool) -> None:
    """Coerce the fields `COMPLETION` or `CHAT` declare, where the request has them, as
    vLLM would, in place. RouterError 400 (naming the field) for a value vLLM refuses."""
    for name, declared in (CHAT if chat else COMPLETION).items():
        if name not in payload:
            continue
        value = payload[name]
        if value is None and name == "max_tokens" and not chat:
            payload[name] = COMPLETION_MAX_TOKENS  # vLLM's `normalize_null_max_tokens`
            continue
        exact, optional = _fast_types(declared)
        if value is None and optional:
            continue
        if type(value) in exact and (name != "seed" or -(2**63) <= value < 2**63):
            continue  # (`type`, not isinstance: True is not taken for an integer as is)
        if type(value) is int and exact == (float,) and -(2**53) <= value <= 2**53:
            payload[name] = float(value)  # exactly, in that range
            continue
        try:
            payload[name] = _adapter(declared).validate_python(value)
        except ValidationError as exc:
            reason = exc.errors()[0].get("msg", "invalid value")
            raise RouterError(400, f"'{name}': {reason}", param=name) from None
