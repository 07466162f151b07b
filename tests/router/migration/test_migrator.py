"""A stream whose replica dies or stalls mid-way goes on, seamlessly, on another one.

Against the shared fake engine in its token mode (`tests.fake_tokens`): greedy
output that a test can predict, replicas that close the connection or fall silent
after k tokens on cue. What a real vLLM does with a replayed context (the same
tokens) is checked in tests/integration/test_serve.py and test_migration.py.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from dpserve.router.fleet.live import Moving
from dpserve.router.fleet.pool import ReplicaState
from tests.conftest import running_router
from tests.fake_tokens import GARBAGE, SPLIT_CHAR, expected_text, generate, prompt_ids
from tests.router.migration.helpers import (
    CHAT,
    COMPLETION,
    all_ready,
    final,
    scrape,
    stream,
    text,
    usage,
)
from tests.waiting import wait_for


@pytest.mark.parametrize("cut_after", [1, 4, 7])
async def test_a_stream_cut_mid_way_ends_on_another_replica_as_if_nothing_happened(
        fake_replicas, cut_after):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=cut_after)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION)
    assert text(events) == expected_text(COMPLETION, 12)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert {e["id"] for e in events if isinstance(e, dict)} == {"cmpl-a"}
    assert usage(events) == {"prompt_tokens": 19, "completion_tokens": 12, "total_tokens": 31}
    [seam] = final(events)["dpserve"]["migrations"]
    assert seam["from"] == "r0" and seam["to"] == "r1" and seam["reason"] == "disconnected"
    continued = b.requests[-1]
    replayed = len(continued["prompt"]) - 19
    assert continued["prompt"][:19] == prompt_ids(COMPLETION)
    assert continued["max_tokens"] == 12 - replayed and replayed <= cut_after
    assert all(c.get("token_ids") is None for e in events if isinstance(e, dict)
               for c in e.get("choices", []))  # not asked for: not shown


async def test_a_chat_stream_goes_on_as_chat_chunks_with_its_rendered_prompt(fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=5)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/chat/completions", CHAT)
    chunks = [e for e in events if isinstance(e, dict)]
    assert text(events, chat=True) == expected_text(CHAT, 12)
    assert {e["object"] for e in chunks} == {"chat.completion.chunk"}
    assert {e["id"] for e in chunks} == {"chatcmpl-a"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert final(events)["choices"][0]["finish_reason"] == "length"
    assert usage(events)["completion_tokens"] == 12
    assert b.seen[-1] == "POST /v1/completions"  # the continuation of a chat is a completion
    assert b.requests[-1]["prompt"][:8] == prompt_ids(CHAT)


async def test_the_seam_never_splits_a_character_the_client_has_not_seen_whole(fake_replicas):
    tokens = generate(prompt_ids(COMPLETION), 12)
    half = next(i for i, t in enumerate(tokens) if chr(t % 0x110000) == SPLIT_CHAR)
    a = await fake_replicas("a", tokens=True, cut_after_tokens=half + 1)  # after a half
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION)
    assert GARBAGE not in text(events) and text(events) == expected_text(COMPLETION, 12)
    assert len(b.requests[-1]["prompt"]) == 19 + half  # the half was generated again


async def test_a_stalled_stream_moves_after_the_idle_timeout(fake_replicas):
    a = await fake_replicas("a", tokens=True, hang_after_tokens=3)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin",
                              stream_idle_timeout_s=0.5) as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION)
        metrics = await scrape(base)
    assert text(events) == expected_text(COMPLETION, 12)
    assert final(events)["dpserve"]["migrations"][0]["reason"] == "stalled"
    assert 'dpserve_migrations_total{outcome="migrated",reason="stalled"} 1.0' in metrics


async def test_a_stream_cut_after_its_last_token_is_finished_by_the_router(fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=12)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION)
    assert text(events) == expected_text(COMPLETION, 12) and events[-1] == "[DONE]"
    assert usage(events) == {"prompt_tokens": 19, "completion_tokens": 12, "total_tokens": 31}
    assert b.requests == []  # nothing left to generate


async def test_a_stream_that_stalls_after_its_done_event_is_ended_not_moved(fake_replicas):
    """`[DONE]` went out, the end of the response did not (an engine stopped right
    there): the router ends the response; nothing is generated again, no second
    `[DONE]` (seen under a SIGSTOP-stalled canary, which broke clients' parsers)."""
    a = await fake_replicas("a", tokens=True, hang_at_end=True)
    b = await fake_replicas("b", tokens=True)
    body = COMPLETION | {"stream_options": {"include_usage": True}}
    async with running_router([a.url, b.url], policy="round-robin",
                              stream_idle_timeout_s=0.5) as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", body)
        metrics = await scrape(base)
    assert text(events) == expected_text(COMPLETION, 12)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert usage(events) == {"prompt_tokens": 19, "completion_tokens": 12, "total_tokens": 31}
    assert b.requests == [] and 'outcome="migrated"' not in metrics


async def test_a_drain_does_not_move_a_stream_whose_done_event_went_out(fake_replicas):
    a = await fake_replicas("a", tokens=True, hang_at_end=True)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router), \
            httpx.AsyncClient(timeout=20) as c:
        await all_ready(router, 2)
        async with c.stream("POST", base + "/v1/completions", json=COMPLETION) as r:
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if line == "data: [DONE]":
                    break
            drained = await c.post(base + "/admin/replicas/r0/drain",
                                   json={"move_streams": True})
    assert drained.json()["moved_streams"] == 0, drained.json()
    assert b.requests == []


async def test_a_second_failure_moves_the_stream_again(fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=3)
    b = await fake_replicas("b", tokens=True, cut_after_tokens=2)
    c = await fake_replicas("c", tokens=True)
    async with running_router([a.url, b.url, c.url], policy="round-robin") as (base, router):
        await all_ready(router, 3)
        events = await stream(base, "/v1/completions", COMPLETION)
    assert text(events) == expected_text(COMPLETION, 12)
    assert [(s["from"], s["to"]) for s in final(events)["dpserve"]["migrations"]] == [
        ("r0", "r1"), ("r1", "r2")]
    assert usage(events)["completion_tokens"] == 12


async def test_past_the_migration_limit_the_stream_ends_with_an_error_event(fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=3)
    b = await fake_replicas("b", tokens=True, cut_after_tokens=2)
    c = await fake_replicas("c", tokens=True)
    async with running_router([a.url, b.url, c.url], policy="round-robin",
                              migration_limit=1) as (base, router):
        await all_ready(router, 3)
        events = await stream(base, "/v1/completions", COMPLETION)
        metrics = await scrape(base)
    assert "stream interrupted" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    assert c.requests == []
    assert 'dpserve_migration_refusals_total{reason="limit"} 1.0' in metrics


@pytest.mark.parametrize(("extra", "reason"), [
    ({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"), ({"presence_penalty": 0.5}, "penalties"),
    ({"echo": True}, "echo"),
    ({"seed": 7, "temperature": 0.8}, "seed"),
    # As vLLM reads them (pydantic, lax): strings and whole floats are numbers.
    ({"n": "2"}, "n"), ({"n": 2.0}, "n"), ({"logprobs": "1"}, "logprobs"),
    ({"presence_penalty": "0.5"}, "penalties"), ({"echo": "true"}, "echo"),
    ({"seed": "7", "temperature": "0.8"}, "seed"),
])
async def test_a_stream_that_could_not_continue_as_the_same_request_fails_as_before(
        fake_replicas, extra, reason):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=3)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION | extra)
        metrics = await scrape(base)
    assert "stream interrupted" in events[-2]["error"]["message"]
    assert "return_token_ids" not in a.requests[-1] and b.requests == []
    assert f'dpserve_migration_refusals_total{{reason="{reason}"}} 1.0' in metrics


@pytest.mark.parametrize(("extra", "reason"), [
    ({"response_format": {"type": "json_object"}}, "structured_output"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_output"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "multimodal"),
], ids=["response_format", "structured_outputs", "tools", "image"])
async def test_a_chat_stream_that_could_not_continue_as_the_same_request_fails_as_before(
        fake_replicas, extra, reason):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=3)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/chat/completions", CHAT | extra)
        metrics = await scrape(base)
    assert "stream interrupted" in events[-2]["error"]["message"]
    assert "return_token_ids" not in a.requests[-1] and b.requests == []
    assert f'dpserve_migration_refusals_total{{reason="{reason}"}} 1.0' in metrics


@pytest.mark.parametrize("limit", ["12", 12.0, " 12"])
async def test_a_limit_vllm_reads_as_a_number_holds_across_the_seam(fake_replicas, limit):
    """`"max_tokens": "12"` is 12 to vLLM: the continuation asks for what is left of
    it, not for the engine's default (it ran 16 more per seam)."""
    a = await fake_replicas("a", tokens=True, cut_after_tokens=4, max_model_len=200)
    b = await fake_replicas("b", tokens=True, max_model_len=200)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION | {"max_tokens": limit})
    assert final(events)["dpserve"]["migrations"]
    assert text(events) == expected_text(COMPLETION, 12)
    assert usage(events)["completion_tokens"] == 12
    assert isinstance(b.requests[-1]["max_tokens"], int)


@pytest.mark.parametrize(("route", "body", "tokens"), [
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "max_tokens"}, 60 - 8),
    ("/v1/completions", COMPLETION | {"max_tokens": None}, 16),
    ("/v1/completions", {k: v for k, v in COMPLETION.items() if k != "max_tokens"}, 16),
], ids=["chat-without-a-limit", "completion-with-null", "completion-without-the-field"])
async def test_a_continuation_keeps_the_limit_vllm_gave_the_request(fake_replicas, route, body,
                                                                   tokens):
    """A chat without a limit runs to the context length; its continuation, a
    completion, must too (left without a limit it stopped at a completion's 16 more),
    asking for what the context leaves (an engine may refuse a limit past it).
    A completion without one stops at 16 in all, not 16 more per seam."""
    a = await fake_replicas("a", tokens=True, cut_after_tokens=5, max_model_len=60)
    b = await fake_replicas("b", tokens=True, max_model_len=60)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, route, body)
    assert final(events)["dpserve"]["migrations"]
    chat = route == "/v1/chat/completions"
    assert text(events, chat=chat) == expected_text(body, tokens)
    assert usage(events)["completion_tokens"] == tokens
    continued = b.requests[-1]
    replayed = len(continued["prompt"]) - len(prompt_ids(body))
    assert continued["max_tokens"] == tokens - replayed


async def test_a_chat_without_a_limit_ends_at_the_context_of_the_replica_it_moves_to(
        fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=5, max_model_len=60)
    b = await fake_replicas("b", tokens=True, max_model_len=10)  # 8 of them the prompt
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
        events = await stream(base, "/v1/chat/completions", body)
    assert not any("error" in e for e in events[:-1]) and events[-1] == "[DONE]"
    assert final(events)["choices"][0]["finish_reason"] == "length"
    got = usage(events)["completion_tokens"]  # those r0 sent, less any to generate again
    assert got <= 5 and text(events, chat=True) == expected_text(body, got)
    assert b.requests == []  # nothing was left to ask of it


async def test_a_chat_without_a_limit_is_not_moved_where_the_context_length_is_unknown(
        fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=3)
    b = await fake_replicas("b", tokens=True)  # its /v1/models reports no max_model_len
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/chat/completions",
                              {k: v for k, v in CHAT.items() if k != "max_tokens"})
        metrics = await scrape(base)
    assert "stream interrupted" in events[-2]["error"]["message"]
    assert 'dpserve_migration_refusals_total{reason="no_context_length"} 1.0' in metrics


@pytest.mark.parametrize("cut", [4, 6], ids=["whole", "after-a-half-character"])
async def test_token_ids_reach_a_client_that_asked_for_them_once(fake_replicas, cut):
    """Cut after a half character, the seam goes before it and it is generated again:
    the client, which got its id already, does not get it twice."""
    a = await fake_replicas("a", tokens=True, cut_after_tokens=cut)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION | {"return_token_ids": True})
    ids = [t for e in events if isinstance(e, dict) for c in e.get("choices", [])
           for t in c["token_ids"] or ()]
    assert ids == generate(prompt_ids(COMPLETION), 12)


async def test_migration_off_leaves_streams_as_they_were(fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=3)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin",
                              migration_limit=0) as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION)
    assert "stream interrupted" in events[-2]["error"]["message"]
    assert "return_token_ids" not in a.requests[-1]


async def test_a_stream_moved_off_a_drained_replica_goes_where_its_weights_are(
        fake_replicas):
    fakes = [await fake_replicas(n, tokens=True, chunk_delay_s=0.02) for n in "abc"]
    async with running_router([f.url for f in fakes], policy="round-robin") as (base, router):
        await all_ready(router, 3)
        for rid, version in (("r0", "v1"), ("r1", "v2"), ("r2", "v1")):
            router.pool.get(rid).weight_version = version
        task = asyncio.create_task(stream(base, "/v1/completions", COMPLETION | {
            "max_tokens": 40}))
        await wait_for(lambda: router.dispatcher.streams.movable("r0"),
                       "the stream on r0, its prompt ids known")
        router.pool.set_state(router.pool.get("r0"), ReplicaState.DRAINING, "test")
        assert router.dispatcher.streams.evict("r0") == Moving(migrating=1)
        events = await task
    assert text(events) == expected_text(COMPLETION, 40)
    [seam] = final(events)["dpserve"]["migrations"]
    assert (seam["from"], seam["to"], seam["reason"]) == ("r0", "r2", "drained")
    assert router.dispatcher.breaker(router.pool.get("r0")).consecutive_failures == 0


async def test_an_admin_drain_with_move_streams_moves_them_at_its_deadline(fake_replicas):
    a = await fake_replicas("a", tokens=True, chunk_delay_s=0.05)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router), \
            httpx.AsyncClient(timeout=20) as c:
        await all_ready(router, 2)
        task = asyncio.create_task(stream(base, "/v1/completions", COMPLETION | {
            "max_tokens": 60}))
        await wait_for(lambda: router.dispatcher.streams.movable("r0"),
                       "the stream on r0, its prompt ids known")
        drained = await c.post(base + "/admin/replicas/r0/drain",
                               json={"wait_s": 0.2, "move_streams": True})
        events = await task
        again = await c.post(base + "/admin/replicas/r0/drain", json={"move_streams": True})
        bad = await c.post(base + "/admin/replicas/r1/drain", json={"move_streams": "yes"})
    assert drained.status_code == 200, drained.text
    assert drained.json() | {"state": "draining", "drained": True, "moved_streams": 1} == \
        drained.json()
    assert text(events) == expected_text(COMPLETION, 60)
    [seam] = final(events)["dpserve"]["migrations"]
    assert (seam["from"], seam["to"], seam["reason"]) == ("r0", "r1", "drained")
    assert again.json()["moved_streams"] == 0 and again.json()["drained"] is True
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "move_streams"
    assert router.pool.get("r1").state is ReplicaState.READY  # a bad request changes nothing


async def test_a_stream_without_a_head_within_the_idle_timeout_goes_elsewhere(fake_replicas):
    """A stopped engine (SIGSTOP) still accepts connections: only a timeout tells."""
    a = await fake_replicas("a", mode="mute")
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin",
                              stream_idle_timeout_s=0.5) as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", COMPLETION)
    assert text(events) == expected_text(COMPLETION, 12)
    assert len(a.requests) == 1 and len(b.requests) == 1


@pytest.mark.parametrize("tokens", [True, False], ids=["migratable", "not-migratable"])
async def test_a_stream_drained_before_its_first_chunk_starts_over_on_another_replica(
        fake_replicas, tokens):
    """Queued or in prefill on a drained replica, a stream has sent the client nothing:
    it starts over elsewhere (any stream, migratable or not) instead of being waited
    for or frozen by the replica's pause; no retry, no mark on the replica."""
    gate = asyncio.Event()  # never set: r0 has not got to the stream's first token
    a = await fake_replicas("a", tokens=tokens, first_chunk_gate=gate)
    b = await fake_replicas("b", tokens=tokens)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        task = asyncio.create_task(stream(base, "/v1/completions", COMPLETION))
        await wait_for(lambda: router.dispatcher.streams.movable("r0"),
                       "the stream on r0, before its first chunk")
        router.pool.set_state(router.pool.get("r0"), ReplicaState.DRAINING, "test")
        assert router.dispatcher.streams.evict("r0") == Moving(migrating=0, restarting=1)
        events = await task
        await wait_for(lambda: router.pool.get("r0").in_flight == 0, "r0 given up")
        await wait_for(lambda: a.closed_streams == 1, "r0's request abandoned (vLLM aborts)")
        metrics = await scrape(base)
    assert text(events) == (expected_text(COMPLETION, 12) if tokens else "t0t1t2t3")
    assert events[-1] == "[DONE]"
    assert [len(a.requests), len(b.requests)] == [1, 1]
    assert router.dispatcher.breaker(router.pool.get("r0")).consecutive_failures == 0
    assert 'dpserve_retries_total{route="/v1/completions"} 1' not in metrics
