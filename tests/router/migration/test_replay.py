"""Token replay's pure parts: what may migrate, the continuation asked for, the seam."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpserve.router.migration.continuation import continuation, upstream_body
from dpserve.router.migration.eligibility import CARRIED, FIELDS, REFUSED, refusal
from dpserve.router.migration.replay import StreamState

BASE: dict[str, Any] = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 10}


@pytest.mark.parametrize(("extra", "reason"), [
    ({}, None),
    ({"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.2}, None),
    ({"seed": 3, "temperature": 0}, None),
    ({"n": 2}, "n"), ({"best_of": 3}, "n"), ({"use_beam_search": True}, "beam_search"),
    ({"echo": True}, "echo"), ({"frequency_penalty": 0.1}, "penalties"),
    ({"logprobs": 0}, "logprobs"), ({"prompt_logprobs": 1}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "structured_output"),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_regex": "a+"}, "structured_output"),
    ({"guided_json": {"type": "object"}}, "structured_output"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "structured_output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "structured_output"),
    ({"seed": 3}, "seed"), ({"bad_words": ["x"]}, "bad_words"),
    ({"stop": ["\n"]}, None), ({"stop": "x"}, None), ({"stop": []}, None),
    ({"stop": [7]}, "stop_strings"), ({"stop": ["a", ""]}, "stop_strings"),
    ({"prompt": ["a", "b"]}, "several_prompts"), ({"prompt": [1, 2, 3]}, None),
    ({"prompt": ["one"]}, None), ({"suffix": "x"}, "unsupported_prompt"),
])
def test_what_may_migrate_on_completions(extra, reason):
    assert refusal(BASE | extra, chat=False) == reason


def test_every_field_vllm_declares_has_a_place_in_a_continuation():
    """A field a new vLLM adds fails here until it is carried, written by the router,
    spent on the prompt, or refused: never silently dropped from a continuation."""
    completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    declared = (set(completion.CompletionRequest.model_fields)
                | set(chat.ChatCompletionRequest.model_fields))
    assert declared - set(FIELDS) == set(), "fields without a place"
    assert set(FIELDS) - declared == set(), "places for fields vLLM does not declare"


@pytest.mark.parametrize(("extra", "reason"), [
    ({"logprob_token_ids": [5, 9]}, "logprobs"),
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 3}}, "generation_state"),
    ({"watermarking": True}, "generation_state"),
    ({"thinking_token_budget": 64}, "generation_state"),
    ({"thinking_token_budget": 0}, "generation_state"),
    ({"thinking_token_budget": -1}, None), ({"thinking_token_budget": None}, None),
    ({"vllm_xargs": {"my_processor": 1}}, "vllm_xargs"), ({"vllm_xargs": {}}, None),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer"),
    ({"ec_transfer_params": {"x": 1}}, "kv_transfer"),
    ({"return_token_offsets": True}, "output_fields"), ({"return_token_offsets": False}, None),
    ({"routed_experts_prompt_start": 4}, "output_fields"),
    ({"routed_experts_prompt_start": 0}, None),
    ({"watermarking": False, "session_id": "s", "stream_interval": 4}, None),
])
@pytest.mark.parametrize("chat", [False, True])
def test_fields_a_continuation_cannot_carry_refuse_migration_when_set(extra, reason, chat):
    base = (CHAT if chat else BASE) | extra
    assert refusal(base, chat=chat) == reason


def test_each_refused_field_refuses_once_set():
    """Every field placed as refused has a value that refuses migration."""
    set_values = {"n": 2, "use_beam_search": True, "echo": True, "presence_penalty": 0.5,
                  "frequency_penalty": 0.5, "logprobs": 1, "top_logprobs": 2,
                  "prompt_logprobs": 1, "response_format": {"type": "json_object"},
                  "structured_outputs": {"regex": "a"}, "bad_words": ["x"],
                  "prompt_embeds": "AAAA", "suffix": "x", "include_reasoning": False,
                  "watermarking": True, "thinking_token_budget": 8, "vllm_xargs": {"a": 1},
                  "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"a": 1},
                  "logprob_token_ids": [1], "repetition_detection": {"min_count": 2},
                  "return_token_offsets": True, "routed_experts_prompt_start": 1}
    refused = {name for name, place in FIELDS.items() if place == REFUSED}
    assert refused == set(set_values)
    for name in refused:
        chat = name in ("top_logprobs", "include_reasoning")
        body = (CHAT if chat else BASE) | {name: set_values[name]}
        assert refusal(body, chat=chat) is not None, name


CHAT: dict[str, Any] = {"model": "m", "stream": True,
                        "messages": [{"role": "user", "content": "hi"}]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
IMAGE = {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}


def said(*parts: Any) -> dict[str, Any]:
    """A chat whose user message is made of `parts`."""
    return {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": list(parts)}]}


@pytest.mark.parametrize(("extra", "reason"), [
    ({}, None), ({"logprobs": True}, "logprobs"),
    # Structured output: the grammar's state at the seam is not carried.
    ({"response_format": {"type": "json_object"}}, "structured_output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "structured_output"),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": {"type": "object"}}, "structured_output"),
    ({"guided_choice": ["yes", "no"]}, "structured_output"),
    ({"guided_grammar": "root ::= \"a\""}, "structured_output"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_output"),
    # Tools: the tool-call parser's state is not carried (none runs with "none").
    ({"tools": TOOLS}, "tools"), ({"tools": TOOLS, "tool_choice": "auto"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"functions": [{"name": "f"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "none"}, None),
    # Media: its placeholder ids mean nothing replayed without it.
    (said({"type": "text", "text": "what is this?"}, IMAGE), "multimodal"),
    (said({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
     "multimodal"),
    (said({"type": "video_url", "video_url": {"url": "https://x/a.mp4"}}), "multimodal"),
    (said({"image_url": {"url": "https://x/cat.png"}}), "multimodal"),  # typed by its key
    (said({"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}), None),
    (said("plain", {"type": "text", "text": "parts"}), None),
])
def test_what_may_migrate_on_chat(extra, reason):
    assert refusal(CHAT | extra, chat=True) == reason


@pytest.mark.parametrize("part", [
    {"type": "text", "text": "a"}, {"type": "input_text", "text": "a"},
    {"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "no"},
    {"type": "thinking", "thinking": "hm"}, {"type": "tool_reference", "name": "f"},
    IMAGE, {"image_url": {"url": "u"}}, {"type": "text", "text": "a", "image_url": "u"},
    {"type": "input_image", "image_url": "u"}, {"type": "image_embeds", "image_embeds": "e"},
    {"audio_url": {"url": "u"}}, {"video_embeds": "e"}, {"type": "file", "file": {}},
    {"type": 3}, {"type": ["text"]}, {"text": "no type"},
])
def test_a_message_part_is_media_exactly_where_vllm_reads_it_so(part):
    chat_utils = pytest.importorskip("vllm.renderers.chat_utils")
    media = chat_utils.has_non_text_content(said(part)["messages"])
    assert (refusal(CHAT | said(part), chat=True) == "multimodal") is media


def state(body: dict[str, Any], *, chat: bool = False) -> StreamState:
    s = StreamState(chat=chat, body=body)
    s.prompt_ids = [1, 2, 3]
    return s


def test_the_continuation_carries_every_carried_field_as_sent():
    values = {name: f"v-{name}" for name, place in FIELDS.items() if place == CARRIED}
    s = state(BASE | values)
    s.ids, s.synced = [7], 1
    body = continuation(s)
    assert body is not None
    assert {k: body[k] for k in values} == values


def test_the_continuation_replays_the_context_and_asks_for_what_is_left():
    s = state(BASE | {"temperature": 0, "min_tokens": 6, "user": "u", "echo": False,
                      "ignore_eos": True, "cache_salt": "salt"})
    s.ids, s.synced = [7, 8, 9, 10], 3  # the last id's text was held back
    s.rewind()
    body = continuation(s)
    assert body == {"model": "m", "prompt": [1, 2, 3, 7, 8, 9], "stream": True,
                    "return_token_ids": True, "max_tokens": 7, "min_tokens": 3,
                    "temperature": 0, "user": "u", "ignore_eos": True, "cache_salt": "salt"}


def test_a_chat_continuation_counts_max_completion_tokens():
    s = state({"model": "m", "messages": [], "max_completion_tokens": 5}, chat=True)
    s.ids = [4, 5]
    s.synced = 2
    assert continuation(s)["max_tokens"] == 3  # type: ignore[index]
    s.ids, s.synced = [4, 5, 6, 7, 8], 5
    assert continuation(s) is None  # nothing left: the router ends the stream itself


@given(st.lists(st.tuples(st.integers(0, 50_000), st.sampled_from(["", "a", "é", " b"])),
                min_size=1, max_size=40))
def test_the_seam_is_where_the_client_text_covers_the_ids(chunks):
    """Whatever chunks came, the ids kept for the replay are exactly those up to the
    last chunk that printed text, and the usage adds up over the seam."""
    s = StreamState(chat=False, body=dict(BASE))
    for i, (token, text) in enumerate(chunks):
        s.client_chunk({"id": "c", "choices": [{"index": 0, "text": text, "token_ids": [token],
                                                "prompt_token_ids": [1, 2] if i == 0 else None}]},
                       continuation=False)
    printed = [i for i, (_, text) in enumerate(chunks) if text]
    s.rewind()
    assert s.ids == [t for t, _ in chunks[:printed[-1] + 1]] if printed else s.ids == []
    usage = s.usage({"prompt_tokens": 99, "completion_tokens": 4})
    assert usage["prompt_tokens"] == 2 and usage["completion_tokens"] == len(s.ids) + 4


@given(st.lists(st.tuples(st.lists(st.integers(0, 200_000), max_size=3),
                          st.sampled_from(["", "a", "é", 'say "hi"', '"token_ids":[1]']),
                          st.sampled_from([None, "length", "stop"]), st.booleans()),
                min_size=1, max_size=20),
       st.booleans(), st.booleans(), st.integers(1, 4))
def test_reading_the_bytes_learns_and_writes_what_parsing_does(chunks, chat, wants_ids, per_read):
    """The fast path (vLLM's compact JSON, several events per read, read later in
    runs, no parsing) against parsing every event."""
    def chunk(i: int, ids: list[int], text: str, finish: str | None, usage: bool) -> dict:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish,
                                  "token_ids": ids}
        choice |= {"delta": {"content": text}} if chat else {
            "text": text, "stop_reason": None, "prompt_token_ids": [9, 8] if i == 0 else None}
        out: dict[str, Any] = {"id": "c", "object": "x", "created": 1, "model": "m",
                               "choices": [choice]}
        if chat and i == 0:
            out["prompt_token_ids"] = [9, 8]
        if usage:
            out["usage"] = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
        return out

    sent = [chunk(i, *args) for i, args in enumerate(chunks)]
    fast, slow = (StreamState(chat=chat, body={}, wants_ids=wants_ids) for _ in range(2))
    expected = [slow.client_chunk(json.loads(json.dumps(c)), continuation=False) or c
                for c in sent]
    got: list[dict[str, Any]] = []
    for at in range(0, len(sent), per_read):
        events = [json.dumps(c, separators=(",", ":")).encode() for c in sent[at:at + per_read]]
        block = fast.client_block(b"".join(b"data: " + e + b"\n\n" for e in events))
        got += [json.loads(e[6:]) for e in block.split(b"\n\n") if e]
    fast.learn()
    assert got == expected
    for attr in ("ids", "synced", "prompt_ids", "done", "usage_sent", "finish_reason"):
        assert getattr(fast, attr) == getattr(slow, attr), attr


@pytest.mark.parametrize("raw", [
    b'{"model":"m","stream":true}', b' \n{ "model": "m", "stream": true}',
                                 b'{"model":"m","stream":true,"return_token_ids":false}'])
def test_the_forwarded_request_asks_for_token_ids(raw):
    body = json.loads(raw)
    sent = json.loads(upstream_body(body, raw))
    assert sent == body | {"return_token_ids": True}


@given(pieces=st.lists(st.text(), min_size=1, max_size=20), chat=st.booleans())
def test_with_stop_strings_the_text_sent_is_known_whatever_it_holds(pieces, chat):
    """A stream with stop strings keeps the end of the text its client got (for the
    seam), read from the events' bytes: quotes, backslashes, keys and escapes inside
    the text give what parsing each event would."""
    state = StreamState(chat=chat, body={"stop": ["zz"]})

    def event(i: int, piece: str) -> bytes:
        head = {"id": "x", "created": 1, "model": "m"}
        if i == 0:  # the first event: with the prompt's ids
            head["prompt_token_ids"] = [1, 2]
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None,
                                  "token_ids": [i + 5]}
        choice |= {"delta": {"content": piece}} if chat else {"text": piece}
        return b"data: " + json.dumps(head | {"choices": [choice]}, ensure_ascii=False,
                                      separators=(",", ":")).encode() + b"\n\n"

    for i, piece in enumerate(pieces):
        state.client_block(event(i, piece))
    state.learn()
    text = "".join(pieces)
    assert state.sent.chars == len(text)
    assert state.sent.tail == text[-state.sent.keep:]
    assert state.ids == [i + 5 for i in range(len(pieces))]
