"""The vocabulary of the prompt tokenizer's parts: what an encoder is (`PromptEncoder`:
a cheap check on the event loop that returns a `Job` for a worker thread), the budget
that bounds the check, and the vLLM server's chat settings.

`tokens.PromptTokenizer` runs encoders; `hf.HfPromptEncoder` reads prompts as vLLM
does, `dpserve.sim.prompts.SimPromptEncoder` as the simulator does. Pure data, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

TokenIds = tuple[int, ...]
MAX_JSON_DEPTH = 32
"""Nesting allowed in free-form JSON (tool parameters, template arguments)."""


class Budget:
    """Characters and items a request may still spend; `spend` says False once over."""

    __slots__ = ("chars", "items")

    def __init__(self, chars: int, items: int) -> None:
        self.chars = chars
        self.items = items

    def spend(self, chars: int, items: int = 1) -> bool:
        self.chars -= chars
        self.items -= items
        return self.chars >= 0 and self.items >= 0


def is_json(value: Any, budget: Budget) -> bool:
    """`value` is plain JSON within `budget` and `MAX_JSON_DEPTH` (iterative: a deep
    value cannot exhaust the stack)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH or not budget.spend(len(item) if isinstance(item, str) else 0):
            return False
        if isinstance(item, dict):
            if not all(isinstance(k, str) and budget.spend(len(k), 0) for k in item):
                return False
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif not (item is None or isinstance(item, str | bool | int | float)):
            return False
    return True


@dataclass(frozen=True, kw_only=True)
class ChatSettings:
    """The vLLM server's own flags that change how chat is rendered."""

    chat_template: str | None = None
    """`--chat-template`, as the template's text (or the name of one of the tokenizer's
    templates); None: the tokenizer's."""
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """`--default-chat-template-kwargs`."""
    exclude_tools_when_tool_choice_none: bool = False
    """`--exclude-tools-when-tool-choice-none`."""


@dataclass(frozen=True, slots=True)
class Job:
    key: Hashable | None
    """Equal keys have equal token ids; None: not cached."""
    run: Callable[[], TokenIds | None]
    """The work, run on a worker thread; may raise (that is a None)."""


class PromptEncoder(Protocol):
    def prepare(self, route: str, body: dict[str, Any], budget: Budget) -> Job | None:
        """Check `body` (on the loop: cheap, bounded by `budget`) and say what to run;
        None if its prompt cannot be known."""


