"""A fleet of simulated replicas in one event loop.

    async with Fleet(n=8, config=SimConfig(max_num_seqs=64)) as fleet:
        run_router(fleet.urls)          # http://127.0.0.1:PORT, one per replica
        fleet.set_fault(3, Fault(mode="hang"))

Every replica binds 127.0.0.1 on its own port: free ones chosen by the OS, or
`base_port`, `base_port + 1`, ... Replica i seeds its jitter with
``config.seed + i``. A list of configs makes a mixed fleet (say, two GPU
generations); all must serve the same model name for a router to mix them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import TracebackType

from dpserve.config import ConfigError
from dpserve.sim.config import SimConfig, validate
from dpserve.sim.engine import Engine
from dpserve.sim.faults import Fault
from dpserve.sim.server import SimReplica


class Fleet:
    """Replicas started by `start()` (or `async with`) and all stopped by `stop()`."""

    def __init__(self, n: int | None = None, config: SimConfig | Sequence[SimConfig] | None = None,
                 *, base_port: int = 0, control: bool = False, first_index: int = 0) -> None:
        """`n` replicas of `config` (default `SimConfig()`), or one per config in a list.
        `control=True` adds the `/sim/fault` endpoint to each (see faults.py).
        `first_index` numbers the replicas from there (seeds, response ids), for a fleet
        split over processes."""
        if isinstance(config, Sequence):
            configs = list(config)
            if n is not None and n != len(configs):
                raise ConfigError(f"n: {n} replicas asked for with {len(configs)} configs")
        else:
            configs = [config or SimConfig()] * (1 if n is None else n)
        if not configs:
            raise ConfigError("n: a fleet needs at least one replica")
        if not 0 <= base_port <= 65535 - len(configs):
            raise ConfigError(f"base_port: must leave room for {len(configs)} ports, "
                              f"got {base_port}")
        for c in configs:
            validate(c)
        self.base_port = base_port
        self.replicas = [SimReplica(c, index=first_index + i, control=control)
                         for i, c in enumerate(configs)]
        self._started = False

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def engines(self) -> list[Engine]:
        """The engines, for reading their state and `stats` in a study."""
        return [r.engine for r in self.replicas]

    def __len__(self) -> int:
        return len(self.replicas)

    def __iter__(self) -> Iterator[SimReplica]:
        return iter(self.replicas)

    def __getitem__(self, i: int) -> SimReplica:
        return self.replicas[i]

    def set_fault(self, i: int, fault: Fault) -> None:
        """Make replica `i` misbehave from now on (see faults.py for the modes)."""
        self.replicas[i].fault = fault

    def clear_fault(self, i: int) -> None:
        self.replicas[i].fault = None

    def clear_faults(self) -> None:
        for r in self.replicas:
            r.fault = None

    async def start(self) -> Fleet:
        if self._started:
            raise RuntimeError("this fleet was started already")
        self._started = True
        try:
            for i, r in enumerate(self.replicas):
                await r.start(self.base_port + i if self.base_port else 0)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """Stop every replica, even if stopping one fails."""
        errors = []
        for r in self.replicas:
            try:
                await r.stop()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    async def __aenter__(self) -> Fleet:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()
