"""Routing on KV events, composed: the index, the subscriber that feeds it, the feeds
that follow each ready replica, the prompt tokenizer, and their `/metrics`.

The router builds one when its policy is `kv-aware`; without a tokenizer (`dpserve
router` without `--tokenizer`), every request is placed by the fallback policy, which
the log says once at start and `/metrics` counts per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry

from dpserve.config import RouterConfig
from dpserve.router.fleet.pool import ReplicaPool
from dpserve.router.heap import freeze_long_lived
from dpserve.router.kv.decisions import KVRoutingStats
from dpserve.router.kv.feeds import KVEventFeeds
from dpserve.router.kv.index import KVIndex
from dpserve.router.kv.metrics import KVCollector
from dpserve.router.kv.sources import override_source
from dpserve.router.kv.subscriber import Subscriber

log = logging.getLogger("dpserve.router")


class PromptTokens(Protocol):
    async def tokens(self, route: str, body: Any) -> Sequence[int] | None: ...

    def close(self) -> None: ...


class KVRouting:
    """What `kv-aware` needs beyond the policy itself, started and closed with the
    router."""

    def __init__(self, pool: ReplicaPool, config: RouterConfig, control: httpx.AsyncClient,
                 open_tokenizer: Callable[[str], PromptTokens] | None = None) -> None:
        """`open_tokenizer(config.tokenizer)`: the prompt tokenizer
        (`dpserve.prompt_tokens.open_named`, given by the composition root)."""
        self.index = KVIndex()
        self.subscriber = Subscriber(self.index)
        override = (functools.partial(override_source, config.kv_events_endpoint,
                                      config.kv_events_replay_endpoint,
                                      config.kv_events_topic)
                    if config.kv_events_endpoint is not None else None)
        self.feeds = KVEventFeeds(pool, self.subscriber, control, override=override)
        self._tokenizer_source = config.tokenizer
        self._open_tokenizer = open_tokenizer
        self._tokenizer: PromptTokens | None = None
        self._loading: asyncio.Task[None] | None = None
        self.tokenizer_settled = asyncio.Event()
        """Set once loading the tokenizer ended, loaded or not (or none is set)."""
        self._closed = False

    def register(self, registry: CollectorRegistry, routing: KVRoutingStats) -> None:
        registry.register(KVCollector(
            self.index, lambda: self.feeds.status, routing, self.subscriber.stats,
            tokenizer_ready=lambda: self._tokenizer is not None))

    async def start(self) -> None:
        """Follow the ready replicas' events, and load the tokenizer in the background (a
        thread: transformers' import and a large tokenizer take seconds, up to tens of
        them on a busy machine, holding the GIL for much of it: `/ready` waits for it);
        until it is loaded, requests are placed by the fallback (counted as
        `no_tokens`)."""
        self.feeds.start()
        source, opener = self._tokenizer_source, self._open_tokenizer
        if source is None or opener is None:
            log.warning("policy kv-aware without a tokenizer (--tokenizer): every request "
                        "is placed by prefix affinity")
            self.tokenizer_settled.set()
        else:
            self._loading = asyncio.create_task(self._load(source, opener),
                                                name="dpserve-kv-tokenizer")

    async def _load(self, source: str, opener: Callable[[str], PromptTokens]) -> None:
        try:
            await self._open(source, opener)
        finally:
            self.tokenizer_settled.set()

    async def _open(self, source: str, opener: Callable[[str], PromptTokens]) -> None:
        try:
            tokenizer = await asyncio.to_thread(opener, source)
        except Exception as exc:  # a directory without tokenizer files, a bad template
            log.error("--tokenizer %s: cannot load it (%s); every request is placed by "
                      "prefix affinity", source, str(exc).splitlines()[0][:200] or
                      type(exc).__name__)
        else:
            if self._closed:
                tokenizer.close()
                return
            self._tokenizer = tokenizer
            frozen = freeze_long_lived()  # transformers' and torch's objects: see heap
            log.info("kv-aware: prompts tokenized with %s (%d objects exempt from the "
                     "garbage collector)", source, frozen)

    async def tokenize(self, route: str, body: dict[str, Any]) -> Sequence[int] | None:
        tokenizer = self._tokenizer
        return None if tokenizer is None else await tokenizer.tokens(route, body)

    async def aclose(self) -> None:
        self._closed = True
        if self._loading is not None:
            self._loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loading
        await self.feeds.aclose()
        if self._tokenizer is not None:
            self._tokenizer.close()
