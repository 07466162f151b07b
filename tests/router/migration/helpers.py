"""What the migration tests share: requests, a streaming client, readers of its events."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.waiting import wait_for

COMPLETION = {"model": "fake-model", "prompt": "The quick brown fox", "max_tokens": 12,
              "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}


async def stream(base: str, route: str, body: dict[str, Any], *,
                 into: list[dict[str, Any] | str] | None = None) -> list[dict[str, Any] | str]:
    """Every event of one streamed answer: parsed chunks, and `[DONE]` as a string;
    appended to `into` as they come, if given (what the client has so far)."""
    events = [] if into is None else into
    async with httpx.AsyncClient(timeout=20) as c, c.stream("POST", base + route,
                                                            json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                event = line.removeprefix("data: ")
                events.append(event if event == "[DONE]" else json.loads(event))
    return events


async def scrape(base: str) -> str:
    async with httpx.AsyncClient() as c:
        return (await c.get(base + "/metrics")).text


async def all_ready(router: Any, n: int) -> None:
    """Every replica in rotation, so that round-robin sends the first request to r0."""
    await wait_for(lambda: len(router.pool.ready()) == n, f"{n} replicas ready")


def text(events: list[dict[str, Any] | str], *, chat: bool = False) -> str:
    return "".join((c["delta"].get("content") or "") if chat else c["text"]
                   for e in events if isinstance(e, dict) for c in e.get("choices", []))


def final(events: list[dict[str, Any] | str]) -> dict[str, Any]:
    return next(e for e in events if isinstance(e, dict)
                and any(c.get("finish_reason") for c in e.get("choices", [])))


def usage(events: list[dict[str, Any] | str]) -> dict[str, Any]:
    return next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))
