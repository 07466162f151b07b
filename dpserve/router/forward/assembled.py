"""Non-streaming completions that ride on a stream: the router assembles the answer.

A non-streamed completion or chat request is asked of its replica as a stream
(`ride_body`: `stream`, usage at the end, the token ids where it may migrate), and
the router writes the client's one JSON answer from the events (`Assembler`). Then
a non-streamed request has progress the router can watch: a first token the metrics
time, a stall caught by the idle rule of streams (`stream_idle_timeout_s`, not the
600 s of a whole response), and a replica that dies or stalls mid-way continued
elsewhere by token replay (`dpserve.router.migration`) instead of started over. One
that may not migrate fails within the idle rule, its OpenAI error naming why.

The answer is the body vLLM 0.32 would have returned, field for field and in its
order (a test compares the two on a real replica), but for `id` and `created`, which
are the stream's, and `dpserve.migrations` where it moved. Exact where the request
asks for one sequence of text: requests with `n` or `best_of` > 1, beam search,
`echo`, logprobs, tool calls, several prompts, token offsets, routed experts, KV
transfer parameters, `vllm_xargs` or `stream_options` (vLLM refuses that one without
a stream) are forwarded as they are (`assemblable`). `usage` and `metrics` come from
the stream's last event, which vLLM writes without null fields: where an engine
reports more (`--enable-prompt-tokens-details`, `--enable-per-request-metrics`,
speculative decoding) the values are the same, the nested nulls left out.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dpserve.router.asgi import ReplyTracker
from dpserve.router.errors import RouterError, error_body
from dpserve.router.jsonbody import TOO_DEEP, encode

NOT_ASSEMBLED = frozenset({"n", "beam_search", "echo", "logprobs", "tools",
                           "several_prompts", "output_fields", "kv_transfer",
                           "vllm_xargs"})
"""Migration refusals (`eligibility.refusal`) whose whole answer is not the sum of
its stream's events: such requests are forwarded as they came."""

RIDE = {"stream": True, "stream_options": {"include_usage": True}}
"""What a ridden request asks of the engine besides its own fields."""
_RIDE_BYTES = b'"stream":true,"stream_options":{"include_usage":true},'


def assemblable(body: dict[str, Any], why_not_migrated: str | None) -> bool:
    """Whether a non-streamed request's answer can be assembled exactly from a stream.
    `why_not_migrated`: its migration refusal, if any."""
    return why_not_migrated not in NOT_ASSEMBLED and body.get("stream_options") is None


def ride_body(body: dict[str, Any], raw: bytes, *, ids: bool) -> bytes:
    """The request as asked of the engine: a stream with usage at its end (and the
    token ids, with `ids`). `raw` is `body` as received; the fields go in front of its
    first unless it sets one of them (then it is written again)."""
    extra = RIDE | ({"return_token_ids": True} if ids else {})
    start = raw.find(b"{")
    if start < 0 or not body or any(key in body for key in extra):
        encoded = encode(body | extra)
        if encoded is None:
            raise RouterError(400, TOO_DEEP)
        return encoded
    fields = _RIDE_BYTES + (b'"return_token_ids":true,' if ids else b"")
    return raw[:start + 1] + fields + raw[start + 1:]


class Assembler:
    """Where the stream pump writes a ridden request's events (in the place of the
    client's `ReplyTracker`): it reads them and, once the stream ends, answers the
    client with the one JSON body, or the error that ended it."""

    __slots__ = ("_chat", "_choice", "_error", "_events", "_extension", "_fed", "_head", "_limit",
                 "_pieces", "_reasoning", "_replied", "_status", "_top", "finished",
                 "started")

    def __init__(self, replied: ReplyTracker, *, chat: bool, limit: int) -> None:
        self._replied = replied
        self._chat = chat
        self._limit = limit
        """The largest answer the router holds (`max_response_bytes`)."""
        self._fed = 0
        self._status = 200
        self._head: list[tuple[bytes, bytes]] = []
        self._top: dict[str, Any] = {}
        """`id`, `created`, `model`, `system_fingerprint`, `usage`, prompt fields."""
        self._choice: dict[str, Any] = {"finish_reason": None, "stop_reason": None}
        self._pieces: list[bytes] = []
        """The text, as JSON escapes it."""
        self._events: list[bytes] = []
        self._reasoning: list[str] = []
        self._extension: Any = None
        self._error: dict[str, Any] | None = None
        self.started = False
        self.finished = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self._status = status
        self._head = [(k, v) for k, v in headers
                      if k not in (b"content-type", b"content-length", b"cache-control")]

    async def body(self, data: bytes, *, more: bool) -> None:
        self._fed += len(data)
        if self._fed > self._limit:
            raise RouterError(502, f"the response is larger than the router's limit of "
                                   f"{self._limit} bytes")
        self._events.append(data)  # whole events: read at the end, in one pass
        if not more:
            self.finished = True
            self._read_all(b"".join(self._events))
            await self._answer()

    def _read_all(self, block: bytes) -> None:
        """Every event of the stream. Where they are vLLM's compact JSON of one choice,
        the text and ids of all are found by a scan of the bytes (the text decoded
        once, at the end), and only the events that say more are parsed: the first,
        the end, usage. A key cannot occur inside a string value (its quotes are escaped
        there), so a match is the field itself. Else each event is parsed."""
        if any(x in block for x in _PARSED) or (
                block.count(b'"index":') != block.count(b'"index":0,')):
            for event in block.replace(b"\r\n", b"\n").split(b"\n\n"):
                if event.startswith(b"data: {"):
                    self._read(json.loads(event[6:]))
            return
        self._pieces = (_CONTENT if self._chat else _TEXT).findall(block)
        if found := _IDS.findall(block):
            ids = b",".join(x for x in found if x)
            self._choice["token_ids"] = [int(x) for x in ids.split(b",")] if ids else []
        # The events that say more than text: the first, the end, usage (with the
        # router's `dpserve` field, on the end's).
        starts = {block.find(b"data: {")}
        for key in (b'"finish_reason":"', b'"usage":{', b'"dpserve"'):
            if (at := block.rfind(key)) >= 0:
                starts.add(block.rfind(b"data: {", 0, at))
        for at in sorted(starts - {-1}):
            end = block.find(b"\n\n", at)
            self._read(json.loads(block[at + 6:end if end >= 0 else len(block)]), text=False)

    def _read(self, chunk: dict[str, Any], *, text: bool = True) -> None:
        """One event, parsed; `text`: its text and ids too (else found by the scan)."""
        if "error" in chunk:
            self._error = chunk
            return
        top = self._top
        if not top:
            top.update((k, chunk.get(k)) for k in ("id", "created", "model"))
        for key in ("system_fingerprint", "prompt_token_ids", "prompt_text", "usage",
                    "metrics"):
            if chunk.get(key) is not None:
                top[key] = chunk[key]
        if "dpserve" in chunk:
            self._extension = chunk["dpserve"]
        for choice in chunk.get("choices") or ():
            if not self._chat and choice.get("prompt_token_ids") is not None:
                top["prompt_token_ids"] = choice["prompt_token_ids"]
            if text:
                if self._chat:
                    delta = choice.get("delta") or {}
                    self._pieces.append(_escaped(delta.get("content") or ""))
                    if delta.get("reasoning"):
                        self._reasoning.append(delta["reasoning"])
                else:
                    self._pieces.append(_escaped(choice.get("text") or ""))
                if choice.get("token_ids") is not None:
                    self._choice.setdefault("token_ids", []).extend(choice["token_ids"])
            if choice.get("finish_reason") is not None:
                self._choice["finish_reason"] = choice["finish_reason"]
                self._choice["stop_reason"] = choice.get("stop_reason")

    async def _answer(self) -> None:
        status, body = self._status, self._assembled()
        if self._error is not None or self._choice["finish_reason"] is None:
            status, body = self._failure()
        headers = [*self._head, (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        await self._replied.start(status, headers)
        await self._replied.body(body, more=False)

    def _failure(self) -> tuple[int, bytes]:
        """The error that ended the stream, as a whole answer's: its status where it
        names one (the engine's, or the router's 502), else 502."""
        if self._error is None:
            return 502, error_body(502, "the replica's stream ended before its last token")
        error = self._error.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code <= 599 else 502
        return status, _dumps(self._error)

    def _assembled(self) -> bytes:
        top, choice = self._top, self._choice
        text = json.loads(b'"' + b"".join(self._pieces) + b'"')
        ids = choice.get("token_ids")
        usage = top.get("usage") or {}
        usage = {k: usage.get(k) for k in ("prompt_tokens", "total_tokens",
                                           "completion_tokens", "prompt_tokens_details",
                                           "completion_tokens_details")}
        head = {"id": top.get("id"), "object": "chat.completion" if self._chat
                else "text_completion", "created": top.get("created"),
                "model": top.get("model")}
        end = {"service_tier": None, "system_fingerprint": top.get("system_fingerprint"),
               "usage": usage}
        if self._chat:
            message = {"role": "assistant", "content": text, "refusal": None,
                       "annotations": None, "audio": None, "function_call": None,
                       "reasoning": "".join(self._reasoning) or None}
            out = head | {"choices": [{
                "index": 0, "message": message, "logprobs": None,
                "finish_reason": choice["finish_reason"], "stop_reason": choice["stop_reason"],
                "token_ids": ids, "routed_experts": None}]} | end | {
                "prompt_logprobs": None, "prompt_token_ids": top.get("prompt_token_ids"),
                "prompt_text": top.get("prompt_text")}
        else:
            out = head | {"choices": [{
                "index": 0, "text": text, "logprobs": None,
                "finish_reason": choice["finish_reason"], "stop_reason": choice["stop_reason"],
                "token_ids": ids, "prompt_logprobs": None,
                "prompt_token_ids": top.get("prompt_token_ids"), "routed_experts": None}]} | end
        out |= {"kv_transfer_params": None, "ec_transfer_params": None,
                "metrics": top.get("metrics")}
        if self._extension is not None:
            out["dpserve"] = self._extension
        return _dumps(out)


_TEXT = re.compile(rb'"text":"((?:[^"\\]|\\.)*)"')
_CONTENT = re.compile(rb'"content":"((?:[^"\\]|\\.)*)"')
_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')
_PARSED = (b'"error"', b'"reasoning', b'": ', b'"tool_calls"', b"\r")
"""What makes `_read_all` parse every event: an error, reasoning, tool calls, JSON
written with spaces or CRLF line ends."""


def _escaped(text: str) -> bytes:
    """`text` as the inside of a JSON string."""
    return json.dumps(text).encode()[1:-1]


def _dumps(value: Any) -> bytes:
    """As vLLM's server writes a JSON answer (Starlette's `JSONResponse`)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode()
