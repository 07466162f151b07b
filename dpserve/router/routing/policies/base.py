from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dpserve.router.fleet.pool import Replica


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about the request it places."""

    route: str
    model: str | None = None
    session_id: str | None = None
    """The client's conversation or user key (`X-Session-Id`, else the OpenAI `user`
    field); see :func:`dpserve.router.routing.policies.keys.session_id`."""
    prefix: str | None = None
    """Leading characters of the prompt or rendered messages, for prefix affinity;
    see :func:`dpserve.router.routing.policies.keys.prompt_prefix`."""
    tokens: tuple[int, ...] | None = None
    """The prompt's token ids as the engine will see them (chat template applied), for
    routing on KV events; None when not computed or not known exactly."""
    size: int = 0
    """The request body's length in bytes (a canary compares TTFTs of like sizes)."""
    adapter: str | None = None
    """The engine name of the LoRA adapter version the request runs on
    (`NAME@VERSION`); only replicas that have it loaded are candidates."""


Tokenize = Callable[[str, dict[str, Any]], Awaitable[Sequence[int] | None]]
"""`(route, parsed body) -> the prompt's token ids as the engine will see them`, or None
when they cannot be known exactly; never raises, never blocks the event loop
(`dpserve.router.kv.tokens`)."""


class Policy(Protocol):
    name: str
    needs: frozenset[str]
    """What the policy reads beyond the route and model: `session_id`, `prefix` and
    `tokens` (fields of RequestInfo, computed for a request only when some policy needs
    them) and `engine_load` (the engines' own load, scraped from their /metrics)."""

    def select(self, candidates: Sequence[Replica], request: RequestInfo) -> Replica | None:
        """Pick one of `candidates` (all able to serve), or None if there are none."""
        ...


class PeerWork(Protocol):
    """What other routers (`dpserve.router.peers`) say they sent each replica lately."""

    def work(self, url: str, now: float) -> float:
        """Their decayed count of requests sent to the replica at `url`, at `now`."""
        ...

    def bias(self, url: str) -> float:
        """Work to add to the replica at `url` when spreading: 0 for this router's share
        of the replicas, more for the others' (see `dpserve.router.peers.state`)."""
        ...


Journal = dict[str, Any]
"""What a policy with memory learned lately, for the router's other workers:
`{"work": {replica id: requests sent}, "homes": [(key, replica id), ...]}`."""


class Shared(Protocol):
    """A policy whose memory the data-plane workers share (`dpserve.router.workers`)."""

    on_journal: Callable[[], None] | None
    """Called when the journal gets its first entry since it was last taken."""

    half_life_s: float
    clock: Callable[[], float]

    def journal(self) -> Journal: ...

    def share_work(self, spread: Any) -> None: ...

    def absorb(self, journal: Journal) -> None: ...
