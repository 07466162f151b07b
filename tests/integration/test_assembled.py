"""Non-streamed completions ride on a stream, on real vLLM replicas (CPU): the router's
assembled answer is the body vLLM returns itself, field for field, and one whose engine
is paused mid-way and drained (`move_streams`) is answered as if it never moved.
(The pause: `paused_mid_stream`, tests/integration/test_migration.py.)"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.integration.conftest import MODEL_NAME, Deployment
from tests.integration.test_migration import (
    PROMPT,
    TRIES,
    admin,
    describe,
    last_new,
    paused_mid_stream,
    state,
)
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.vllm

ROUTES = {"completions": ("/v1/completions", {"prompt": PROMPT}),
          "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})}
ASSIGNED = ("id", "created", "system_fingerprint")
"""Fields each server writes its own: the request's id, the second it began, and the
weights' fingerprint (the router names the weight version there, as on every answer)."""


def answer(base: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(base + route, json={"model": MODEL_NAME, "temperature": 0} | body,
                   timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True},
                                   {"stop": ["the"], "max_tokens": 64}],
                         ids=["plain", "token-ids", "stop-string"])
@pytest.mark.parametrize("kind", ROUTES)
def test_the_assembled_answer_is_the_one_vllm_returns(deployment: Deployment, kind: str,
                                                     extra: dict[str, Any]):
    route, prompt = ROUTES[kind]
    body = {"max_tokens": 24} | prompt | extra
    direct = answer(describe(deployment, "r0")["url"], route, body)
    routed = answer(deployment.base_url, route, body)
    assert list(routed) == list(direct)  # the same fields, in vLLM's order
    assert {k: v for k, v in routed.items() if k not in ASSIGNED} == {
        k: v for k, v in direct.items() if k not in ASSIGNED}
    assert routed["system_fingerprint"] == describe(deployment, "r0")["weight_version"]


def test_a_completion_moved_mid_way_by_a_drain_is_answered_as_if_it_never_moved(
        deployment: Deployment):
    route, prompt = ROUTES["completions"]
    plain = answer(deployment.base_url, route, prompt | {"max_tokens": 900,
                                                        "ignore_eos": True})
    text = plain["choices"][0]["text"]
    at, stop = last_new(text, len(text) // 3)
    body = prompt | {"max_tokens": 900, "ignore_eos": True, "stop": [stop]}
    reference = answer(deployment.base_url, route, body)
    assert reference["choices"][0]["text"] == text[:at]

    for _ in range(TRIES):
        moved: list[dict[str, Any]] = []
        with paused_mid_stream(deployment, then=lambda: moved.append(  # noqa: B023
                admin(deployment, "r0", "drain", move_streams=True))) as pause:
            got = answer(deployment.base_url, route, body)
        wait_for_sync(lambda: state(deployment, "r0") == state(deployment, "r1") == "ready",
                      "both replicas back in rotation", within_s=60)
        seams = got.get("dpserve", {}).get("migrations", [])
        if pause.caught or seams:
            break
    else:
        pytest.fail(f"the request ended before its engine was paused, {TRIES} times")
    assert moved and moved[0]["moved_streams"] == 1, moved
    assert [(s["from"], s["to"], s["reason"]) for s in seams] == [("r0", "r1", "drained")]
    assert {k: v for k, v in got.items() if k not in (*ASSIGNED, "dpserve")} == {
        k: v for k, v in reference.items() if k not in ASSIGNED}
