"""Who may call what, as pure ASGI middleware in front of every route.

- The public API needs one of the API keys, when any is configured, sent as
  `Authorization: Bearer KEY` (what the OpenAI SDK sends for its `api_key`).
- `/admin/*` needs the admin key; with no admin key configured it answers local
  clients only: 127.0.0.1 and ::1 (`local_admin_addresses`), not all of loopback, since
  a proxy on this machine relays remote clients from other loopback addresses (Istio's
  sidecar from 127.0.0.6). The client is the connection's peer: proxy headers are
  believed only from configured proxies, and a router with any, or listening beyond
  loopback, refuses to start without an admin key (`dpserve.config`), since a sidecar
  or a NAT in front makes remote clients look local.
- With a separate admin listener (`admin_port`), `/admin/*` exists only there,
  and the API listener answers 404 for it; the admin listener serves nothing else
  but the open probes.
- Probes and scrapes (`/health`, `/ready`, `/metrics`, `/metrics/engines`) stay open so
  orchestrators and Prometheus need no secret; `--engine-metrics-need-key` puts
  `/metrics/engines` (every engine's load and queue) behind an API key or the admin key.

Keys are compared in constant time, against every accepted key (so timing does
not tell which key is closest), and never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from typing import Any

from dpserve.config import RouterConfig
from dpserve.router.asgi import Receive, Scope, Send
from dpserve.router.errors import error_body

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ENGINE_METRICS = "/metrics/engines"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", ENGINE_METRICS})
"""Probes and scrapes: open (`/metrics/engines` behind a key when so configured)."""
ADMIN_PREFIX = "/admin"


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def networks(addresses: Iterable[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(a, strict=False) for a in addresses)


def is_local(host: str | None, local: tuple[Network, ...]) -> bool:
    """Whether a client's address is one of `local` (an IPv4 client seen by an IPv6
    listener, `::ffff:127.0.0.1`, is its IPv4 address); decided by address, not name."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in network for network in local)


def bearer_matches(headers: list[tuple[bytes, bytes]], keys: list[bytes]) -> bool:
    """True if the Authorization header carries one of `keys` (constant time per key)."""
    sent = next((v for n, v in headers if n == b"authorization"), None)
    if sent is None:
        return False
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(sent, b"Bearer " + key)
    return ok


def auth_options(config: RouterConfig) -> dict[str, Any]:
    """`Authenticate`'s settings from `config`: one place, so that every front (the
    app's, the data plane's, each worker's) refuses alike."""
    return {"api_keys": config.api_keys, "admin_key": config.admin_key,
            "admin_port": config.admin_port,
            "local": networks(config.local_admin_addresses),
            "keyed_engine_metrics": config.engine_metrics_need_key}


def authenticate(app: object, config: RouterConfig) -> Authenticate:
    """`app` behind the checks `config` asks for."""
    return Authenticate(app, **auth_options(config))


class Authenticate:
    def __init__(self, app: object, *, api_keys: list[str] | None,
                 admin_key: str | None, admin_port: int | None = None,
                 local: tuple[Network, ...] | None = None,
                 keyed_engine_metrics: bool = False) -> None:
        """`local`: the client addresses `/admin` trusts without an admin key (default
        127.0.0.1 and ::1). `keyed_engine_metrics`: `/metrics/engines` needs an API key
        or the admin key."""
        self._app = app
        self._api_keys = [k.encode() for k in api_keys or []]
        self._admin_keys = [admin_key.encode()] if admin_key else []
        self._admin_port = admin_port
        self._local = local if local is not None else networks(("127.0.0.1", "::1"))
        self._keyed_engine_metrics = keyed_engine_metrics

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """Why this HTTP request may not go on (status, message), or None if it may."""
        path = scope["path"]
        if path in OPEN_PATHS:
            if path == ENGINE_METRICS and self._keyed_engine_metrics and not bearer_matches(
                    scope["headers"], self._api_keys + self._admin_keys):
                return (401, f"{ENGINE_METRICS} needs a key (send Authorization: Bearer "
                             "KEY, an API key or the admin key)")
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
            elif not is_local((scope.get("client") or (None,))[0], self._local):
                return (403, "/admin is open to local clients only "
                             "(--local-admin-addresses) unless an admin key is configured")
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
