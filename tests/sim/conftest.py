"""Helpers for the simulator's tests: fast engine settings, a running engine, a
fleet that is always stopped, and Prometheus text read the way Prometheus reads it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from dpserve.sim import Engine, SimConfig

FAST = SimConfig(step_base_s=0.004, prefill_per_token_s=0.00002, decode_per_seq_s=0.0001,
                 max_model_len=4096, kv_cache_tokens=65536)
"""Steps of a few milliseconds, so timing tests stay short."""

TOLERANCE_S = 0.004
"""How far a measured time may trail the modelled one (event-loop wake-up latency)."""


@contextlib.asynccontextmanager
async def running_engine(config: SimConfig = FAST, **kwargs: Any) -> AsyncIterator[Engine]:
    """An engine stepping in a task of its own; `kwargs` go to `Engine`."""
    engine = Engine(config, **kwargs)
    task = asyncio.create_task(engine.run())
    try:
        yield engine
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def scrape(url: str) -> dict[str, float]:
    """`/metrics` of a replica as {sample name{sorted labels minus model/engine}: value}."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                                 + "}" if labels else "")
            samples[key] = sample.value
    return samples
