"""A request's prompt as the token ids its engine will see, for routing on the KV index,
computed off the event loop.

`PromptTokenizer.tokens(route, body)` answers the prompt's token ids, or None: the
request is not routed by prefix (several prompts, images, a body too large or too odd,
a template error, too much tokenizing already queued). It never raises, and the loop
only checks and measures the body; rendering and encoding run on a worker thread.

Why threads and not processes (`benchmarks/routing/tokenize.py`, 2 cores): while 64
chat prompts of 8k tokens were tokenized, one worker thread and one worker process
stalled the loop alike: p99 ~1.1 ms, longest 2-8 ms for threads and 1-6 ms for
processes over three runs, the idle loop's own longest being up to 1 ms. The Rust
encoder holds the GIL for none of its work (`hf.py`) and a template renders in
~0.1 ms, so the GIL is not what stalls the loop: the CPU is. Two workers on two cores
took the loop's core too (p99 3-7 ms), threads or processes. A process would also
import transformers again and copy every body across. So: threads, one per core the
loop does not use, at least one. Tokenizing on the loop stalled it 4-6 ms per 8k
prompt, and a burst of them chained into 300 ms.

Bounds: a prompt over `max_chars` characters (or `max_items` messages, parts, token
ids or JSON values) is not tokenized; past `max_pending` requests queued or running,
the next ones get None at once, so a flood costs nothing more. Identical prompts
(a retry, a benchmark, a popular question) are answered from an LRU cache of
`cache_tokens` token ids, and concurrent identical ones share one encoding.

Which encoder: `hf.HfPromptEncoder` for vLLM replicas of a Hugging Face model,
`dpserve.sim.prompts.SimPromptEncoder` for dpserve's simulated fleet, whose pseudo-
tokenizer and chat template differ; `dpserve.prompt_tokens.open_prompt_tokenizer`
picks one by the engines' name.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dpserve.router.kv.decisions import PROMPT_ROUTES
from dpserve.router.kv.prompt import Budget, PromptEncoder, TokenIds

ROUTES = PROMPT_ROUTES


def _default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


@dataclass(frozen=True, kw_only=True)
class PromptLimits:
    max_chars: int = 1 << 20
    """Characters of text in one prompt (all messages), or token ids of a prompt given as
    ids; ~250k tokens of English, ~0.5 s of one worker's time. Longer ones are not
    tokenized."""
    max_items: int = 2048
    """Messages, content parts, tools, tool calls, documents and values of free-form
    JSON (tool parameters, template arguments) in one request: the loop checks each
    (~1-3 us), so this bounds its share to ~5 ms."""
    max_pending: int = 64
    """Prompts queued or being tokenized; past this, requests get None at once."""
    cache_tokens: int = 1 << 20
    """Token ids the cache holds in all, least recently used out first: with the
    prompts' text each weighs ~50 bytes, so ~50 MiB. 0: no cache."""
    workers: int = field(default_factory=_default_workers)
    """Worker threads: one per core the loop does not need, and at least one."""

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_items", "max_pending", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.cache_tokens < 0:
            raise ValueError(f"cache_tokens must not be negative, got {self.cache_tokens}")


class PromptTokenizer:
    """The async front of a `PromptEncoder`: bounds, cache, worker threads. One per
    router process; `close` it (or use `async with`)."""

    def __init__(self, encoder: PromptEncoder, limits: PromptLimits | None = None) -> None:
        self._encoder = encoder
        self._limits = limits or PromptLimits()
        self._pool = ThreadPoolExecutor(self._limits.workers,
                                        thread_name_prefix="dpserve-tokenize")
        self._cache: OrderedDict[Hashable, TokenIds | None] = OrderedDict()
        self._cached_tokens = 0
        self._flights: dict[Hashable, asyncio.Future[TokenIds | None]] = {}
        self._closed = False

    async def tokens(self, route: str, body: Any) -> TokenIds | None:
        """The prompt token ids of a request to `route` with JSON `body`, or None. The
        body must not change until this returns."""
        if self._closed or route not in ROUTES or not isinstance(body, dict):
            return None
        limits = self._limits
        try:
            job = self._encoder.prepare(route, body, Budget(limits.max_chars, limits.max_items))
        except Exception:  # a body odder than the checks foresaw: not routed by prefix
            return None
        if job is None:
            return None
        key = job.key
        if key is not None:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            flight = self._flights.get(key)
            if flight is not None:
                return await self._landed(flight)
        if len(self._flights) >= limits.max_pending:
            return None
        if key is None:
            key = object()  # its own flight, counted but never shared or cached
        try:
            flight = asyncio.wrap_future(self._pool.submit(_run, job.run))
        except RuntimeError:  # closed meanwhile
            return None
        self._flights[key] = flight
        flight.add_done_callback(functools.partial(self._land, key, job.key is not None))
        return await self._landed(flight)

    def _land(self, key: Hashable, cache: bool,
              flight: asyncio.Future[TokenIds | None]) -> None:
        del self._flights[key]
        if not cache or flight.cancelled() or flight.exception() is not None:
            return
        ids = flight.result()
        if _weight(ids) > self._limits.cache_tokens:
            return
        self._cache[key] = ids
        self._cached_tokens += _weight(ids)
        while self._cached_tokens > self._limits.cache_tokens:
            self._cached_tokens -= _weight(self._cache.popitem(last=False)[1])

    @staticmethod
    async def _landed(flight: asyncio.Future[TokenIds | None]) -> TokenIds | None:
        # Shielded: a caller that gives up leaves the work to finish for the others and
        # the cache; the work is bounded by max_pending all the same.
        try:
            return await asyncio.shield(flight)
        except asyncio.CancelledError:
            if flight.cancelled():  # the pool was shut down, not the caller cancelled
                return None
            raise

    def close(self) -> None:
        """Stop: queued work is dropped, running work finishes in the background, and
        every later call answers None."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> PromptTokenizer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _weight(ids: TokenIds | None) -> int:
    return len(ids) if ids else 1


def _run(work: Callable[[], TokenIds | None]) -> TokenIds | None:
    try:
        return work()
    except Exception:  # a template that raises, a prompt the tokenizer refuses: not routed
        return None
