"""Routing on KV events with real vLLM replicas: the router tokenizes each chat as
vLLM renders it, follows the engines' events, and sends every turn of a conversation
to the replica holding it; the cached prefix it expects is, token for token, the
prefix-cache hits the engines report. On the session's shared deployment: `kv-aware` is
what `dpserve serve` routes by unless told otherwise (`auto`)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import MODEL_NAME, Deployment, replica_metric
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.vllm

SYSTEM = " ".join(f"Rule {i}: be kind to the number {i}." for i in range(25))
"""About 300 tokens: two of the CPU engine's 128-token blocks, and room for 4 turns in
the tiny model's 1024-token context."""


def router_metric(d: Deployment, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(d.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def engine_hits(d: Deployment) -> float:
    return sum(replica_metric(port, "vllm:prefix_cache_hits_total")
               for _, port in d.replicas().values())


def test_each_turn_goes_where_the_engines_say_its_conversation_is_cached(deployment):
    wait_for_sync(lambda: router_metric(deployment, "dpserve_kv_events_following") == 2,
                  "the router following both engines' KV events", within_s=60)
    no_tokens_before = router_metric(deployment, "dpserve_kv_routing_decisions_total",
                                     basis="no_tokens")
    cached_before = router_metric(deployment, "dpserve_kv_routed_tokens_total", kind="cached")
    hits_before = engine_hits(deployment)
    turns: dict[int, list[str]] = {}
    for conversation in range(3):
        history = [{"role": "system", "content": f"Conversation {conversation}. {SYSTEM}"}]
        for turn in range(4):
            history.append({"role": "user", "content": f"Tell me about {turn}."})
            r = httpx.post(deployment.base_url + "/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": history, "max_tokens": 8,
                "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            turns.setdefault(conversation, []).append(r.headers["x-dpserve-replica"])
            history.append({"role": "assistant",
                            "content": r.json()["choices"][0]["message"]["content"]})
    assert all(len(set(served)) == 1 for served in turns.values()), turns
    assert router_metric(deployment, "dpserve_kv_routing_decisions_total",
                         basis="no_tokens") == no_tokens_before
    cached = router_metric(deployment, "dpserve_kv_routed_tokens_total",
                           kind="cached") - cached_before
    # Turns 2 to 4 of each conversation find at least the system prompt's two blocks.
    assert cached >= 3 * 3 * 256
    assert cached == engine_hits(deployment) - hits_before
