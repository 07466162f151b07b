from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from dpserve.config import RouterConfig
from dpserve.prompt_tokens import open_named
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.http.app import Router
from dpserve.router.http.server import bind_socket, uvicorn_server
from tests.fakes import FakeReplica

RunningRouter = tuple[str, Router]


@contextlib.asynccontextmanager
async def running_router(urls: list[str], **settings: object) -> AsyncIterator[RunningRouter]:
    """The real router app on a real socket, in this test's event loop."""
    config = RouterConfig(**{"health_interval_s": 0.2, **settings})  # type: ignore[arg-type]
    pool = ReplicaPool([Replica(id=f"r{i}", url=u) for i, u in enumerate(urls)])
    async with serving(Router(pool, config, open_tokenizer=open_named)) as running:
        if running[1].kv is not None:  # its tokenizer loads in the background
            await asyncio.wait_for(running[1].kv.tokenizer_settled.wait(), 60)
        yield running


@contextlib.asynccontextmanager
async def serving(router: Router) -> AsyncIterator[RunningRouter]:
    """`router`'s app on a real loopback socket, in this test's event loop."""
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sockets = [sock]
    if router.config.admin_port is not None:
        sockets.append(bind_socket(router.config.admin_host, router.config.admin_port))
    # The server `dpserve serve` runs, front limits included.
    server = uvicorn_server(router, dataclasses.replace(router.config, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", router
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def fake_replicas() -> AsyncIterator[Callable[..., FakeReplica]]:
    """Factory of started FakeReplicas, all stopped after the test."""
    started: list[FakeReplica] = []

    async def make(name: str, **kw: object) -> FakeReplica:
        replica = await FakeReplica(name, **kw).start()  # type: ignore[arg-type]
        started.append(replica)
        return replica

    yield make  # type: ignore[misc]
    for r in started:
        await r.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model: DPSERVE_TEST_MODEL if set (make test builds it once), else
    built into a temporary directory."""
    from dpserve.tinymodel import build_tiny_model

    prebuilt = os.environ.get("DPSERVE_TEST_MODEL")
    target = Path(prebuilt) if prebuilt else tmp_path_factory.mktemp("model") / "tiny-llama"
    return build_tiny_model(target)
