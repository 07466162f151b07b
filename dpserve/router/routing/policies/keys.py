"""Affinity keys read from a parsed request: who is asking, and what the prompt starts with.

Pure helpers for whoever builds :class:`RequestInfo` from a request: they look
only at the headers and the decoded JSON body, and never fail on odd input —
a request without a usable key simply gets no affinity.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

SESSION_HEADER = b"x-session-id"
MAX_SESSION_ID_CHARS = 256
"""Longer session ids are cut: they are only hashed, and a bounded key bounds the work."""
DEFAULT_PREFIX_CHARS = 256
"""About 64 tokens: long enough to tell system prompts apart, short enough that
requests sharing one land together even when their user turns differ."""


def session_id(headers: Iterable[tuple[bytes, bytes]], payload: Mapping[str, Any] | None
               ) -> str | None:
    """The `X-Session-Id` header (ASGI header pairs, lower-case names), else the
    OpenAI `user` field of the body; None if neither is a non-empty string."""
    for name, value in headers:
        if name == SESSION_HEADER:
            text = value.decode("latin-1").strip()
            if text:
                return text[:MAX_SESSION_ID_CHARS]
    user = payload.get("user") if payload is not None else None
    if isinstance(user, str) and user.strip():
        return user.strip()[:MAX_SESSION_ID_CHARS]
    return None


def prompt_prefix(payload: Mapping[str, Any] | None, max_chars: int = DEFAULT_PREFIX_CHARS
                  ) -> str | None:
    """The first `max_chars` characters of what the engine will see first.

    Chat `messages` are rendered as `role: text` lines (text parts only; an image
    counts as its type, not its bytes); `prompt` or `input` is taken as is, the
    first one of a batch, and token-id prompts as comma-separated ids. None when
    the body holds no prompt.
    """
    if payload is None or max_chars <= 0:
        return None
    messages = payload.get("messages")
    if isinstance(messages, list):
        text = _render_messages(messages, max_chars)
    else:
        prompt = payload.get("prompt", payload.get("input"))
        text = _render_prompt(prompt, max_chars)
    return text[:max_chars] or None


def _render_messages(messages: list[Any], max_chars: int) -> str:
    out: list[str] = []
    size = 0
    for message in messages:
        if size >= max_chars:
            break
        if not isinstance(message, Mapping):
            continue
        line = f"{message.get('role', '')}: {_content_text(message.get('content'))}\n"
        out.append(line)
        size += len(line)
    return "".join(out)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = []
    for part in content:
        if isinstance(part, Mapping):
            text = part.get("text")
            parts.append(text if isinstance(text, str) else f"<{part.get('type', '')}>")
    return "".join(parts)


def _render_prompt(prompt: Any, max_chars: int) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt[:max_chars]):
            return ",".join(str(t) for t in prompt[:max_chars])
        return _render_prompt(prompt[0], max_chars)  # a batch: key by its first prompt
    return ""
