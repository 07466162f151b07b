"""A request body's prompt token ids as a vLLM 0.32 engine of a Hugging Face model gets
them, from the model's tokenizer files, without vLLM.

vLLM loads the tokenizer with `transformers.AutoTokenizer` and tokenizes text by calling
it (`vllm/renderers/base.py`, `_tokenize_prompt`):

- completions: ``tokenizer(prompt, add_special_tokens=...)``, True by default (the
  BOS a Llama tokenizer adds). Token ids are taken as they are.
- chat: ``tokenizer.apply_chat_template(conversation, tools=..., tokenize=False, ...)``
  renders text, then ``tokenizer(text, add_special_tokens=False)`` unless the body asks
  for special tokens (`chat.py` says how the conversation and arguments are built).

The text goes through the tokenizer's Rust backend directly (`encode_batch_fast` on a
private copy of it) rather than through `tokenizer(...)`: the ids are the same (the
tests compare them), it is ~1.5x faster, and it holds the GIL for none of the work,
where `tokenizer(...)` holds it ~1 ms per 8k tokens to build offsets nobody reads. A
tokenizer class that encodes in Python (not the plain Rust-backed one) is called as
vLLM calls it, under a lock, since a call resets its backend's truncation.

vLLM also truncates at the model's context length; a prompt that long is refused by
the engine, so it is not truncated here. Not reproduced, and so not served: a server
`--chat-template` given as a file path (pass the template's text), multimodal models
whose processor brings its own template (chat is off for a model directory with a
processor config unless a template is given), Mistral and Harmony (gpt-oss) tokenizer
modes, and sentence-transformers' lower-casing.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PythonBackend, TokenizersBackend
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dpserve.router.kv.chat import ChatRequest, conversation, parse_chat
from dpserve.router.kv.prompt import Budget, ChatSettings, Job, TokenIds
from dpserve.router.kv.templates import TemplateFacts, read_template

_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.json")
_NAMED_ARGS = frozenset({"tools", "chat_template", "tokenize"})


class HfPromptEncoder:
    """Prompts of the model in `model_dir` (its tokenizer files), rendered as a vLLM
    server started with `chat` renders them. Loading takes well under a second for a
    small vocabulary; then it is safe to use from several threads at once."""

    def __init__(self, model_dir: str | Path, chat: ChatSettings | None = None) -> None:
        self._chat = chat or ChatSettings()
        self._tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        self._chat_on = self._chat.chat_template is not None or not any(
            (Path(model_dir) / f).exists() for f in _PROCESSOR_FILES)
        self._encode = self._rust_encoder() or self._locked_encoder()
        # vLLM passes a template argument on if the template reads it or
        # apply_chat_template takes it by name (`resolve_chat_template_kwargs`): the base
        # class's, and a slow tokenizer's own (vLLM wraps a Rust-backed one's in a
        # thread pool whose signature names nothing).
        named: list[Callable[..., Any]] = [PythonBackend.apply_chat_template]
        if not isinstance(self._tok, TokenizersBackend):
            named.append(self._tok.apply_chat_template)
        self._named = frozenset(
            name for fn in named for name, p in inspect.signature(fn).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)) - _NAMED_ARGS
        self._facts: dict[str, TemplateFacts] = {}

    def _rust_encoder(self) -> Callable[[str, bool], list[int]] | None:
        cls = type(self._tok)
        if not (isinstance(self._tok, TokenizersBackend)
                and cls._encode_plus is TokenizersBackend._encode_plus
                and cls.__call__ is PreTrainedTokenizerBase.__call__):
            return None
        backend = self._tok.backend_tokenizer.from_str(self._tok.backend_tokenizer.to_str())
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(self._tok.split_special_tokens)

        def encode(text: str, special: bool) -> list[int]:
            return backend.encode_batch_fast([text], add_special_tokens=special)[0].ids

        return encode

    def _locked_encoder(self) -> Callable[[str, bool], list[int]]:
        lock = threading.Lock()

        def encode(text: str, special: bool) -> list[int]:
            with lock:
                return list(self._tok(text, add_special_tokens=special)["input_ids"])

        return encode

    def prepare(self, route: str, body: dict[str, Any], budget: Budget) -> Job | None:
        if route == "/v1/completions":
            return self._completion(body, budget)
        if route == "/v1/chat/completions" and self._chat_on:
            request = parse_chat(
                body, budget, server_template=self._chat.chat_template,
                default_kwargs=self._chat.default_chat_template_kwargs,
                exclude_tools_when_tool_choice_none=self._chat.exclude_tools_when_tool_choice_none)
            if request is None:
                return None
            # The messages as parsed (frozen, hashable: each text hashed once, ~1 us per
            # 3k characters) and the small arguments as JSON (exact: true is not 1).
            # Dumping the whole body instead cost 50 us for 8k tokens of chat.
            kwargs = {k: v for k, v in request.kwargs.items() if k != "chat_template"}
            key = (route, request.messages, request.add_special_tokens,
                   json.dumps(kwargs, separators=(",", ":")))
            return Job(key, lambda: self._render(request))
        return None

    def _completion(self, body: dict[str, Any], budget: Budget) -> Job | None:
        if any(body.get(f) is not None for f in ("suffix", "prompt_embeds", "cache_salt",
                                                 "truncate_prompt_tokens",
                                                 "kv_transfer_params")):
            return None
        special = body.get("add_special_tokens", True)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if not isinstance(special, bool):
            return None
        if isinstance(prompt, str):
            if not prompt or not budget.spend(len(prompt)):
                return None
            text = prompt
            return Job(("completion", special, text),
                       lambda: tuple(self._encode(text, special)))
        if isinstance(prompt, list) and prompt and budget.spend(len(prompt), 0):
            ids = prompt  # checked and copied by the worker: ~3 ms per 100k ids
            return Job(None, lambda: _token_ids(ids))
        return None

    def _render(self, request: ChatRequest) -> TokenIds | None:
        kwargs = request.kwargs
        tools = kwargs.get("tools")
        template = self._tok.get_chat_template(kwargs.get("chat_template"), tools=tools)
        facts = self._facts.get(template)
        if facts is None:
            facts = self._facts[template] = read_template(template)
        text = self._tok.apply_chat_template(
            conversation(request, facts), tools=tools, chat_template=template, tokenize=False,
            **{k: v for k, v in kwargs.items()
               if k not in _NAMED_ARGS and (k in self._named or k in facts.variables)})
        if not isinstance(text, str):
            return None
        return tuple(self._encode(text, request.add_special_tokens))


def _token_ids(ids: list[Any]) -> TokenIds | None:
    copied = tuple(ids)
    if all(type(t) is int and t >= 0 for t in copied):
        return copied
    return None
