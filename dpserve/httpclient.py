"""Control-plane HTTP clients built off the event loop.

Building an `httpx.AsyncClient` loads the CA bundle into a new TLS context: 25-50 ms
on an idle core here, past half a second on a busy one. On the router's event loop
that is time no request is proxied and no stream moves, so a client built while the
router serves (a deploy, a federated scrape) is built in a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx


async def open_client(factory: Callable[[], httpx.AsyncClient] = httpx.AsyncClient
                      ) -> httpx.AsyncClient:
    """`factory()`, run in a worker thread; the caller closes the client."""
    return await asyncio.to_thread(factory)
