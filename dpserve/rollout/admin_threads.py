"""The rollout's own threads for its blocking file work.

A deploy reads an eval set, copies and hashes an adapter, takes and renews the deploy
lock on shared storage and prunes old snapshots: file I/O that can block for as long
as the storage (or a FIFO named by an admin request) makes it. Run on the event loop's
default pool, six such reads filled it, and the data plane (which builds clients there)
and `/metrics` (which merges there) stopped with them. On threads of their own, a read
stuck on storage costs the admin API a thread, never a request.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

ADMIN_THREADS = 2
"""Two: a deploy's lock renewal goes on beside one slow read."""

P = ParamSpec("P")
T = TypeVar("T")


class AdminThreads:
    """A small thread pool owned by one rollout; `close` does not wait for its threads
    (one stuck on storage would hold up the router's shutdown)."""

    def __init__(self, threads: int = ADMIN_THREADS) -> None:
        self.executor: Executor = ThreadPoolExecutor(threads, thread_name_prefix="dpserve-admin")
        """For callers that take an executor (the lock's lease, the deployed link)."""

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on these threads."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
