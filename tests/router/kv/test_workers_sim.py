"""`kv-aware` with two data-plane workers (`dpserve router --workers 2`) in front of a
simulated fleet publishing KV events: each worker follows every replica's events
itself, so whichever worker a connection reaches, a conversation's next turn goes where
its prefix is cached, and `/metrics` counts every worker's decisions."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx

from dpserve.sim import Fleet
from tests.router.kv.test_two_routers_sim import EVENTS, SYSTEM, metric
from tests.router.workers.test_workers import router_with_workers
from tests.waiting import wait_for

DECISIONS = "dpserve_kv_routing_decisions_total"


@dataclasses.dataclass
class Served:
    replica: str
    content: str


async def chat(url: str, messages: list[dict[str, str]]) -> Served:
    """One turn, on a connection of its own (the kernel picks the worker)."""
    async with httpx.AsyncClient() as client:
        resp = await client.post(url + "/v1/chat/completions", timeout=30, json={
            "model": EVENTS.model, "messages": messages, "max_tokens": 8})
    assert resp.status_code == 200, resp.text
    return Served(resp.headers["x-dpserve-replica"],
                  resp.json()["choices"][0]["message"]["content"])


async def decisions(url: str) -> dict[str, float]:
    """`kv-aware`'s decisions by basis, and the requests each worker answered."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(url + "/metrics")).text
    found = {basis: metric(text, DECISIONS, basis=basis)
             for basis in ("events", "no_events", "no_tokens")}
    for worker in ("0", "1"):
        found[worker] = metric(text, "dpserve_worker_requests_total", worker=worker)
    return found


async def counted(url: str, before: dict[str, float], n: int) -> dict[str, float] | None:
    """The decisions since `before`, once all `n` requests sent since are counted
    (followers report their metrics once a second)."""
    now = await decisions(url)
    delta = {key: now[key] - before[key] for key in now}
    placed = delta["events"] + delta["no_events"] + delta["no_tokens"]
    return delta if placed == n and delta["0"] + delta["1"] == n else None


async def test_each_turn_goes_where_the_conversation_is_cached_whichever_worker_takes_it():
    async with Fleet(n=2, config=EVENTS) as fleet, router_with_workers(
            *fleet.urls, flags=("--policy", "kv-aware", "--tokenizer", "sim")) as (url, _):
        await both_workers_on_events(url)
        before = await decisions(url)
        turns = 0
        for conversation in range(3):
            history = [{"role": "system", "content": f"{conversation} {SYSTEM}"}]
            replicas = []
            for turn in range(4):
                history.append({"role": "user", "content": f"question {turn} please"})
                served = await chat(url, history)
                history.append({"role": "assistant", "content": served.content})
                replicas.append(served.replica)
                turns += 1
            assert len(set(replicas)) == 1, replicas  # where its first turn landed
        delta = await wait_for(lambda: counted(url, before, turns), "every turn counted")
        assert (delta["events"], delta["no_events"], delta["no_tokens"]) == (turns, 0, 0)
        assert delta["0"] > 0 and delta["1"] > 0, delta  # both workers took turns


SLOW_PREFILL = dataclasses.replace(EVENTS, prefill_per_token_s=0.015)
"""A ~200-token prompt prefills for ~3 s in one step: its blocks are published after."""
TENANT = " ".join(f"rule{i:03d} of the tenant" for i in range(60))
RELAYED = "dpserve_kv_relayed_prompts_total"
ATTEMPTS = 6


async def complete(url: str, prompt: str) -> str:
    """One completion on a connection of its own; the replica that served it."""
    async with httpx.AsyncClient() as client:
        resp = await client.post(url + "/v1/completions", timeout=30, json={
            "model": EVENTS.model, "prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-dpserve-replica"]


async def scraped(url: str, name: str) -> float:
    async with httpx.AsyncClient() as client:
        return metric((await client.get(url + "/metrics")).text, name)


async def tenant_follows_its_first_request(url: str, first_url: str, tenant: str,
                                           relayed: float) -> tuple[str, list[str]]:
    """A tenant's first request to `first_url`, and while it prefills, once `url`'s
    `/metrics` counts one more prompt relayed between workers than `relayed`, four more
    to `url` on connections of their own: (where the first went, where the others went)."""
    first = asyncio.create_task(complete(first_url, tenant + " question one"))
    try:
        await wait_for(lambda: _more(url, RELAYED, relayed),
                       "the prompt relayed to the other worker", within_s=10)
        others = await asyncio.gather(*(complete(url, f"{tenant} question {k}")
                                        for k in range(2, 6)))
    finally:
        home = await first
    return home, list(others)


async def _more(url: str, name: str, than: float) -> bool:
    return await scraped(url, name) > than


async def test_a_prompt_one_worker_placed_draws_the_other_workers_requests_with_its_prefix():
    """The first request prefills on one replica for seconds, its blocks not yet
    published; the others, whichever worker takes them, follow it there rather than to
    the idle replica (each worker forecasts what every worker placed)."""
    async with Fleet(n=2, config=SLOW_PREFILL) as fleet, router_with_workers(
            *fleet.urls, flags=("--policy", "kv-aware", "--tokenizer", "sim")) as (url, _):
        await both_workers_on_events(url)
        for attempt in range(ATTEMPTS):
            before = await decisions(url)
            home, others = await tenant_follows_its_first_request(
                url, url, f"tenant {attempt} {TENANT}", await scraped(url, RELAYED))
            assert others == [home] * len(others), (home, others)
            delta = await wait_for(lambda b=before: counted(url, b, 5), "every request counted")
            if delta["0"] and delta["1"]:
                return  # both workers placed some of them
        raise AssertionError(f"the kernel gave one worker every connection {ATTEMPTS} times")


async def both_workers_on_events(url: str) -> None:
    async def every_worker_routes_on_events() -> bool:
        """A round of first turns: all placed on events, by both workers (each has
        loaded its tokenizer and follows both replicas)."""
        before = await decisions(url)
        round_ = [await chat(url, [{"role": "user", "content": f"probe {i}"}])
                  for i in range(8)]
        delta = await wait_for(lambda: counted(url, before, len(round_)),
                               "the round's decisions counted")
        return delta["events"] == len(round_) and delta["0"] > 0 and delta["1"] > 0

    await wait_for(every_worker_routes_on_events, "both workers routing on events",
                   within_s=60, every_s=0.5)
