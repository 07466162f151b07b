"""Non-streamed completions ride on a stream: the client gets one JSON answer, and a
replica that dies or stalls mid-way no longer costs it the whole request.

Against the shared fake engine in its token mode (`tests.fake_tokens`): greedy output a
test can predict, replicas that close the connection or fall silent after k tokens on
cue. That the assembled answer is the body vLLM itself returns, field for field, is
checked on real replicas (tests/integration/test_assembled.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.router.asgi import ReplyTracker
from dpserve.router.errors import RouterError, sse_error_event
from dpserve.router.forward.assembled import Assembler, ride_body
from tests.conftest import running_router
from tests.fake_tokens import expected_text, generate, prompt_ids
from tests.router.migration.helpers import all_ready, scrape, stream, text
from tests.waiting import wait_for

COMPLETION = {"model": "fake-model", "prompt": "The quick brown fox", "max_tokens": 12,
              "temperature": 0}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 12, "temperature": 0}


async def post(base: str, route: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=20) as c:
        return await c.post(base + route, json=body)


@pytest.mark.parametrize("cut_after", [1, 5])
async def test_a_completion_whose_replica_dies_mid_way_is_answered_whole(fake_replicas,
                                                                         cut_after):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=cut_after)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        r = await post(base, "/v1/completions", COMPLETION)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert int(r.headers["content-length"]) == len(r.content)
    answer = r.json()
    assert answer["object"] == "text_completion" and answer["id"] == "cmpl-a"
    [choice] = answer["choices"]
    assert choice["text"] == expected_text(COMPLETION, 12)
    assert (choice["finish_reason"], choice["token_ids"]) == ("length", None)
    assert answer["usage"]["completion_tokens"] == 12
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids(COMPLETION))
    [seam] = answer["dpserve"]["migrations"]
    assert (seam["from"], seam["to"], seam["reason"]) == ("r0", "r1", "disconnected")
    continued = b.requests[-1]
    assert continued["stream"] is True and isinstance(continued["prompt"], list)


async def test_a_chat_whose_replica_dies_mid_way_is_answered_as_a_chat(fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=4)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        r = await post(base, "/v1/chat/completions", CHAT)
    answer = r.json()
    assert r.status_code == 200 and answer["object"] == "chat.completion"
    [choice] = answer["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == expected_text(CHAT, 12)
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 12
    assert answer["dpserve"]["migrations"][0]["to"] == "r1"


async def test_token_ids_asked_for_come_whole_and_once(fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=6)  # after a half character
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        r = await post(base, "/v1/completions", COMPLETION | {"return_token_ids": True})
    [choice] = r.json()["choices"]
    assert choice["prompt_token_ids"] == prompt_ids(COMPLETION)
    assert choice["token_ids"] == generate(prompt_ids(COMPLETION), 12)


async def test_a_stalled_replica_costs_the_idle_timeout_not_the_whole_answer(fake_replicas):
    a = await fake_replicas("a", tokens=True, hang_after_tokens=3)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin",
                              stream_idle_timeout_s=0.5) as (base, router):
        await all_ready(router, 2)
        r = await post(base, "/v1/completions", COMPLETION)
        metrics = await scrape(base)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == expected_text(COMPLETION, 12)
    assert r.json()["dpserve"]["migrations"][0]["reason"] == "stalled"
    assert 'dpserve_migrations_total{outcome="migrated",reason="stalled"} 1.0' in metrics
    assert "dpserve_time_to_first_byte_seconds_count" in metrics


async def test_a_request_that_may_not_move_fails_within_the_idle_timeout_saying_why(
        fake_replicas):
    a = await fake_replicas("a", tokens=True, hang_after_tokens=3)
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin",
                              stream_idle_timeout_s=0.5) as (base, router):
        await all_ready(router, 2)
        r = await post(base, "/v1/completions", COMPLETION | {"presence_penalty": 0.5})
        metrics = await scrape(base)
    assert r.status_code == 502 and r.headers["content-type"] == "application/json"
    message = r.json()["error"]["message"]
    assert "no data for 0.5 s" in message and "penalties" in message, message
    assert b.requests == []
    assert 'dpserve_migration_refusals_total{reason="penalties"} 1.0' in metrics


@pytest.mark.parametrize("extra", [
    {"n": 2}, {"logprobs": 1}, {"echo": True}, {"stream_options": {"include_usage": True}},
    {"stream": False},
], ids=["n", "logprobs", "echo", "stream_options", "stream-false"])
async def test_only_answers_the_router_can_assemble_exactly_ride_on_a_stream(fake_replicas,
                                                                            extra):
    a = await fake_replicas("a", tokens=True)
    async with running_router([a.url]) as (base, router):
        await all_ready(router, 1)
        r = await post(base, "/v1/completions", COMPLETION | extra)
    assert r.status_code == 200
    rides = extra == {"stream": False}
    assert (a.requests[-1].get("stream") is True) == rides, a.requests[-1]


async def test_with_assembly_off_a_request_is_forwarded_as_it_came(fake_replicas):
    a = await fake_replicas("a", tokens=True)
    async with running_router([a.url], assemble_responses=False) as (base, router):
        await all_ready(router, 1)
        r = await post(base, "/v1/completions", COMPLETION)
    assert r.status_code == 200 and a.requests == [COMPLETION]


def test_the_ride_fields_go_in_front_unless_the_client_set_one():
    raw = b'{"model":"m","prompt":"hi"}'
    assert ride_body({"model": "m", "prompt": "hi"}, raw, ids=True) == (
        b'{"stream":true,"stream_options":{"include_usage":true},"return_token_ids":true,'
        b'"model":"m","prompt":"hi"}')
    # Written again where a duplicate key would leave the client's value in force.
    assert ride_body({"stream": False, "prompt": "x"}, b'{"stream":false,"prompt":"x"}',
                     ids=False) == b'{"stream":true,"prompt":"x","stream_options":' \
                                   b'{"include_usage":true}}'


class Sink:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


async def assembled(events: bytes, *, chat: bool = False, limit: int = 1 << 20
                    ) -> tuple[int, dict[str, bytes], bytes]:
    sink = Sink()
    reply = Assembler(ReplyTracker(sink), chat=chat, limit=limit)
    await reply.start(200, [(b"content-type", b"text/event-stream"), (b"x-dpserve-replica",
                                                                       b"r0")])
    await reply.body(events, more=False)
    start, body = sink.sent
    return start["status"], dict(start["headers"]), body["body"]


async def test_an_engine_error_mid_stream_is_the_answer_with_its_status():
    error = b'data: {"error":{"message":"bad","type":"BadRequestError","param":null,' \
            b'"code":400}}\n\ndata: [DONE]\n\n'
    status, headers, body = await assembled(
        b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"a"}]}\n\n' + error)
    assert status == 400 and headers[b"content-type"] == b"application/json"
    assert b'"message":"bad"' in body and headers[b"x-dpserve-replica"] == b"r0"


async def test_a_cut_that_does_not_move_is_a_502_in_the_openai_envelope():
    status, _, body = await assembled(sse_error_event(502, "stream interrupted: gone"))
    assert status == 502 and b"stream interrupted: gone" in body


async def test_a_stream_without_its_end_is_a_502_not_half_an_answer():
    status, _, body = await assembled(b'data: {"id":"c","choices":[{"index":0,"text":"a"}]}'
                                      b"\n\ndata: [DONE]\n\n")
    assert status == 502 and b"before its last token" in body


async def test_an_answer_past_the_response_limit_is_refused():
    with pytest.raises(RouterError) as err:
        await assembled(b'data: {"choices":[{"index":0,"text":"' + b"x" * 200 + b'"}]}\n\n',
                        limit=100)
    assert err.value.status == 502 and "100 bytes" in err.value.message


def vllm_events(pieces: list[str], ids: list[list[int]], *, chat: bool) -> bytes:
    """A stream as vLLM 0.32 writes it (compact JSON, UTF-8 as is), ending with usage."""
    def event(chunk: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(chunk, ensure_ascii=False,
                                      separators=(",", ":")).encode() + b"\n\n"

    head = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1, "model": "m"}
    out = [event(head | {"choices": [{"index": 0, "delta": {"role": "assistant",
                                                              "content": ""},
                                      "logprobs": None, "finish_reason": None}]})] if chat \
        else []
    for i, (piece, tokens) in enumerate(zip(pieces, ids, strict=True)):
        last = i == len(pieces) - 1
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": "length" if last else None}
        choice |= {"delta": {"content": piece}} if chat else {"text": piece,
                                                               "stop_reason": None}
        out.append(event(head | {"choices": [choice | {"token_ids": tokens}]}))
    usage = {"prompt_tokens": 3, "total_tokens": 3 + len(pieces),
             "completion_tokens": len(pieces)}
    out.append(event(head | {"choices": [], "usage": usage}))
    return b"".join(out) + b"data: [DONE]\n\n"


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.text(), min_size=1, max_size=12),
       chat=st.booleans(), data=st.data())
async def test_any_text_is_assembled_exactly_as_it_was_streamed(pieces, chat, data):
    """Quotes, backslashes, escapes, surrogates' halves, keys inside the text: the
    byte scan of most events gives what parsing each would."""
    ids = [data.draw(st.lists(st.integers(0, 10**6), max_size=3)) for _ in pieces]
    status, _, body = await assembled(vllm_events(pieces, ids, chat=chat), chat=chat)
    answer = json.loads(body)
    [choice] = answer["choices"]
    assert status == 200
    assert (choice["message"]["content"] if chat else choice["text"]) == "".join(pieces)
    assert choice["token_ids"] == [t for group in ids for t in group]
    assert answer["usage"]["completion_tokens"] == len(pieces)


@pytest.mark.parametrize("streamed", [False, True], ids=["not-streamed", "streamed"])
async def test_a_replica_silent_before_the_first_token_is_left_after_the_idle_timeout(
        fake_replicas, streamed):
    """A stopped engine still takes requests and answers their heads; one waiting for
    its first token there goes elsewhere once the replica sent nothing for the idle
    timeout (its client has nothing yet), not after `first_byte_timeout_s`."""
    a = await fake_replicas("a", tokens=True, first_chunk_gate=asyncio.Event())  # never
    b = await fake_replicas("b", tokens=True)
    async with running_router([a.url, b.url], policy="round-robin",
                              stream_idle_timeout_s=0.5) as (base, router):
        await all_ready(router, 2)
        if streamed:
            events = await stream(base, "/v1/completions", COMPLETION | {"stream": True})
            got = text(events)
        else:
            r = await post(base, "/v1/completions", COMPLETION)
            assert r.headers["x-dpserve-replica"] == "r1"
            got = r.json()["choices"][0]["text"]
        await wait_for(lambda: a.closed_streams == 1, "r0's stream closed (vLLM aborts it)")
    assert got == expected_text(COMPLETION, 12)
    assert len(b.requests) == 1


async def test_metrics_an_engine_reports_on_its_last_event_reach_the_answer():
    """`--enable-per-request-metrics` (or speculative decoding): vLLM puts them on a
    stream's usage event; a whole answer carries them at the top."""
    events = vllm_events(["a", "b"], [[1], [2]], chat=False)
    metrics = {"time_to_first_token_s": 0.01, "decode_tokens_per_s": 50.0}
    usage_at = events.rindex(b'"usage":')
    events = events[:usage_at] + b'"metrics":' + json.dumps(metrics).encode() + b"," + \
        events[usage_at:]
    status, _, body = await assembled(events)
    assert status == 200 and json.loads(body)["metrics"] == metrics
