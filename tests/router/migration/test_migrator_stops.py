"""A stream with stop strings moves too, and stops where an uninterrupted run would.

The fake engine's token model holds back text that could begin a stop string, as
vLLM does (`tests.fake_tokens`): at the break the client has less text than the
ids replayed, and a stop string may be half in the old replica's text and half in
the new one's. The reference is the same request, run once without a break.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import running_router
from tests.fake_tokens import expected_stream, generate, prompt_ids, text_of
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

# The completion's greedy output is "kowmséowmse" (é is two tokens): "séow" ends at
# its 9th token; "xyz" never comes.
STRADDLING = {"stop": ["séow", "zzz"], "max_tokens": 12}


async def run(fake_replicas: Any, body: dict[str, Any], cut: int, *, chat: bool = False
              ) -> tuple[list[Any], Any, str]:
    a = await fake_replicas("a", tokens=True, cut_after_tokens=cut)
    b = await fake_replicas("b", tokens=True)
    route = "/v1/chat/completions" if chat else "/v1/completions"
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, route, body)
        metrics = await scrape(base)
    return events, b, metrics


def test_the_reference_run_is_what_these_tests_assume():
    out = "".join(text_of(t) for t in generate(prompt_ids(COMPLETION), 12))
    assert out == "kowmséowmse"
    assert expected_stream(COMPLETION | STRADDLING, 12) == ("kowm", "séow", 9)


@pytest.mark.parametrize("cut", [2, 5, 6, 7, 8])
async def test_a_stop_string_across_the_seam_stops_the_stream_where_it_would_have(
        fake_replicas, cut):
    body = COMPLETION | STRADDLING
    events, b, metrics = await run(fake_replicas, body, cut)
    want, stop, tokens = expected_stream(body, 12)
    assert text(events) == want and events[-1] == "[DONE]"
    last = final(events)["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)
    assert usage(events)["completion_tokens"] == tokens
    assert final(events)["dpserve"]["migrations"][0]["to"] == "r1"
    continued = b.requests[-1]
    assert continued["stop"] == ["séow", "zzz"] and continued["include_stop_str_in_output"]
    assert "migration_refusals_total{" not in metrics


async def test_text_held_back_at_the_break_reaches_the_client(fake_replicas):
    body = COMPLETION | {"stop": "xyz"}  # never matches: only its hold-back shows
    events, _, _ = await run(fake_replicas, body, 4)
    assert text(events) == "kowmséowmse"
    assert final(events)["choices"][0]["finish_reason"] == "length"
    assert usage(events)["completion_tokens"] == 12


async def test_a_stop_string_kept_in_the_output_when_asked(fake_replicas):
    body = COMPLETION | STRADDLING | {"include_stop_str_in_output": True}
    events, _, _ = await run(fake_replicas, body, 7)
    assert text(events) == "kowmséow"


async def test_a_client_that_asked_for_ids_gets_each_once_across_the_seam(fake_replicas):
    body = COMPLETION | STRADDLING | {"return_token_ids": True}
    events, _, _ = await run(fake_replicas, body, 2)  # ids sent, their text held back
    ids = [t for e in events if isinstance(e, dict) for c in e.get("choices", [])
           for t in c.get("token_ids") or ()]
    assert ids == generate(prompt_ids(COMPLETION), 9)  # up to the stop's last token


async def test_min_tokens_postpones_the_stop_across_the_seam_too(fake_replicas):
    body = COMPLETION | {"stop": "ow", "min_tokens": 4}  # "ow" at tokens 2-3 is too early
    want, stop, tokens = expected_stream(body, 12)
    assert (want, stop, tokens) == ("kowmsé", "ow", 9)
    events, _, _ = await run(fake_replicas, body, 6)
    assert text(events) == want and usage(events)["completion_tokens"] == tokens


async def test_a_chat_stream_stops_across_the_seam_as_chat_chunks(fake_replicas):
    # The chat's greedy output is "zsecyqauiéu"; "uié" ends at its 11th token.
    body = CHAT | {"stop": ["uié"]}
    want, stop, tokens = expected_stream(body, 12)
    assert (want, stop, tokens) == ("zsecyqa", "uié", 11)
    events, _, _ = await run(fake_replicas, body, 9, chat=True)
    assert text(events, chat=True) == want
    last = final(events)
    assert last["object"] == "chat.completion.chunk"
    assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"]) == (
        "stop", "uié")
    assert usage(events)["completion_tokens"] == tokens


@pytest.mark.parametrize("per_chunk", [2, 3, 5])
@pytest.mark.parametrize("ids", [False, True], ids=["", "token-ids"])
async def test_usage_counts_only_the_tokens_up_to_a_stop_found_among_merged_tokens(
        fake_replicas, per_chunk, ids):
    """The continuation's engine merged several tokens into the chunk where the stop
    string that straddles the seam completes: vLLM would have stopped at the token
    completing it, so the router counts (and shows) none after it."""
    body = COMPLETION | STRADDLING | ({"return_token_ids": True} if ids else {})
    a = await fake_replicas("a", tokens=True, cut_after_tokens=7)
    b = await fake_replicas("b", tokens=True, tokens_per_chunk=per_chunk)
    async with running_router([a.url, b.url], policy="round-robin") as (base, router):
        await all_ready(router, 2)
        events = await stream(base, "/v1/completions", body)
    want, stop, tokens = expected_stream(body, 12)
    assert text(events) == want
    assert final(events)["choices"][0]["stop_reason"] == stop
    assert usage(events)["completion_tokens"] == tokens
    if ids:
        got = [t for e in events if isinstance(e, dict) for c in e.get("choices", [])
               for t in c.get("token_ids") or ()]
        assert got == generate(prompt_ids(COMPLETION), tokens)
