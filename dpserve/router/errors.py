"""The one error envelope the router answers with.

Everything the router itself rejects or fails is answered in OpenAI's shape,
the same one vLLM uses, so a client sees a single error format whether a
request failed in the router or in a replica (a replica's error in another shape
is put into it: `dpserve.router.forward.upstream_errors`)::

    {"error": {"message": "...", "type": "NotFoundError", "param": "model", "code": 404}}

`code` is the HTTP status, or a string naming the error where one is more precise
(`model_not_embedding`), as OpenAI's own codes are.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from starlette.responses import Response


class RouterError(Exception):
    """An error the router answers itself, with its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        """Seconds for a `Retry-After` header (overload, no replica), if any."""


def error_type(status: int) -> str:
    """`404` -> `NotFoundError`, as vLLM names its error types."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return "".join(word[:1].upper() + word[1:] for word in phrase.replace("-", " ").split()) + (
        "Error" if not phrase.endswith("Error") else ""
    )


def error_body(status: int, message: str, *, param: str | None = None,
               code: int | str | None = None) -> bytes:
    payload: dict[str, Any] = {
        "error": {"message": message, "type": error_type(status), "param": param,
                  "code": status if code is None else code}
    }
    return json.dumps(payload).encode()


def error_response(
    status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        error_body(status, message, param=param),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def sse_error_event(status: int, message: str) -> bytes:
    """The last event of a stream that broke after it started, then `[DONE]`."""
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"
