"""The fake engine's token model: greedy generation a test can predict, for migration.

Part of the shared fake engine (`tests.fakes.FakeReplica` with `tokens=True`), kept
in its own file because it is a small model, not a fault. One token per character
(`ord`); a chat's prompt is its messages' contents joined by newlines. The next
token is a function of the whole context, so a continuation given the context
replayed produces what an uninterrupted run would, exactly as greedy decoding on a
real engine does. Some tokens are the first half of a character (`HALF + c`): their
text is held back (the chunk carries the id and empty text) until the second half
(`WHOLE + c`) comes, like vLLM's detokenizer with a UTF-8 character split across
tokens. A prompt that ends in a first half makes the continuation's text start with
garbage, like vLLM's (which printed the prompt again): replaying ids past the text
the client has is visible. Stop strings behave as vLLM 0.32's: the text that could
begin one is held back (`len(longest) - 1` characters) unless
`include_stop_str_in_output`, the match completing earliest ends the generation (not
before `min_tokens`), and
`detokenize` prints U+FFFD for a trailing half character.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

HALF = 0x110000
WHOLE = 0x220000
SPLIT_CHAR = "é"
GARBAGE = "<garbage>"


def rendered(messages: list[dict[str, Any]]) -> str:
    """A chat's prompt as the fake renders it: its messages' text, one a line (a part
    that is not text, an image, adds nothing)."""
    return "\n".join(m["content"] if isinstance(m["content"], str) else "".join(
        p if isinstance(p, str) else p.get("text", "") for p in m["content"])
        for m in messages)


def prompt_ids(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        return [ord(c) for c in rendered(body["messages"])]
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt]


def next_token(context: list[int]) -> int:
    last = context[-1] if context else 0
    if HALF <= last < WHOLE:
        return last - HALF + WHOLE
    h = (sum(context) * 31 + len(context)) % 7
    return HALF + ord(SPLIT_CHAR) if h == 0 else ord("a") + (sum(context) + len(context)) % 26


def text_of(token: int) -> str:
    if token >= WHOLE:
        return chr(token - WHOLE)
    return "" if token >= HALF else chr(token)


def detokenize(ids: list[int]) -> str:
    """`POST /detokenize`: a trailing first half is not a character yet."""
    tail = "\ufffd" if ids and HALF <= ids[-1] < WHOLE else ""
    return "".join(text_of(t) for t in ids) + tail


def first_stop(text: str, new: int, stops: list[str]) -> tuple[str, int] | None:
    """vLLM's `check_stop_strings`: the match completing earliest in the new text."""
    best: tuple[str, int] | None = None
    for stop in stops:
        at = text.find(stop, max(0, len(text) + 1 - new - len(stop)))
        if at >= 0 and (best is None or at + len(stop) < best[1] + len(best[0])):
            best = (stop, at)
    return best


def expected_stream(body: dict[str, Any], n: int) -> tuple[str, str | None, int]:
    """An uninterrupted run's text, stop string matched and completion tokens."""
    stops = _stops(body)
    include = body.get("include_stop_str_in_output") is True
    min_tokens = int(body.get("min_tokens") or 0)
    context, text = prompt_ids(body), ""
    for i in range(n):
        context.append(next_token(context))
        piece = text_of(context[-1])
        text += piece
        if piece and i + 1 > min_tokens and (match := first_stop(text, len(piece), stops)):
            stop, at = match
            return text[:at + len(stop) if include else at], stop, i + 1
    return text, None, n


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop") or []
    return [stop] if isinstance(stop, str) else list(stop)


def generate(context: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(context + out))
    return out


def expected_text(body: dict[str, Any], n: int) -> str:
    """What an uninterrupted greedy run of `n` tokens prints."""
    return "".join(text_of(t) for t in generate(prompt_ids(body), n))


def length(body: dict[str, Any], prompt_len: int, *, chat: bool,
           max_model_len: int | None) -> int:
    """Tokens a request generates (less if a stop comes first). With `max_model_len`, as
    vLLM 0.32 reads its limit: `"3"` and `3.0` are 3; a chat without one runs to the
    context length; a completion without one (or with null) stops at 16; a limit past
    the context's room is cut to it. Without it, 16 whenever no limit is given."""
    def number(value: Any) -> int | None:
        return None if value is None else int(float(value))
    limit = number(body.get("max_completion_tokens")) if chat else None
    if limit is None:
        limit = number(body.get("max_tokens"))
    if limit is None and not chat:
        limit = 16
    if max_model_len is None:
        return limit or 16
    room = max_model_len - prompt_len
    return room if limit is None else min(limit, room)


async def stream(request: web.Request, body: dict[str, Any], *, name: str, fingerprint: str,
                 cut_after: int | None, hang_after: int | None,
                 delay_s: float, hang_at_end: bool = False,
                 before_first: Callable[[web.Request], Awaitable[bool]] | None = None,
                 max_model_len: int | None = None, per_chunk: int = 1) -> web.StreamResponse:
    """Answer a streaming completion or chat as vLLM 0.32 does with `return_token_ids`.
    `cut_after` tokens: the connection closes (a replica killed); `hang_after`: nothing
    more is sent (a stalled engine); `hang_at_end`: `[DONE]` is sent, then nothing, the
    response never ended (an engine stopped between its last event and the end);
    `before_first`: awaited after the head went out, before the first event (False:
    the client left meanwhile); `max_model_len`: see `length`; `per_chunk`: tokens
    merged into one chunk, as vLLM merges outputs when its reader falls behind."""
    chat = "messages" in body
    ids = body.get("return_token_ids") is True
    prompt = prompt_ids(body)
    n = length(body, len(prompt), chat=chat, max_model_len=max_model_len)
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{name}", "created": 1700000000,
            "model": body.get("model"),
            "object": "chat.completion.chunk" if chat else "text_completion"}
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    if before_first is not None and not await before_first(request):
        return resp  # queued or in prefill when the client left: nothing more is sent

    async def send(chunk: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(head | chunk, separators=(",", ":")).encode()
                         + b"\n\n")

    if chat:
        await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}],
                    "prompt_token_ids": prompt if ids else None})
    garbage = bool(prompt) and HALF <= prompt[-1] < WHOLE
    context = list(prompt)
    stops = _stops(body)
    include = body.get("include_stop_str_in_output") is True
    min_tokens = int(body.get("min_tokens") or 0)
    hold = max(map(len, stops), default=1) - 1 if not include else 0
    output, sent = "", 0  # vLLM's output text, and how much of it went out
    merged: list[int] = []  # tokens not sent yet (`per_chunk`)
    merged_text, first = "", True
    for i in range(n):
        if cut_after is not None and i == cut_after:
            assert request.transport is not None
            request.transport.close()
            return resp
        if hang_after is not None and i == hang_after:
            await asyncio.sleep(3600)
        token = next_token(context)
        context.append(token)
        piece = (GARBAGE if garbage and i == 0 else "") + text_of(token)
        output += piece
        finish = "length" if i == n - 1 else None
        stop = first_stop(output, len(piece), stops) if piece and i + 1 > min_tokens else None
        if stop is not None:
            output = output[:stop[1] + len(stop[0]) if include else stop[1]]
            finish = "stop"
        end = len(output) if finish else max(sent, len(output) - hold)
        text, sent = output[sent:end], end
        merged.append(token)
        merged_text += text
        if not finish and len(merged) < per_chunk:
            continue
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish,
                                  "token_ids": merged if ids else None}
        if chat:
            choice["delta"] = {"content": merged_text}
        else:
            choice |= {"text": merged_text, "stop_reason": stop[0] if stop else None,
                       "prompt_token_ids": prompt if ids and first else None}
        if chat and finish:
            choice["stop_reason"] = stop[0] if stop else None
        await send({"choices": [choice]})
        merged, merged_text, first = [], "", False
        if finish:
            n = i + 1
            break
        if delay_s:
            await asyncio.sleep(delay_s)
    if cut_after is not None and cut_after == n:  # after the last token, before the end
        assert request.transport is not None
        request.transport.close()
        return resp
    if (body.get("stream_options") or {}).get("include_usage"):
        await send({"choices": [], "usage": {"prompt_tokens": len(prompt),
                                             "completion_tokens": n,
                                             "total_tokens": len(prompt) + n},
                    "system_fingerprint": fingerprint})
    await resp.write(b"data: [DONE]\n\n")
    if hang_at_end:
        await asyncio.sleep(3600)
    await resp.write_eof()
    return resp
