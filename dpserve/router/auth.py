"""API-key check for the router's public API, as pure ASGI middleware.

Clients send `Authorization: Bearer KEY` (what the OpenAI SDK sends for its
`api_key`). Probes and scrapes (`/health`, `/ready`, `/metrics`) stay open so
orchestrators and Prometheus need no secret. The key is compared in constant
time and never logged.
"""

from __future__ import annotations

import hmac

from dpserve.router.errors import error_body
from dpserve.router.proxy import Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class RequireApiKey:
    def __init__(self, app: object, *, api_key: str) -> None:
        self._app = app
        self._expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            await self._app(scope, receive, send)  # type: ignore[operator]
            return
        body = error_body(401, "missing or invalid API key (send Authorization: Bearer KEY)")
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False
