"""A chat request's messages as vLLM 0.32 hands them to the chat template, for text.

vLLM validates the body (pydantic), turns each message into a *conversation* message
(`vllm/renderers/chat_utils.py`: `_parse_chat_message_content`, `_postprocess_messages`),
merges the template arguments from the body and the server (`ChatParams`, `merge_kwargs`)
and renders (`vllm/renderers/hf.py`: `safe_apply_chat_template`). This module does the
first three for the shapes whose rendering it can reproduce exactly, and refuses the
rest with None:

- content: a string, null, or a list of text parts (`text`, `input_text`,
  `output_text`, `refusal`, `thinking`). Images, audio, embeddings
  and unknown part types are refused: their placeholders are the multimodal
  processor's business.
- message keys: `role`, `content`, `name`, `tool_calls` (function calls, on assistant
  messages), `tool_call_id` (tool messages), `reasoning`/`reasoning_content`. Any
  other key is refused, since vLLM's validation keeps or drops it by which of its
  message types the dict happens to match.
- body fields that change the prompt: `tools` (function tools, dumped as vLLM's
  pydantic model dumps them), `tool_choice`, `documents`, `reasoning_effort`,
  `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`,
  `add_special_tokens`. A request's own `chat_template`, `cache_salt` (the index cannot
  key salted blocks), `truncate_prompt_tokens` and `kv_transfer_params` are refused.

Hostile input is the normal case: every walk is bounded by a `Budget` of characters
and items, and types are checked as strictly as pydantic's, or stricter (a string
`"true"` for a bool is refused rather than coerced). `parse_chat` runs on the event
loop: it only checks and measures. `conversation` builds the template's input and
runs beside the rendering, off the loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dpserve.router.kv.prompt import Budget, is_json
from dpserve.router.kv.templates import TemplateFacts

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal", "thinking": "thinking"}
"""Text part types and the key that holds their text (vLLM's `MM_PARSER_MAP`)."""
_PART_KEYS = {"text": {"type", "text"}, "refusal": {"type", "refusal"},
              "thinking": {"type", "thinking", "closed"}}
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                           "reasoning", "reasoning_content"})
_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
_REFUSED_FIELDS = ("chat_template", "cache_salt", "truncate_prompt_tokens",
                   "kv_transfer_params", "prompt_embeds")
_BILLING_HEADER = "x-anthropic-billing-header"


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    texts: tuple[str, ...]
    """The content's text parts (a string content is one part; null is none)."""
    name: str | None = None
    tool_calls: tuple[tuple[str, str, str], ...] | None = None
    """(id, function name, arguments) per call."""
    tool_call_id: str | None = None
    reasoning: str | None = None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[Message, ...]
    kwargs: dict[str, Any]
    """vLLM's merged template arguments, `tools` and `chat_template` included."""
    add_special_tokens: bool


def _merge(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `merge_kwargs`: an override of None or "auto" leaves the default."""
    return defaults | {k: v for k, v in overrides.items()
                       if not (v is None or (isinstance(v, str) and v == "auto"))}


def parse_chat(body: dict[str, Any], budget: Budget, *, server_template: str | None,
               default_kwargs: dict[str, Any],
               exclude_tools_when_tool_choice_none: bool) -> ChatRequest | None:
    """The request in `body`, or None where vLLM's prompt for it cannot be reproduced."""
    if any(body.get(f) is not None for f in _REFUSED_FIELDS):
        return None
    flags = [body.get(f, d) for f, d in (("add_generation_prompt", True),
                                         ("continue_final_message", False),
                                         ("add_special_tokens", False))]
    if not all(isinstance(f, bool) for f in flags) or (flags[0] and flags[1]):
        return None
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw or not budget.spend(0, len(raw)):
        return None
    messages = []
    for m in raw:
        message = _message(m, budget)
        if message is None:
            return None
        messages.append(message)
    tools = _tools(body, budget, exclude_tools_when_tool_choice_none)
    documents = body.get("documents")
    effort = body.get("reasoning_effort")
    user = body.get("chat_template_kwargs")
    if (tools is False
            or not (effort is None or (isinstance(effort, str) and effort in _REASONING_EFFORTS))
            or not (documents is None or _documents_ok(documents, budget))
            or not (user is None or (isinstance(user, dict) and is_json(user, budget)))):
        return None
    user = user or {}
    if user.get("chat_template") is not None:
        return None  # vLLM refuses a template sent with the request
    extra: dict[str, Any] = {"add_generation_prompt": flags[0],
                             "continue_final_message": flags[1],
                             "documents": documents, "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    kwargs = _merge(_merge(default_kwargs, {"tools": tools, "tokenize": False}),
                    _merge(user, extra))
    kwargs = _merge(kwargs, {"chat_template": server_template, "return_dict": False})
    if kwargs.get("tokenize"):
        return None  # the template would hand vLLM token ids straight away
    return ChatRequest(tuple(messages), kwargs, flags[2])


def _message(m: Any, budget: Budget) -> Message | None:
    if not isinstance(m, dict) or not m.keys() <= _MESSAGE_KEYS:
        return None
    role, content, name = m.get("role"), m.get("content"), m.get("name")
    reasoning = m.get("reasoning")
    if reasoning is None:
        reasoning = m.get("reasoning_content")
    if (not isinstance(role, str) or not (name is None or isinstance(name, str))
            or not (reasoning is None or isinstance(reasoning, str))
            or not budget.spend(len(role) + len(name or "") + len(reasoning or ""))):
        return None
    if ("name" in m and name is None) or ("content" in m and content is None
                                         and role != "assistant"):
        return None  # refused by vLLM's validation
    texts = _texts(content, role, budget)
    if texts is None:
        return None
    calls = m.get("tool_calls")
    call_id = m.get("tool_call_id")
    if calls is not None:
        if role != "assistant" or (calls := _tool_calls(calls, budget)) is None:
            return None
    if "tool_call_id" in m and (role != "tool" or not isinstance(call_id, str)):
        return None
    return Message(role, texts, name, calls, call_id, reasoning)


def _texts(content: Any, role: str, budget: Budget) -> tuple[str, ...] | None:
    if content is None:
        return ()
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]  # as vLLM does, before the header
    elif not isinstance(content, list) or not budget.spend(0, len(content)):
        return None
    texts = []
    for part in content:
        if isinstance(part, dict) and isinstance(kind := part.get("type"), str) and (
                key := TEXT_PARTS.get(kind)):
            value = part.get(key)
            if not isinstance(value, str) or not part.keys() <= _PART_KEYS[key] or not (
                    part.get("closed") is None or isinstance(part["closed"], bool)):
                return None
            text = value
        else:
            return None
        if role == "system" and text.startswith(_BILLING_HEADER) and part["type"] == "text":
            text = text.partition("\n")[2]  # vLLM drops the per-request header line
            if not text:
                continue
        if not budget.spend(len(text)):
            return None
        texts.append(text)
    return tuple(texts)


def _tool_calls(calls: Any, budget: Budget) -> tuple[tuple[str, str, str], ...] | None:
    if not isinstance(calls, list) or not budget.spend(0, len(calls)):
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict) or call.keys() != {"id", "type", "function"}:
            return None
        function = call["function"]
        if call["type"] != "function" or not isinstance(function, dict) or (
                function.keys() != {"name", "arguments"}):
            return None
        ident, name, arguments = call["id"], function["name"], function["arguments"]
        if not (isinstance(ident, str) and isinstance(name, str) and isinstance(arguments, str)
                and budget.spend(len(ident) + len(name) + len(arguments))):
            return None
        out.append((ident, name, arguments))
    return tuple(out)


def _tools(body: dict[str, Any], budget: Budget,
           exclude_on_none: bool) -> list[dict[str, Any]] | bool | None:
    """The tools as vLLM dumps them for the template; None for none; False: refused."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice is not None and not (isinstance(choice, str) and choice == "none") and not (
            tools and (choice in ("auto", "required") or _names_a_tool(choice, tools))):
        return False  # vLLM's validation refuses the choice
    if tools is None or (exclude_on_none and choice == "none"):
        return None
    if not isinstance(tools, list) or not tools or not budget.spend(0, len(tools)):
        return False
    dumped = []
    for tool in tools:
        if not isinstance(tool, dict) or not tool.keys() <= {"type", "function"}:
            return False
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or (
                not function.keys() <= {"name", "description", "parameters", "strict"}):
            return False
        name, description = function.get("name"), function.get("description")
        parameters, strict = function.get("parameters"), function.get("strict")
        if not (isinstance(name, str) and (description is None or isinstance(description, str))
                and (parameters is None or isinstance(parameters, dict))
                and (strict is None or isinstance(strict, bool))
                and budget.spend(len(name) + len(description or ""))
                and is_json(parameters, budget)):
            return False
        spec: dict[str, Any] = {"name": name, "description": description,
                                "parameters": parameters}
        if strict is not None:
            spec["strict"] = strict
        dumped.append({"type": "function", "function": spec})
    return dumped


def _names_a_tool(choice: Any, tools: Any) -> bool:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return isinstance(name, str) and bool(name) and isinstance(tools, list) and any(
        isinstance(t, dict) and isinstance(t.get("function"), dict)
        and t["function"].get("name") == name for t in tools)


def _documents_ok(documents: Any, budget: Budget) -> bool:
    return isinstance(documents, list) and budget.spend(0, len(documents)) and all(
        isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str)
                                    and budget.spend(len(k) + len(v)) for k, v in d.items())
        for d in documents)


# --- the template's input (off the loop) ------------------------------------------------


def conversation(request: ChatRequest, facts: TemplateFacts) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the template described by `facts`."""
    wrap = facts.content_format == "openai"
    out: list[dict[str, Any]] = []
    for m in request.messages:
        content: Any
        if not wrap:  # vLLM drops empty parts here, and only here
            content = "\n".join(t for t in m.texts if t)
        elif m.role == "tool":  # tool results are joined in both formats
            content = "\n".join(m.texts)
        else:
            content = [{"type": "text", "text": t} for t in m.texts]
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.role == "assistant":
            if m.tool_calls:
                # Keys in the order of vLLM's validated call (its schema's, not the body's).
                msg["tool_calls"] = [{"id": i, "function": {"arguments": _args(a), "name": n},
                                      "type": "function"} for i, n, a in m.tool_calls]
            if m.reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = m.reasoning
        elif m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        if m.role == "developer":
            msg["tools"] = None
        out.append(msg)
    if not facts.knows_developer and any(m["role"] == "developer" for m in out):
        out = _developer_as_system(out)
    return out


def _args(arguments: str) -> dict[str, Any]:
    """vLLM's `_postprocess_messages`: arguments as an object, anything else as {}."""
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's `_convert_developer_to_system` then `_consolidate_system_messages`: all
    system messages merged into one, first, when there is more than one or it is not
    first."""
    converted = []
    for m in messages:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        converted.append(m)
    system: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(system)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content)
        if content:
            system.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]
