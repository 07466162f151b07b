"""Stop strings across a seam: a migrated stream stops where an uninterrupted one would.

The reference is vLLM 0.32's detokenizer, written out here once more: text held
back while it could begin a stop string, the match completing earliest wins, none
before `min_tokens`, the stop string cut off unless `include_stop_str_in_output`.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from dpserve.router.migration.continuation import continuation
from dpserve.router.migration.replay import StreamState
from dpserve.router.migration.stops import SentText, StopScan, held_text, stop_strings

PROMPT = "<prompt>"


def engine(pieces: list[str], stops: list[str], *, include: bool, min_tokens: int
           ) -> list[tuple[str, str | None, bool]]:
    """Each token's chunk as vLLM streams it: (text, stop string matched, finished)."""
    hold = max(map(len, stops)) - 1 if stops and not include else 0
    out, sent, chunks = "", 0, []
    for i, piece in enumerate(pieces):
        out += piece
        stop = None
        if stops and piece and i + 1 > min_tokens:
            found = [(out.find(s, max(0, len(out) + 1 - len(piece) - len(s))), s) for s in stops]
            hits = sorted(((at + len(s), n, at, s) for n, (at, s) in enumerate(found) if at >= 0))
            if hits:
                _, _, at, stop = hits[0]
                out = out[:at + len(stop)] if include else out[:at]
        finished = stop is not None or i == len(pieces) - 1
        end = len(out) if finished else max(sent, len(out) - hold)
        chunks.append((out[sent:end], stop, finished))
        sent = end
        if finished:
            break
    return chunks


def chunk(i: int, text: str, stop: str | None, finished: bool) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "token_ids": [i], "stop_reason": stop,
              "finish_reason": ("stop" if stop else "length") if finished else None}
    if i == 0:
        choice["prompt_token_ids"] = [1, 2, 3]
    return {"id": "cmpl-1", "created": 1, "model": "m", "choices": [choice]}


pieces_st = st.lists(st.text("ab", max_size=3), min_size=1, max_size=14)
stops_st = st.lists(st.text("ab", min_size=1, max_size=4), min_size=1, max_size=3)


@given(pieces_st, stops_st, st.booleans(), st.integers(0, 4), st.data())
def test_a_stream_broken_anywhere_stops_exactly_where_it_would_have(
        pieces, stops, include, min_tokens, data):
    body = {"prompt": "x", "stream": True, "max_tokens": len(pieces), "stop": stops,
            "include_stop_str_in_output": include, "min_tokens": min_tokens}
    whole = engine(pieces, stops, include=include, min_tokens=min_tokens)
    if len(whole) < 2:
        return
    k = data.draw(st.integers(1, len(whole) - 1), label="tokens before the break")

    state = StreamState(chat=False, body=body)
    for i, (text, stop, finished) in enumerate(whole[:k]):
        state.client_chunk(chunk(i, text, stop, finished), continuation=False)
    client = "".join(text for text, _, _ in whole[:k])
    state.rewind()
    replayed = len(state.ids)
    held = held_text(PROMPT + "".join(pieces[:replayed]), PROMPT, state.sent)
    assert held is not None
    state.scan = StopScan.at_seam(state.stops, body, state.sent, held, replayed)

    asked = continuation(state)
    assert asked is not None and asked["include_stop_str_in_output"] is True
    again = engine(pieces[replayed:], stops, include=True,
                   min_tokens=asked.get("min_tokens", 0))
    ended = None
    for i, (text, stop, finished) in enumerate(again):
        out = state.client_chunk(chunk(replayed + i, text, stop, finished), continuation=True)
        assert out is not None
        choice = out["choices"][0]
        client += choice["text"]
        if choice["finish_reason"] is not None:
            ended = choice
            break

    assert client == "".join(text for text, _, _ in whole)
    assert ended is not None and ended["stop_reason"] == whole[-1][1]
    assert ended["finish_reason"] == ("stop" if whole[-1][1] else "length")
    assert state.usage_so_far()["completion_tokens"] == len(whole)


def test_held_text_is_what_the_client_has_not_got():
    sent = SentText()
    sent.add("hello wor")
    assert held_text(PROMPT + "hello world", PROMPT, sent) == "ld"
    assert held_text(PROMPT + "hello", PROMPT, sent) is None  # less than was sent
    assert held_text(PROMPT + "hello there", PROMPT, sent) is None  # not what was sent
    assert held_text("other" + "hello world", PROMPT, sent) is None


def test_stop_strings_as_vllm_takes_them():
    assert stop_strings({}) == [] and stop_strings({"stop": None}) == []
    assert stop_strings({"stop": "x"}) == ["x"] and stop_strings({"stop": ["a", "b"]}) == [
        "a", "b"]
    assert stop_strings({"stop": [1]}) is None and stop_strings({"stop": {"a": 1}}) is None
