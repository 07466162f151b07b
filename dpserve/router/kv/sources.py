"""Where a replica publishes its KV-cache events: its `GET /kv_event_sources` answer,
read as hostile input, or the operator's override.

vLLM answers `{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv", ...}}`,
one entry per data-parallel rank of the engine, `{}` with events off. A wildcard
endpoint (`*`, `0.0.0.0`, `::`) is where the engine *binds*: the router connects to
the same port on the replica's own host. A named host means the engine *connects*
out to a subscriber that binds there, which a router cannot be for many engines: such
a source is refused, saying so.

The router connects only to the replica's own host, whatever the answer names: an
engine (or whatever answers on its port) cannot point the router at another machine.
Only the port and the topic are taken from the answer. The one exception is a
replica on this machine (a loopback URL, as `dpserve serve` starts them), whose
engine may publish on a Unix socket (`ipc:///ABSOLUTE/PATH`): no port on any network
then carries the prompts' token ids.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_SOURCES_BYTES = 64 * 1024
"""Largest `/kv_event_sources` answer read: one entry is a few hundred bytes."""
MAX_TOPIC_CHARS = 256
_TCP = re.compile(r"tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(?P<port>[0-9]{1,5})")
_WILDCARDS = frozenset({"*", "0.0.0.0", "[::]", "::"})
_IPC = re.compile(r"ipc://(/[A-Za-z0-9._/\-]{1,100})")
"""An absolute path of plain characters, short enough for a Unix socket's address."""
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "[::1]"})


class SourceError(ValueError):
    """A replica's event source cannot be used; the message says why, in one line."""


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where to subscribe to one replica's KV events."""

    endpoint: str
    """The PUB socket: `tcp://HOST:PORT` on the replica's host."""
    replay_endpoint: str | None
    """The ROUTER socket that replays missed batches; None: gaps cannot be replayed."""
    topic: str


def replica_host(url: str) -> str:
    """The host of a replica's URL, bracketed if IPv6, as a ZMQ endpoint writes it."""
    host = urlsplit(url).hostname
    if not host:
        raise SourceError(f"replica URL {url!r} has no host")
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass
    return host


def on_host(endpoint: str, host: str, *, what: str) -> str:
    """`endpoint` (where an engine binds) as the router reaches it on `host`."""
    if endpoint.startswith("ipc://"):
        if host not in _LOOPBACK:
            raise SourceError(f"{what} {endpoint!r} is a Unix socket, which a replica on "
                              f"another host ({host}) cannot offer")
        if _IPC.fullmatch(endpoint) is None or "/../" in endpoint or endpoint.endswith("/.."):
            raise SourceError(f"{what} {endpoint!r} is not ipc:///ABSOLUTE/PATH of at most "
                              "100 plain characters")
        return endpoint
    found = _TCP.fullmatch(endpoint)
    if found is None:
        raise SourceError(f"{what} {endpoint!r} is not tcp://HOST:PORT or ipc:///PATH")
    port = int(found["port"])
    if not 0 < port < 65536:
        raise SourceError(f"{what} {endpoint!r} has no valid port")
    if found["host"] not in _WILDCARDS:
        raise SourceError(f"{what} {endpoint!r} names a host: the engine connects out to a "
                          "subscriber there instead of binding; start it with tcp://*:PORT")
    return f"tcp://{host}:{port}"


def parse_sources(body: bytes, replica_url: str) -> EventSource | None:
    """The event source in a replica's `/kv_event_sources` answer; None when it
    publishes none (events off). SourceError for anything else unusable."""
    if len(body) > MAX_SOURCES_BYTES:
        raise SourceError(f"/kv_event_sources answer is over {MAX_SOURCES_BYTES} bytes")
    try:
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise SourceError("/kv_event_sources answer is not JSON") from None
    if not isinstance(data, dict):
        raise SourceError("/kv_event_sources answer is not a JSON object")
    configs = [c for c in data.values() if isinstance(c, dict)
               and c.get("enable_kv_cache_events") is True and c.get("publisher") == "zmq"]
    if not configs:
        return None
    if len(data) > 1:
        raise SourceError(f"the engine publishes {len(data)} data-parallel ranks; a replica "
                          "must be one engine (one rank) to be indexed")
    config = configs[0]
    host = replica_host(replica_url)
    endpoint, replay, topic = (config.get("endpoint"), config.get("replay_endpoint"),
                               config.get("topic", ""))
    if not isinstance(endpoint, str):
        raise SourceError("/kv_event_sources names no endpoint")
    if replay is not None and not isinstance(replay, str):
        raise SourceError("/kv_event_sources replay_endpoint is not a string")
    if not isinstance(topic, str) or len(topic) > MAX_TOPIC_CHARS:
        raise SourceError("/kv_event_sources topic is not a string of at most "
                          f"{MAX_TOPIC_CHARS} characters")
    return EventSource(on_host(endpoint, host, what="endpoint"),
                       None if replay is None else on_host(replay, host, what="replay_endpoint"),
                       topic)


def override_source(endpoint: str, replay_endpoint: str | None, topic: str,
                    replica_url: str) -> EventSource:
    """The operator's endpoints (`tcp://*:PORT`), on the replica's host."""
    host = replica_host(replica_url)
    return EventSource(on_host(endpoint, host, what="kv_events_endpoint"),
                       None if replay_endpoint is None else on_host(
                           replay_endpoint, host, what="kv_events_replay_endpoint"), topic)
