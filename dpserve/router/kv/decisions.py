"""What the `kv-aware` policy decided, counted for `/metrics`
(`dpserve.router.routing.policies.kv_aware` counts, `dpserve.router.kv.metrics` shows)."""

from __future__ import annotations

from dataclasses import dataclass

FALLBACK_REASONS = ("no_tokens", "no_events")
PROMPT_ROUTES = ("/v1/completions", "/v1/chat/completions")
"""The routes whose prompt the router tokenizes and routes by cached prefix."""
CACHED_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384)
"""Upper bounds (tokens) of the cached-prefix histogram; one more bucket holds the rest."""


@dataclass(slots=True)
class KVRoutingStats:
    """What the policy did, for `/metrics` (counters since start)."""

    on_events: int = 0
    """Requests placed by cached prefix and load."""
    fallbacks: dict[str, int] | None = None
    """Requests placed by the fallback, by reason (`FALLBACK_REASONS`)."""
    prompt_tokens: int = 0
    """Prompt tokens of the requests placed on events."""
    cached_tokens: int = 0
    """Of those, tokens the chosen replica held: the hit rate the router expects."""
    cached_histogram: list[int] | None = None
    """Decisions on events by the chosen replica's cached-prefix length: one count per
    bucket of CACHED_BUCKETS (at most that many tokens), then one for longer ones."""
    last_cached_tokens: int = 0
    """The cached-prefix length of the latest decision on events."""
    relayed_prompts: int = 0
    """Prompts the router's other data-plane workers placed (and, on the followers, those
    its peers placed), counted as held where they went (`dpserve.router.workers.kv_share`)."""
