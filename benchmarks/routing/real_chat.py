"""Multi-turn chats against real vLLM replicas, for ``real_kv.py``.

Each conversation has a system prompt of its own (a few of the CPU engine's 128-token
blocks) and sends its turns one after another through ``/v1/chat/completions``,
streamed, greedy: a turn's messages are the whole conversation so far, the assistant
messages being the answers the engine actually gave, so a turn that reaches the
replica that served the one before finds the conversation cached up to where the
re-tokenized answer differs from the generated one (as with any chat client). Requests
go to the routers in turn, by the order they are sent (clients behind a Kubernetes
Service).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

WORDS = ("river", "stone", "lamp", "orbit", "maple", "signal", "harbor", "ember", "quartz",
         "meadow", "falcon", "cipher", "lantern", "glacier", "thistle", "copper")


@dataclasses.dataclass(frozen=True)
class Conversation:
    system: str
    questions: tuple[str, ...]
    start_s: float
    think_s: float


@dataclasses.dataclass
class Turn:
    conversation: int
    turn: int
    router: int
    sent_s: float
    head_s: float | None = None
    """When the answer's head came (a dpserve router sends it with the first chunk)."""
    ttft_s: float | None = None
    latency_s: float | None = None
    replica: str | None = None
    error: str | None = None


def conversations(n: int, turns: int, *, system_sentences: int, start_window_s: float,
                  think_s: float, seed: int) -> list[Conversation]:
    """``n`` conversations whose system prompts differ from their first token on (no two
    share a block), starting at random in ``start_window_s``."""
    rng = random.Random(seed)
    out = []
    for c in range(n):
        rules = " ".join(f"Rule {i}: the {rng.choice(WORDS)} keeps {rng.randrange(1000)}."
                         for i in range(system_sentences))
        out.append(Conversation(
            system=f"Conversation {c} of the {rng.choice(WORDS)}. {rules}",
            questions=tuple(f"Question {t}: what of the {rng.choice(WORDS)}?"
                            for t in range(turns)),
            start_s=rng.uniform(0.0, start_window_s), think_s=think_s))
    return out


class Chats:
    """Plays conversations against ``base_urls`` and records every turn."""

    def __init__(self, base_urls: Sequence[str], model: str, max_tokens: int,
                 timeout_s: float) -> None:
        self.base_urls = list(base_urls)
        self.model = model
        self.max_tokens = max_tokens
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.turns: list[Turn] = []
        self._sent = 0
        self._t0 = 0.0

    async def run(self, convs: Sequence[Conversation]) -> list[Turn]:
        self._t0 = time.monotonic()
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            await asyncio.gather(*(self._play(session, i, c) for i, c in enumerate(convs)))
        return self.turns

    async def _play(self, session: aiohttp.ClientSession, index: int,
                    conv: Conversation) -> None:
        await asyncio.sleep(max(0.0, self._t0 + conv.start_s - time.monotonic()))
        messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}]
        for t, question in enumerate(conv.questions):
            messages.append({"role": "user", "content": question})
            turn, answer = await self._send(session, index, t, messages)
            self.turns.append(turn)
            if answer is None:
                return  # a failed turn ends its conversation: the next has no history
            messages.append({"role": "assistant", "content": answer})
            await asyncio.sleep(conv.think_s)

    async def _send(self, session: aiohttp.ClientSession, index: int, t: int,
                    messages: list[dict[str, str]]) -> tuple[Turn, str | None]:
        router = self._sent % len(self.base_urls)
        self._sent += 1
        started = time.monotonic()
        turn = Turn(index, t, router, started - self._t0)
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": 0.0, "stream": True}
        parts: list[str] = []
        try:
            async with session.post(self.base_urls[router] + "/v1/chat/completions",
                                    json=body) as r:
                turn.head_s = time.monotonic() - started
                turn.replica = r.headers.get("x-dpserve-replica")
                if r.status != 200:
                    turn.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                    return turn, None
                async for line in r.content:
                    text = line.decode(errors="replace").strip()
                    if not text.startswith("data:") or text == "data: [DONE]":
                        continue
                    delta = _delta(text[5:])
                    if delta and turn.ttft_s is None:
                        turn.ttft_s = time.monotonic() - started
                    parts.append(delta)
        except (TimeoutError, aiohttp.ClientError) as exc:
            turn.error = f"{type(exc).__name__}: {exc}"
            return turn, None
        turn.latency_s = time.monotonic() - started
        if turn.ttft_s is None:
            turn.error = "no content"
            return turn, None
        return turn, "".join(parts)


def _delta(payload: str) -> str:
    try:
        chunk: Any = json.loads(payload)
        return str(chunk["choices"][0]["delta"].get("content") or "")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return ""


def play(base_urls: Sequence[str], convs: Sequence[Conversation], *, model: str,
         max_tokens: int, timeout_s: float) -> list[Turn]:
    return asyncio.run(Chats(base_urls, model, max_tokens, timeout_s).run(convs))
