"""A fleet of simulated replicas in one event loop.

    async with Fleet(n=8, config=SimConfig(max_num_seqs=64)) as fleet:
        run_router(fleet.urls)          # http://127.0.0.1:PORT, one per replica
        fleet.set_fault(3, Fault(mode="hang"))

Every replica binds 127.0.0.1 on its own port: free ones chosen by the OS, or
`base_port`, `base_port + 1`, ... Replica i seeds its jitter with
``config.seed + i``. A list of configs makes a mixed fleet (say, two GPU
generations); all must serve the same model name for a router to mix them.

With `config.kv_events`, replica i also binds its KV-event PUB socket to port
``P + 2i`` and its replay socket to ``P + 2i + 1``, where P is `kv_events_port`,
or, when only `base_port` is given, the port after the last HTTP one
(``base_port + n``); with neither, the OS picks them all. Asked-for ports are
bound before any the OS picks, so a picked port never takes one promised to a
later replica. `fleet.kv_event_endpoints` lists the PUB endpoints; every
replica also serves them at `GET /kv_event_sources`, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import TracebackType

import zmq.asyncio

from dpserve.config import ConfigError
from dpserve.sim.config import SimConfig, validate
from dpserve.sim.engine import Engine
from dpserve.sim.faults import Fault
from dpserve.sim.server import SimReplica


class Fleet:
    """Replicas started by `start()` (or `async with`) and all stopped by `stop()`."""

    def __init__(self, n: int | None = None, config: SimConfig | Sequence[SimConfig] | None = None,
                 *, base_port: int = 0, kv_events_port: int = 0, control: bool = False,
                 first_index: int = 0) -> None:
        """`n` replicas of `config` (default `SimConfig()`), or one per config in a list.
        `kv_events_port`: see the module docstring. `control=True` adds the
        `/sim/fault` endpoint to each (see faults.py). `first_index` numbers the
        replicas from there (seeds, response ids), for a fleet split over processes."""
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
        self.kv_events_port = _kv_events_port(base_port, kv_events_port, len(configs),
                                              any(c.kv_events for c in configs))
        """The first KV-event port asked for (derived from `base_port` if not given); 0:
        the OS picks them."""
        self._zmq: zmq.asyncio.Context | None = None
        self.replicas = [SimReplica(c, index=first_index + i, control=control)
                         for i, c in enumerate(configs)]
        self._started = False

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def kv_event_endpoints(self) -> list[str | None]:
        """Each replica's PUB endpoint (``tcp://127.0.0.1:PORT``), None for a replica
        without `kv_events`; once started."""
        return [r.kv_events.endpoint if r.kv_events else None for r in self.replicas]

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
            if any(r.kv_events for r in self.replicas):
                self._zmq = zmq.asyncio.Context()
            for i, r in enumerate(self.replicas):
                if r.kv_events is not None and self._zmq is not None:
                    port = self.kv_events_port + 2 * i if self.kv_events_port else 0
                    r.kv_events.bind(port, self._zmq)
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
        if self._zmq is not None:  # its sockets are closed: this does not wait
            self._zmq.term()
            self._zmq = None
        if errors:
            raise errors[0]

    async def __aenter__(self) -> Fleet:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()


def _kv_events_port(base_port: int, kv_events_port: int, n: int, publishing: bool) -> int:
    """The first of the 2n event ports (0: the OS picks), checked to fit and to stay clear
    of the HTTP ports."""
    if not 0 <= kv_events_port <= 65535 - 2 * n:
        raise ConfigError(f"kv_events_port: must leave room for {2 * n} ports, "
                          f"got {kv_events_port}")
    if not publishing or not base_port:
        return kv_events_port
    if not kv_events_port:
        if base_port + n > 65535 - 2 * n:
            raise ConfigError(f"base_port: must leave room for {3 * n} ports (HTTP, then "
                              f"KV events) unless kv_events_port is set, got {base_port}")
        return base_port + n
    if kv_events_port < base_port + n and base_port < kv_events_port + 2 * n:
        raise ConfigError(f"kv_events_port: ports {kv_events_port}-{kv_events_port + 2 * n - 1}"
                          f" overlap the HTTP ports {base_port}-{base_port + n - 1}")
    return kv_events_port
