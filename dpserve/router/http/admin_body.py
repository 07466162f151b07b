"""Reading a control-plane request body: small, a JSON object, finite numbers only.

`/admin` requests carry a few fields; their bodies are read with a cap (413 past
it, read piece by piece rather than whole), parsed without accepting `NaN` or
`Infinity` (Python's json does by default, and a non-finite timeout or delay
breaks whatever uses it, and the JSON answers that echo it), and refused in the
OpenAI envelope when too deep, malformed or not an object, or when a field is
unknown, so a typo is never silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from dpserve.router.errors import error_response

MAX_ADMIN_BODY_BYTES = 64 * 1024


async def read_json_object(request: Request, *, fields: Collection[str],
                           limit: int = MAX_ADMIN_BODY_BYTES) -> dict[str, Any] | Response:
    """The body as a dict holding only `fields` (an empty body is `{}`), or the error
    response to send."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return error_response(413, f"body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except _NonFinite as exc:
        return error_response(400, f"body holds {exc}, which is not a finite number")
    except (ValueError, UnicodeDecodeError):
        return error_response(400, "body is not valid JSON")
    except RecursionError:
        return error_response(400, "body is nested too deeply")
    if not isinstance(body, dict):
        return error_response(400, "body must be a JSON object")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        return error_response(400, f"unknown field {unknown[0]!r} (known: "
                                   f"{', '.join(sorted(fields))})", param=unknown[0])
    return body


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(name)
