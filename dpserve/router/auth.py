"""Who may call what, as pure ASGI middleware in front of every route.

- The public API needs one of the API keys, when any is configured, sent as
  `Authorization: Bearer KEY` (what the OpenAI SDK sends for its `api_key`).
- `/admin/*` needs the admin key; with no admin key configured it answers
  loopback clients only. The client is the connection's peer: proxy headers are
  believed only from configured proxies, and a router listening beyond loopback
  refuses to start without an admin key (`dpserve.config`), since a sidecar or a
  NAT in front makes remote clients look local.
- With a separate admin listener (`admin_port`), `/admin/*` exists only there,
  and the API listener answers 404 for it; the admin listener serves nothing else
  but the open probes.
- Probes and scrapes (`/health`, `/ready`, `/metrics`, `/metrics/engines`) stay open so
  orchestrators and Prometheus need no secret.

Keys are compared in constant time, against every accepted key (so timing does
not tell which key is closest), and never logged.
"""

from __future__ import annotations

import hmac
import ipaddress

from dpserve.router.asgi import Receive, Scope, Send
from dpserve.router.errors import error_body

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/metrics/engines"})
ADMIN_PREFIX = "/admin"


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_matches(headers: list[tuple[bytes, bytes]], keys: list[bytes]) -> bool:
    """True if the Authorization header carries one of `keys` (constant time per key)."""
    sent = next((v for n, v in headers if n == b"authorization"), None)
    if sent is None:
        return False
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(sent, b"Bearer " + key)
    return ok


class Authenticate:
    def __init__(self, app: object, *, api_keys: list[str] | None,
                 admin_key: str | None, admin_port: int | None = None) -> None:
        self._app = app
        self._api_keys = [k.encode() for k in api_keys or []]
        self._admin_keys = [admin_key.encode()] if admin_key else []
        self._admin_port = admin_port

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """Why this HTTP request may not go on (status, message), or None if it may."""
        path = scope["path"]
        if path in OPEN_PATHS:
            return None
        admin = is_admin_path(path)
        if self._admin_port is not None:
            on_admin_listener = (scope.get("server") or (None, None))[1] == self._admin_port
            if admin != on_admin_listener:
                return (404, f"no route {path}")
        if admin:
            if self._admin_keys:
                if not bearer_matches(scope["headers"], self._admin_keys):
                    return (401, "missing or invalid admin key "
                                 "(send Authorization: Bearer ADMIN_KEY)")
            elif not is_loopback((scope.get("client") or (None,))[0]):
                return (403, "/admin is open to loopback clients only "
                             "unless an admin key is configured")
            return None
        if self._api_keys and not bearer_matches(scope["headers"], self._api_keys):
            return (401, "missing or invalid API key (send Authorization: Bearer KEY)")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self._app(scope, receive, send)  # type: ignore[operator]
            return
        status, message = refusal
        body = error_body(status, message)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
