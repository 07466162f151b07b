"""The timed request against the scripted fake server: its script is the truth."""

import contextlib
import json
import time

import aiohttp
import pytest

from loadtest.client import Payload, RequestRecord, build_body, send
from loadtest.fakes import Script
from loadtest.metrics import tpot_s


def within(measured, truth):
    """The accuracy the harness promises: 5% or 2 ms, whichever is looser."""
    return abs(measured - truth) <= max(0.05 * truth, 0.002)


async def request(url, *, endpoint="completions", max_tokens=20, stream=True, limit_s=10.0,
                  index=0, session=None):
    body = build_body(endpoint, model="fake-model", prompt="a b c", max_tokens=max_tokens,
                      stream=stream, ignore_eos=True, extra_body={})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    record = RequestRecord(index=index, request_id=f"t-{index}", scheduled_s=0.0)
    async with contextlib.AsyncExitStack() as stack:
        if session is None:
            session = await stack.enter_async_context(
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limit_s)))
        await send(session, url + path, Payload(body, 3, max_tokens), record,
                   t0=time.perf_counter(), stream=stream)
    return record


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_ttft_and_tpot_match_what_the_server_did(fake_server, endpoint):
    """The truth is the server's own record of when it read the request and wrote each
    token: its script (200 ms, then 20 ms per token), plus whatever its sleeps overshot
    on a busy machine. The measured TTFT also holds the request's way to the server."""
    server = await fake_server(Script(ttft_s=0.2, itl_s=0.02), record_timings=True)
    async with aiohttp.ClientSession() as session:
        await request(server.url, max_tokens=1, index=-1, session=session)  # connect
        for i in range(2):
            r = await request(server.url, endpoint=endpoint, max_tokens=10, index=i,
                              session=session)
            assert r.ok, r.detail
            truth = server.timings[r.request_id]
            tokens = truth["tokens"]
            assert within(r.ttft_s, tokens[0] - truth["received"]), (r.ttft_s, truth)
            assert within(tpot_s(r), (tokens[-1] - tokens[0]) / 9), (tpot_s(r), tokens)
            assert within(r.latency_s, tokens[-1] - truth["received"])
            assert len(r.itl_s) == 9


async def test_token_counts_come_from_the_final_usage_event(fake_server):
    server = await fake_server(Script(output_tokens=7))
    r = await request(server.url, max_tokens=50)
    assert (r.ok, r.output_tokens, r.prompt_tokens, r.usage_reported) == (True, 7, 3, True)
    assert r.text is None  # nothing kept when the server counted


async def test_without_usage_the_token_events_are_counted(fake_server):
    server = await fake_server(Script(output_tokens=5, usage=False))
    r = await request(server.url)
    assert (r.ok, r.output_tokens, r.usage_reported) == (True, 5, False)
    assert r.text == " tok" * 5


async def test_the_body_asks_for_a_stream_with_usage_and_the_exact_length(fake_server):
    server = await fake_server()
    await request(server.url, max_tokens=12)
    await request(server.url, endpoint="chat", max_tokens=12)
    completion, chat = server.bodies
    assert completion == {"model": "fake-model", "prompt": "a b c", "max_tokens": 12,
                          "stream": True, "stream_options": {"include_usage": True},
                          "ignore_eos": True}
    assert chat["messages"] == [{"role": "user", "content": "a b c"}]
    assert chat["max_completion_tokens"] == 12


def test_extra_body_overrides_defaults():
    body = build_body("completions", model="m", prompt="p", max_tokens=3, stream=False,
                      ignore_eos=False, extra_body={"temperature": 0, "max_tokens": 4})
    assert json.loads(body) == {"model": "m", "prompt": "p", "max_tokens": 4, "stream": False,
                                "temperature": 0}


async def test_a_non_streaming_request_has_latency_but_no_ttft(fake_server):
    server = await fake_server(Script(ttft_s=0.05, itl_s=0.005))
    r = await request(server.url, max_tokens=11, stream=False)
    assert (r.ok, r.output_tokens, r.ttft_s, r.itl_s) == (True, 11, None, [])
    assert r.latency_s >= 0.1  # the server answers after 50 + 10 * 5 ms


@pytest.mark.parametrize(("fault", "reason"), [
    ("error500", "http_500"),
    ("error429", "http_429"),
    ("drop", "disconnected"),
    ("cut", "incomplete_stream"),
    ("no_done", "incomplete_stream"),
    ("error_event", "stream_error"),
    ("hang", "timeout"),
])
async def test_failures_are_recorded_by_reason_not_raised(fake_server, fault, reason):
    server = await fake_server(Script(itl_s=0.001, faults={0: fault}))
    r = await request(server.url, limit_s=0.5)
    assert (r.ok, r.error) == (False, reason), r.detail
    assert r.end_s >= r.start_s
    assert (await request(server.url)).ok  # the next request is served


async def test_an_http_error_keeps_the_servers_message(fake_server):
    server = await fake_server(Script(faults={0: "error500"}))
    r = await request(server.url)
    assert (r.status, r.detail) == (500, "scripted 500")


async def test_a_refused_connection_is_a_connect_error():
    r = await request("http://127.0.0.1:1")
    assert (r.ok, r.error) == (False, "connect_error")


async def test_the_replica_named_by_the_router_is_recorded(fake_server):
    server = await fake_server(Script(replicas=["r0", "r1"]))
    assert [(await request(server.url, index=i)).replica for i in range(3)] == ["r0", "r1", "r0"]
