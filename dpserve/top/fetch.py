"""One refresh of `dpserve top`: three GETs to the router, and what to say when they fail.

`GET /admin/replicas` (needs the admin key, or a loopback client when the router has
none) is what the view cannot do without: when it fails the refresh has no
snapshot, only a message a person can act on (the router is down; it wants a key;
this is not a dpserve router). `/metrics` and `/metrics/engines` are open; when one
fails, the rows are shown without its figures and a message says why.

The client is the caller's (`async with RouterReader(...)`); every refresh reuses it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from dpserve.top.scrape import ScrapeError, parse_replicas, parse_routing
from dpserve.top.window import Snapshot

KEY_HINT = "give it with --admin-key-file FILE or DPSERVE_ADMIN_KEY"


@dataclass(frozen=True, slots=True)
class Refresh:
    """What one refresh got: a snapshot (None when the replica list failed) and the
    messages to show."""

    snapshot: Snapshot | None
    problems: tuple[str, ...] = ()


class RouterReader:
    """Reads the router at `url` (its API listener; `/admin` and `/metrics` must both be
    served there)."""

    def __init__(self, url: str, admin_key: str | None, *, timeout_s: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url.rstrip("/")
        self._has_key = admin_key is not None
        headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers,
                                       timeout=timeout_s, transport=transport)
        self._clock = clock

    async def __aenter__(self) -> RouterReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def read(self) -> Refresh:
        admin, router, engines = await asyncio.gather(
            self._get("/admin/replicas"), self._get("/metrics"),
            self._get("/metrics/engines"))
        at = self._clock()
        if isinstance(admin, Exception):
            return Refresh(None, (self._unreachable(admin),))
        replicas = self._replicas(admin)
        if isinstance(replicas, str):
            return Refresh(None, (replicas,))
        problems = []
        texts: list[str | None] = []
        for path, resp in (("/metrics", router), ("/metrics/engines", engines)):
            if isinstance(resp, Exception):
                problems.append(f"{path}: {type(resp).__name__} {resp}".rstrip())
                texts.append(None)
            elif resp.status_code != 200:
                problems.append(f"{path}: HTTP {resp.status_code}; its figures are not shown")
                texts.append(None)
            else:
                texts.append(resp.text)
        try:
            samples = parse_replicas(texts[0], texts[1])
            routing = parse_routing(texts[0])
        except ScrapeError as exc:
            problems.append(str(exc))
            samples, routing = {}, None
        return Refresh(Snapshot(at, replicas, samples, routing), tuple(problems))

    async def _get(self, path: str) -> httpx.Response | Exception:
        try:
            return await self._http.get(path)
        except httpx.HTTPError as exc:
            return exc

    def _unreachable(self, exc: Exception) -> str:
        return (f"cannot reach the router at {self.url}: {type(exc).__name__} {exc}".rstrip()
                + " (is `dpserve serve` running there? --router or DPSERVE_ROUTER_URL "
                  "name another)")

    def _replicas(self, resp: httpx.Response) -> tuple[dict[str, Any], ...] | str:
        """The replica list, or the message saying why there is none."""
        try:
            body = resp.json()
        except ValueError:
            body = None
        message = _error_message(body) or resp.text[:200].strip()
        if resp.status_code == 401:
            return (f"the router refused the admin key (HTTP 401: {message}); "
                    + ("check the key given" if self._has_key else KEY_HINT))
        if resp.status_code == 403:
            return (f"the router refused /admin (HTTP 403: {message}); run `dpserve top` "
                    f"on the router's host, or configure an admin key and {KEY_HINT}")
        if resp.status_code == 404:
            return (f"no /admin/replicas at {self.url} (HTTP 404): not a dpserve router, "
                    "or its admin API is on a separate --admin-port")
        if resp.status_code != 200:
            return f"GET /admin/replicas: HTTP {resp.status_code}: {message}"
        replicas = body.get("replicas") if isinstance(body, dict) else None
        if not isinstance(replicas, list) or not all(isinstance(r, dict) for r in replicas):
            return f"{self.url}/admin/replicas did not answer a dpserve replica list"
        return tuple(replicas)


def _error_message(body: Any) -> str | None:
    """The message of the router's OpenAI-shaped error envelope, if that is the body."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
        return str(message) if message else None
    return None
