"""Fixtures for the load-test harness: the tiny model's tokenizer, and the scripted
fake server (`loadtest.fakes.FakeOpenAIServer`) either in the test's own event loop
or, for the CLI (which runs its own loop), in a thread of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from loadtest.datasets import Tokenizer, load_tokenizer
from loadtest.fakes import FakeOpenAIServer, Script


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return load_tokenizer(tokenizer_dir)


@pytest.fixture
async def fake_server() -> AsyncIterator[Callable[..., FakeOpenAIServer]]:
    """Factory of started fake servers in this test's event loop, stopped after it."""
    started: list[FakeOpenAIServer] = []

    async def start(script: Script | None = None, **kw: object) -> FakeOpenAIServer:
        server = await FakeOpenAIServer(script, **kw).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start  # type: ignore[misc]
    for server in started:
        await server.stop()


class ThreadedFakeServer:
    """A fake server on its own event loop in a daemon thread, for code that runs
    its own loop (the CLI)."""

    def __init__(self, script: Script, **kw: object) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server = self._call(FakeOpenAIServer(script, **kw).start())  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        return self.server.url

    def _call(self, coro):  # type: ignore[no-untyped-def]
        future: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout=10)

    def stop(self) -> None:
        self._call(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def threaded_server() -> Iterator[Callable[..., ThreadedFakeServer]]:
    started: list[ThreadedFakeServer] = []

    def start(script: Script | None = None, **kw: object) -> ThreadedFakeServer:
        server = ThreadedFakeServer(script or Script(), **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
