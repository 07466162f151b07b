"""How late the router's event loop runs what is ready: `dpserve_event_loop_lag_seconds`.

Everything a router does for a request (reading it, choosing a replica, relaying each
chunk of the answer) is a callback on one event loop per process. A callback that
holds the loop (a long decode, a garbage collection, a tokenizer holding the GIL), or
a process waiting for a core, delays every other request's next step by as long. The
watch sleeps `INTERVAL_S` and records by how much each wake-up came late: that is what
a chunk ready at the same moment would have waited, whichever of the two caused it.
Summed over a router's workers like the other data-plane series.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

INTERVAL_S = 0.05
"""How often the loop is sampled: 20 samples a second, each one a timer callback."""
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Dense below 10 ms, where a healthy loop sits (the target is a longest stall under
5 ms); the rest shows how bad a bad one was."""


async def watch_loop(observe: Callable[[float], None], *,
                     interval_s: float = INTERVAL_S) -> None:
    """Observe the loop's lag every `interval_s`, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - due))
