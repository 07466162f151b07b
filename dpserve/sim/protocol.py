"""The OpenAI request and response shapes a simulated replica speaks, as vLLM 0.32
writes them. Pure functions: no I/O, no engine.

Understood: `model`, `prompt` (a string, one string in a list, or token ids),
`messages` (text content; the chat template below), `max_tokens` (chat also
`max_completion_tokens`), `stream`, `stream_options.include_usage`. Accepted
and ignored: sampling settings, `ignore_eos` (the simulated model never stops
early, so every request finishes with reason `length`), `stop`, `seed`, `user`.
Refused with 400: several prompts in one request and `n` > 1.

Chat template: each message becomes ``<|role|>`` and its text, then
``<|assistant|>``; the prompt is that text's pseudo-tokens (tokenizer.py).
"""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Literal

from dpserve.sim import tokenizer
from dpserve.sim.config import SimConfig

Kind = Literal["completion", "chat"]


class ProtocolError(Exception):
    """A request vLLM would refuse; answered with `status` in OpenAI's error envelope."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Kind
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    logprobs: bool = False
    """A completion asked for the chosen tokens' logprobs (`logprobs` >= 0)."""
    lora: str | None = None
    """The LoRA adapter the request names as its `model` (None: the base model)."""


def parse(kind: Kind, body: Any, config: SimConfig,
          adapters: Container[str] = ()) -> GenerationRequest:
    """Validate a completions or chat body; raise ProtocolError as vLLM would. `model`
    may name the base model or one of `adapters` (the LoRA adapters loaded)."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    lora = (model if isinstance(model, str) and model != config.model and model in adapters
            else None)
    if model and model != config.model and lora is None:
        raise ProtocolError(f"The model `{model}` does not exist. Valid aliases: "
                            f"{config.model}.", status=404, param="model")
    if body.get("n", 1) != 1:
        raise ProtocolError("the simulator serves n=1 only", param="n")
    ids = prompt_ids(kind, body)
    limit = config.max_model_len
    if not ids:
        raise _invalid("Either prompt or prompt_embeds must be provided and non-empty.",
                       "prompt")
    if len(ids) >= limit:
        raise _invalid(f"This model's maximum context length is {limit} tokens. However, your "
                       f"prompt contains at least {len(ids)} input tokens, which exceeds this "
                       "limit even without any output tokens. Please reduce the length of the "
                       "input prompt.", "input_tokens", len(ids))
    max_tokens = body.get("max_completion_tokens") if kind == "chat" else None
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    if max_tokens is None:
        max_tokens = limit
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _invalid(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens",
                       max_tokens)
    if max_tokens > limit:
        raise _invalid(f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
                       "Please request fewer output tokens.", "max_tokens", max_tokens)
    # Like vLLM 0.32, a completion that would overrun the context is cut there.
    max_tokens = min(max_tokens, limit - len(ids))
    options = body.get("stream_options") or {}
    stream = bool(body.get("stream", False))
    return GenerationRequest(kind, ids, max_tokens, stream,
                             stream and isinstance(options, dict)
                             and bool(options.get("include_usage")),
                             logprobs=kind != "chat" and body.get("logprobs") not in (None, False),
                             lora=lora)


def _invalid(message: str, param: str, value: Any = None) -> ProtocolError:
    suffix = f" (parameter={param})" if value is None else f" (parameter={param}, value={value})"
    return ProtocolError(message + suffix, param=param)


def prompt_ids(kind: Kind, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as the simulated engine sees them (chat rendered with the
    template above); raises ProtocolError for a prompt it refuses."""
    return _chat_prompt(body.get("messages")) if kind == "chat" else _prompt(body.get("prompt"))


def tokenize_body(body: Any) -> list[int]:
    """Prompt ids of a `/tokenize` body: `{"prompt": ...}` or `{"messages": [...]}`."""
    if isinstance(body, dict) and "messages" in body:
        return _chat_prompt(body["messages"])
    return _prompt(body.get("prompt") if isinstance(body, dict) else None)


def _prompt(prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in prompt):
        if any(t < 0 for t in prompt):
            raise ProtocolError("token ids must not be negative", param="prompt")
        return list(prompt)  # any model's ids: only their count and equality matter
    raise ProtocolError("prompt must be a string or a list of token ids (one prompt per "
                        "request in the simulator)", param="prompt")


def _chat_prompt(messages: Any) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list", param="messages")
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            raise ProtocolError("each message must be an object", param="messages")
        content = m.get("content") or ""
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|> {content}")
    parts.append("<|assistant|>")
    return tokenizer.encode(" ".join(parts))


# --- responses ---------------------------------------------------------------------------


LOGPROB = -0.5
"""Every simulated token's logprob: finite, below 0, as a sane model's."""


def output_text(prompt_ids: list[int], start: int, count: int) -> str:
    """Text of output tokens `start .. start+count-1`: deterministic pseudo-tokens, each
    a space and two characters, so the text re-encodes to `count` tokens."""
    return "".join(_output_pieces(prompt_ids, start, count))


def _output_pieces(prompt_ids: list[int], start: int, count: int) -> list[str]:
    return [" " + tokenizer.spell(i) for i in tokenizer.output_ids(prompt_ids, start, count)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def full_response(req: GenerationRequest, rid: str, created: int, model: str,
                  text: str, completion_tokens: int, finish_reason: str) -> dict[str, Any]:
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None, "prompt_logprobs": None}
        if req.logprobs:  # what a router's warm-up and a deploy's canary check
            pieces = _output_pieces(req.prompt_ids, 0, completion_tokens)
            offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
            choice["logprobs"] = {"tokens": pieces, "token_logprobs": [LOGPROB] * len(pieces),
                                  "top_logprobs": None, "text_offset": offsets}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(len(req.prompt_ids), completion_tokens)}


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class ChunkWriter:
    """Builds the stream's events: per output token one chunk (the last one carrying
    `finish_reason`), for chat a first chunk with the role, then the usage chunk
    when asked for, then ``[DONE]``. Token chunks are filled into a template rather
    than serialized one by one: they are the simulator's hottest path, and output
    text never needs JSON escaping."""

    def __init__(self, req: GenerationRequest, rid: str, created: int, model: str) -> None:
        self._req = req
        chat = req.kind == "chat"
        self._head = {"id": rid, "object": "chat.completion.chunk" if chat
                      else "text_completion", "created": created, "model": model}
        head = json.dumps(self._head, separators=(",", ":"))[:-1]
        if chat:
            self._open = f'data: {head},"choices":[{{"index":0,"delta":{{"content":"'
            self._close = ('"},"logprobs":null,"finish_reason":', "}]}\n\n")
        else:
            self._open = f'data: {head},"choices":[{{"index":0,"text":"'
            self._close = ('","logprobs":null,"finish_reason":', ',"stop_reason":null}]}\n\n')

    def start(self) -> bytes:
        if self._req.kind != "chat":
            return b""
        return sse({**self._head, "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]})

    def tokens(self, start: int, count: int, finish_reason: str | None) -> bytes:
        """Events of output tokens `start .. start+count-1`, one chunk each."""
        middle, end = self._close
        pieces = _output_pieces(self._req.prompt_ids, start, count)
        last = "null" if finish_reason is None else json.dumps(finish_reason)
        events = [self._open + p + middle + "null" + end for p in pieces[:-1]]
        events.append(self._open + pieces[-1] + middle + last + end)
        return "".join(events).encode()

    def end(self, completion_tokens: int) -> bytes:
        tail = b""
        if self._req.include_usage:
            tail = sse({**self._head, "choices": [],
                        "usage": usage(len(self._req.prompt_ids), completion_tokens)})
        return tail + sse("[DONE]")
