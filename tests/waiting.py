"""Waiting in a test for something to become true: poll it with a deadline.

One helper for every test (async and sync flavours with the same arguments), so a
timeout always reads the same way: "timed out after 10 s waiting for <what>".
Tests never sleep and hope; they wait for the state they need, or fail naming it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_for(condition: Callable[[], Any], what: str, *, within_s: float = 10.0,
                   every_s: float = 0.02) -> Any:
    """Until `condition()` (awaited if it returns an awaitable) is truthy; return it.
    AssertionError naming `what` after `within_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within_s:g} s waiting for {what}")
        await asyncio.sleep(every_s)


def wait_for_sync(condition: Callable[[], T], what: str, *, within_s: float = 10.0,
                  every_s: float = 0.2) -> T:
    """`wait_for` for tests that block (subprocesses, threads, sync clients)."""
    deadline = time.monotonic() + within_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s:g} s waiting for {what}")
        time.sleep(every_s)

