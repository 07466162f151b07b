"""A simulated replica passes the checks a real one must before the router admits it:
the warm-up (a deploy's canary) asks for logprobs and wants them finite and <= 0."""

from __future__ import annotations

import httpx

from dpserve.rollout.engine_admin import EngineAdmin
from dpserve.sim import Fleet
from tests.sim.conftest import FAST


async def test_a_simulated_replica_answers_the_canary_with_logprobs():
    async with Fleet(n=1, config=FAST) as fleet, httpx.AsyncClient() as client:
        result = await EngineAdmin(client, fleet.urls[0]).canary(FAST.model, "warm up")
    assert result.text and len(result.token_logprobs) >= 1
    assert all(lp <= 0 for lp in result.token_logprobs)
