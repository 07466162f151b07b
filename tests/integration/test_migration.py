"""Stream migration on real vLLM replicas (CPU): a stream moved mid-way by an admin
drain with `move_streams` ends exactly as an uninterrupted run, stop strings
included. Its engine is paused first (vLLM's `/pause`, requests kept), so the move
is sure to find the stream running: the tiny model finishes faster than a client
reads. (Killing a replica mid-stream: tests/integration/test_serve.py.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.integration.conftest import MODEL_NAME, Deployment
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.vllm

PROMPT = "Once upon a time, in a land far away,"


def streamed(d: Deployment, body: dict[str, Any], on_chunk: Callable[[int], None] | None = None
             ) -> dict[str, Any]:
    """One greedy completion stream: each chunk's text, the end, usage, migrations."""
    out: dict[str, Any] = {"pieces": [], "finish": None, "stop": None, "usage": None,
                           "seams": [], "done": False}
    payload = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "stream": True,
               "ignore_eos": True, "stream_options": {"include_usage": True}} | body
    with httpx.Client(timeout=120) as h, h.stream("POST", d.base_url + "/v1/completions",
                                                  json=payload) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            out["usage"] = chunk.get("usage") or out["usage"]
            out["seams"] = chunk.get("dpserve", {}).get("migrations", out["seams"])
            for c in chunk["choices"]:
                out["pieces"].append(c["text"])
                if c["finish_reason"]:
                    out["finish"], out["stop"] = c["finish_reason"], c.get("stop_reason")
            if chunk["choices"]:
                n += 1
                if on_chunk is not None:
                    on_chunk(n)
    return out


def admin(d: Deployment, replica: str, action: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{d.base_url}/admin/replicas/{replica}/{action}", json=body, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def describe(d: Deployment, replica: str) -> dict[str, Any]:
    listing = httpx.get(d.base_url + "/admin/replicas", timeout=10).json()["replicas"]
    return dict(next(r for r in listing if r["id"] == replica))


def state(d: Deployment, replica: str) -> str:
    return str(describe(d, replica)["state"])



def last_new(text: str, start: int) -> tuple[int, str]:
    """The latest text of 12 to 40 characters at or after `start` not seen before it:
    a stop string with one place to stop, as late as the greedy text allows (the tiny
    model repeats itself)."""
    for at in range(len(text) - 12, start - 1, -1):
        for size in range(12, 41):
            piece = text[at:at + size]
            if len(piece) == size and text.find(piece) == at:
                return at, piece
    raise AssertionError(f"nothing new after {start} in {text!r}")


def test_a_stream_with_a_stop_string_moved_by_a_drain_stops_where_it_would_have(deployment):
    # A stop string from well into the greedy text, 12 or more characters long: vLLM
    # holds back 11 or more characters of text, which the move must deliver; the stop
    # string completes on the replica the stream moved to, where the router checks it.
    plain = streamed(deployment, {"max_tokens": 900})
    text = "".join(plain["pieces"])
    at, stop = last_new(text, len("".join(plain["pieces"][:100])))
    body = {"max_tokens": 900, "stop": [stop]}
    reference = streamed(deployment, body)
    assert "".join(reference["pieces"]) == text[:at] and reference["stop"] == stop

    moved: list[dict[str, Any]] = []
    r0 = describe(deployment, "r0")["url"]

    def move_at(n: int) -> None:
        # At the first chunk the client reads, r0's engine is paused (requests kept),
        # then drained: a client seconds behind the router (a loaded machine) still
        # finds the stream running, hundreds of tokens before its end.
        if n == 1:
            httpx.post(r0 + "/pause", params={"mode": "keep"}, timeout=30).raise_for_status()
            admin(deployment, "r1", "undrain")
            moved.append(admin(deployment, "r0", "drain", move_streams=True))

    admin(deployment, "r1", "drain")  # the stream starts on r0
    try:
        got = streamed(deployment, body, move_at)
    finally:
        httpx.post(r0 + "/resume", timeout=30)
        admin(deployment, "r1", "undrain")
        admin(deployment, "r0", "undrain")
    wait_for_sync(lambda: state(deployment, "r0") == state(deployment, "r1") == "ready",
                  "both replicas back in rotation", within_s=60)
    assert moved and moved[0]["moved_streams"] == 1, moved
    assert [(s["from"], s["to"], s["reason"]) for s in got["seams"]] == [
        ("r0", "r1", "drained")]
    assert "".join(got["pieces"]) == text[:at] and got["done"]
    assert (got["finish"], got["stop"]) == ("stop", stop)
    assert got["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
