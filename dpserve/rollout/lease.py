"""A deploy's hold on the shared deploy lock (`dpserve.rollout.lock`), from its taking to
its end.

It is renewed in the background from the moment it is taken: copying and checking a
large checkpoint, then the rollout itself, can outlast the lock's time to live. If
another router takes it over (this one could not renew it for `ttl_s`), `lost` says
why and the deploy stops at its next step. Without a lock (one router), every call is
a no-op and `lost` stays None.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Executor

from dpserve.rollout.lock import DeployLock, LockLost
from dpserve.rollout.progress import DeployProgress

log = logging.getLogger("dpserve.rollout")


class Lease:
    def __init__(self, lock: DeployLock | None, *, executor: Executor | None = None) -> None:
        """`executor`: where the lock's file I/O runs (a `Rollout`'s admin threads; None:
        the loop's default pool)."""
        self._lock = lock
        self._executor = executor
        self._renewing: asyncio.Task[None] | None = None
        self.lost: str | None = None
        """Why the lock was lost during the deploy, if it was."""

    async def take(self, deploy_id: str) -> None:
        """Take the lock for `deploy_id`; LockHeld if another deploy holds it."""
        if self._lock is not None:
            await self._run(self._lock.acquire, deploy_id)

    def keep(self, progress: DeployProgress) -> None:
        """Renew it until `end`; a loss or a failed renewal is an event of `progress`."""
        if self._lock is not None:
            self._renewing = asyncio.create_task(self._renew(self._lock, progress),
                                                 name="dpserve-deploy-lock")

    async def end(self) -> None:
        """Stop renewing and release it (a lock taken over is left alone:
        `DeployLock.release`)."""
        if self._renewing is not None:
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing
            self._renewing = None
        if self._lock is not None:
            try:
                await self._run(self._lock.release)
            except OSError as exc:
                log.warning("could not release the deploy lock %s: %s", self._lock.path, exc)

    async def _renew(self, lock: DeployLock, progress: DeployProgress) -> None:
        while True:
            await asyncio.sleep(lock.renew_every_s)
            try:
                await self._run(lock.renew)
            except LockLost as exc:
                self.lost = str(exc)
                progress.event(f"deploy lock lost: {exc}; aborting", level=logging.ERROR)
                return
            except OSError as exc:  # storage hiccup: the lock may still be ours, try again
                progress.event(f"deploy lock: could not renew: {exc}", level=logging.ERROR)

    async def _run(self, fn: Callable[..., None], *args: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
