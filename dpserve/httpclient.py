"""Control-plane HTTP clients built off the event loop, or once.

Building an `httpx.AsyncClient` loads the CA bundle into a new TLS context: 25-50 ms
on an idle core here, with the event loop held up to ~45 ms of it (the GIL), and
0.1-2.3 s measured in a router under load on 2 busy cores. On the router's event
loop that is time no request is proxied and no stream moves. So the deploy side
(deploys, warm-ups, adapter loads) shares one client built before the router
serves (`control_client`), and a client built while the router serves (a federated
scrape) is built in a worker thread (`open_client`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import httpx

KEEPALIVE_S = 2.0
"""Idle connections to engines are dropped after this long: under the 5 s after which
vLLM's server closes them, so a request never goes out on one the engine is closing."""


def control_client() -> httpx.AsyncClient:
    """The deploy side's client to the engines; build it before serving, close it last."""
    return httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))


@contextlib.asynccontextmanager
async def shared_or_new(client: httpx.AsyncClient | None) -> AsyncIterator[httpx.AsyncClient]:
    """`client` when one is shared (its owner closes it), else a new one, built off the
    event loop and closed on leaving."""
    if client is not None:
        yield client
        return
    async with await open_client() as new:
        yield new


async def open_client(factory: Callable[[], httpx.AsyncClient] = httpx.AsyncClient
                      ) -> httpx.AsyncClient:
    """`factory()`, run in a worker thread; the caller closes the client."""
    return await asyncio.to_thread(factory)
