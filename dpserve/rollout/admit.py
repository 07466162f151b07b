"""What a replica goes through after its health checks pass and before it (re-)enters
rotation: at start-up, after a restart, after an outage, after an admin undrain.

1. **A warm-up**: the deploy's canary (a short greedy completion with logprobs) sent to
   the engine itself. vLLM sets some paths up on their first use: on vLLM 0.32 CPU the
   first request with logprobs takes 20-27 s, and every request batched beside it
   waits as long. Paid here, no client waits for it, and a later deploy's canary on
   this engine takes milliseconds. It also proves the engine generates: one that
   answers `/health` but cannot produce a finite token is not admitted.
2. **The adapters it lacks** (`AdapterDeploys.admit`), when adapters are served.

A replica that fails a step stays out of rotation with the reason as its `last_error`;
the health loop tries again on a later round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from dpserve.httpclient import shared_or_new
from dpserve.rollout.converge import canary_model
from dpserve.rollout.engine_admin import EngineAdmin, EngineAdminError
from dpserve.rollout.progress import DEFAULT_CANARY_PROMPT
from dpserve.router.fleet.pool import Replica

log = logging.getLogger("dpserve.rollout")

Admit = Callable[[Replica], Awaitable[str | None]]


class Admission:
    """The router's `admit` step: warm-up, then `then` (the adapters), if given."""

    def __init__(self, *, then: Admit | None = None,
                 client: httpx.AsyncClient | None = None) -> None:
        """`client`: shared, closed by its owner (None: one per warm-up)."""
        self._then = then
        self._client = client

    async def __call__(self, replica: Replica) -> str | None:
        """Why `replica` cannot be admitted yet, or None."""
        problem = await self.warm_up(replica)
        if problem is not None:
            return problem
        return await self._then(replica) if self._then is not None else None

    async def warm_up(self, replica: Replica) -> str | None:
        t0 = time.monotonic()
        async with shared_or_new(self._client) as client:
            try:
                await EngineAdmin(client, replica.url).canary(canary_model(replica),
                                                              DEFAULT_CANARY_PROMPT)
            except EngineAdminError as exc:
                return f"warm-up request failed: {exc}"
        took = time.monotonic() - t0
        log.log(logging.INFO if took >= 1 else logging.DEBUG,
                "replica %s: warmed up in %.2f s before admission", replica.id, took)
        return None
