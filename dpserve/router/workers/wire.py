"""What leader and followers send each other: JSON lines over a local socket pair.

Leader to follower: `config` (once, first: the RouterConfig, keys included, which is
why it goes over the socket pair and never through argv or the environment),
`table` (the replica table, see `replica_row`; with peers, what they said),
`evict` (move a drained replica's streams), `reply` (the answer to a relayed request),
`learn` and `prompts` (what other workers and the peers placed), `stop`.
Follower to leader: `report` (acknowledges a table; own in-flight counts and the
rest), `http` (a request for the leader to answer), `learn` and `prompts` (what it
placed).

The socket pair is private to the two processes; nothing on it is parsed from a
client but the relayed request, which the leader's own app then checks as it
checks every request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from typing import Any

from dpserve.config import RouterConfig
from dpserve.router.fleet.adapters import Adapters, AdapterVersion
from dpserve.router.fleet.engine_metrics import EngineLoad
from dpserve.router.fleet.pool import Replica, ReplicaState

MAX_LINE_BYTES = 64 * 1024 * 1024
"""Largest message: a relayed `/metrics/engines` answer for a large fleet fits."""

Message = dict[str, Any]


class Channel:
    """One end of the socket pair, one JSON object per line."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_LINE_BYTES)
        return cls(reader, writer)

    def send(self, message: Message) -> None:
        """Queue `message` (the transport writes it; `drain` waits for that)."""
        if not self._writer.is_closing():
            self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    async def drain(self) -> None:
        await self._writer.drain()

    async def recv(self) -> Message | None:
        """The next message; None when the other end closed (or sent garbage)."""
        try:
            line = await self._reader.readline()
        except (ConnectionError, ValueError):  # ValueError: a line past the limit
            return None
        if not line.endswith(b"\n"):
            return None
        message = json.loads(line)
        return message if isinstance(message, dict) else None

    def close(self) -> None:
        self._writer.close()


def config_message(config: RouterConfig) -> Message:
    return {"op": "config", "config": dataclasses.asdict(config)}


def config_from(message: Message) -> RouterConfig:
    return RouterConfig(**message["config"])


def replica_row(replica: Replica, elsewhere: int, slot: int | None) -> Message:
    """What a follower routes by; `elsewhere`: requests on it in other workers, `slot`:
    its cell in the shared work table (`work_table`)."""
    engine = replica.engine
    return {
        "id": replica.id, "url": replica.url, "device": replica.device, "slot": slot,
        "state": replica.state.value, "version": replica.weight_version,
        "models": sorted(replica.models), "max_model_len": replica.max_model_len,
        "avoid": replica.avoid,
        "ready_once": replica.has_been_ready, "elsewhere": elsewhere,
        "engine": None if engine is None else _engine_row(engine),
        "scraped_at": replica.engine_scraped_at,
        "at_scrape": replica.engine_in_flight_at_scrape,
        "peers": replica.peer_in_flight,
        "peers_at_scrape": replica.engine_peer_in_flight_at_scrape,
    }


def new_replica(row: Message) -> Replica:
    return Replica(id=row["id"], url=row["url"], device=row["device"])


def apply_row(replica: Replica, row: Message) -> ReplicaState:
    """Copy a row into `replica`, all but its state (returned, for the pool to set, so
    its listeners hear it) and in-flight count (the caller's, as a difference)."""
    replica.weight_version = row["version"]
    models = frozenset(row["models"])
    if models != replica.models:
        replica.models = models
    replica.max_model_len = row["max_model_len"]
    replica.avoid = row["avoid"]
    replica.has_been_ready = row["ready_once"]
    engine = row["engine"]
    replica.engine = None if engine is None else _engine_from(engine)
    replica.engine_scraped_at = row["scraped_at"]
    replica.engine_in_flight_at_scrape = row["at_scrape"]
    replica.peer_in_flight = row["peers"]
    replica.engine_peer_in_flight_at_scrape = row["peers_at_scrape"]
    return ReplicaState(row["state"])


def _engine_row(load: EngineLoad) -> Message:
    row = dataclasses.asdict(load)
    for name in ("lora_running", "lora_waiting"):
        if row[name] is not None:
            row[name] = sorted(row[name])
    return row


def _engine_from(row: Message) -> EngineLoad:
    values = dict(row)
    for name in ("lora_running", "lora_waiting"):
        if values.get(name) is not None:
            values[name] = frozenset(values[name])
    return EngineLoad(**values)


def adapter_table(adapters: Adapters) -> Message:
    return {
        "versions": [{"name": v.name, "version": v.version, "path": v.path, "rank": v.rank,
                      "serving": v.serving, "retiring": v.retiring,
                      "replicas": sorted(v.replicas)} for v in adapters.versions()],
        "current": {name: version.engine_name for name in adapters.names()
                    if (version := adapters.current(name)) is not None},
        "names": sorted(adapters.served_names()),
    }


def apply_adapter_table(adapters: Adapters, table: Message) -> None:
    versions = [AdapterVersion(name=v["name"], version=v["version"], path=v["path"],
                               rank=v["rank"], serving=v["serving"], retiring=v["retiring"],
                               replicas=set(v["replicas"])) for v in table["versions"]]
    adapters.mirror(versions, table["current"], frozenset(table["names"]))
