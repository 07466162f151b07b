"""The migration path on the socket, as an attacker would try it.

With migration on, the router rewrites a stream's body (`return_token_ids`) and, when
its replica breaks, writes a request of its own (the continuation, and for stop
strings `/detokenize`). None of that may let a client's bytes reach a replica as a
request the router did not frame: each test sends raw bytes to a real router in front
of fake replicas in token mode, one of which cuts the stream, and checks what the
client got and every request each replica saw.
"""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import running_router
from tests.fake_tokens import expected_text
from tests.router.forward.test_smuggling import SLEEP, SMUGGLED, chunked, port_of
from tests.router.migration.helpers import all_ready
from tests.router.rawhttp import completion, exchange, parse_responses, request

HOSTILE_PROMPT = "hi\r\n\r\n" + SMUGGLED.decode() + "\r\n\r\n" + SLEEP.decode()


def sse_text(body: bytes) -> tuple[str, list[Any]]:
    """A streamed completion's text and its events (`[DONE]` as a string)."""
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    parsed = [e if e == "[DONE]" else json.loads(e) for e in events]
    text = "".join(c.get("text") or "" for e in parsed if isinstance(e, dict)
                   for c in e.get("choices", []))
    return text, parsed


async def test_a_hostile_chunked_stream_that_moves_never_smuggles_a_request(fake_replicas):
    a = await fake_replicas("a", tokens=True, cut_after_tokens=3)
    b = await fake_replicas("b", tokens=True)
    body = {"model": "fake-model", "prompt": HOSTILE_PROMPT, "max_tokens": 10,
            "temperature": 0, "stream": True, "stop": ["zzzz"]}
    # Spaces, a key order vLLM would not write, the body chunked, a request pipelined.
    raw_body = json.dumps(body, indent=1).encode()
    async with running_router([a.url, b.url], policy="round-robin") as (url, router):
        await all_ready(router, 2)
        raw, _ = await exchange(port_of(url), request(
            "POST", "/v1/completions", "content-type: application/json",
            "transfer-encoding: chunked", body=chunked(raw_body), length=False)
            + completion("after"), quiet_s=2.0)
    moved, after = parse_responses(raw)
    text, events = sse_text(moved.body)
    assert moved.status == 200 and events[-1] == "[DONE]"
    assert text == expected_text(body, 10)
    assert [(m["from"], m["to"]) for m in events[-2]["dpserve"]["migrations"]] == [
        ("r0", "r1")]
    assert after.status == 200  # the pipelined request: answered after, framed on its own
    assert a.dev_calls == [] and b.dev_calls == []
    # The stream, its continuation, the pipelined one (on a stream too: moved if cut).
    reached = a.reached() + b.reached()
    moves = len(after.json().get("dpserve", {}).get("migrations", []))
    assert reached.count("POST /v1/completions") == 3 + moves
    assert set(reached) == {"POST /v1/completions", "POST /detokenize"}  # the router's own
    continued = next(r for r in b.requests if r.get("stream"))
    assert isinstance(continued["prompt"], list)  # ids: the hostile text is not re-parsed
    assert continued["stop"] == ["zzzz"]


async def test_a_client_that_asked_for_token_ids_in_an_odd_spelling_gets_them_once(
        fake_replicas):
    """`return_token_ids` written with an escape: the router sees the client's own
    field (no second one is added), and the replica one consistent body."""
    a = await fake_replicas("a", tokens=True, cut_after_tokens=2)
    b = await fake_replicas("b", tokens=True)
    raw_body = (b'{"model":"fake-model","prompt":"hi","max_tokens":6,"temperature":0,'
                b'"stream":true,"return\\u005ftoken_ids":false}')
    async with running_router([a.url, b.url], policy="round-robin") as (url, router):
        await all_ready(router, 2)
        raw, _ = await exchange(port_of(url), request(
            "POST", "/v1/completions", "content-type: application/json", body=raw_body),
            quiet_s=2.0)
    (answer,) = parse_responses(raw)
    text, events = sse_text(answer.body)
    assert answer.status == 200 and events[-1] == "[DONE]"
    assert text == expected_text({"prompt": "hi"}, 6)
    assert a.requests[0]["return_token_ids"] is True  # re-written whole, not spliced
    assert events[-2]["dpserve"]["migrations"][0]["to"] == "r1"
    assert all(c.get("token_ids") is None for e in events if isinstance(e, dict)
               for c in e.get("choices", []))  # the client said false: none shown
