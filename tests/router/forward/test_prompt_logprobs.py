"""Requests for the prompt's log-probabilities on engines with LoRA enabled: refused by
the router before any engine sees them (vLLM 0.32 fails the whole engine when two are
batched, measured on real replicas: tests/integration/test_adapters.py), passed on
everywhere else. FakeReplicas stand in: what is checked is what reaches them."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpserve.router.errors import RouterError
from dpserve.router.forward.request import refuse_prompt_logprobs
from tests.conftest import running_router

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
MESSAGES = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}

ASKING = [
    (COMPLETIONS, {**PROMPT, "prompt_logprobs": 0}, "prompt_logprobs"),
    (COMPLETIONS, {**PROMPT, "echo": True, "logprobs": 0}, "echo"),
    (CHAT, {**MESSAGES, "prompt_logprobs": 1}, "prompt_logprobs"),
    (CHAT, {**MESSAGES, "echo": True, "logprobs": True, "top_logprobs": 2}, "echo"),
]
NOT_ASKING = [
    (COMPLETIONS, PROMPT),
    (COMPLETIONS, {**PROMPT, "logprobs": 2}),  # the generated tokens': the sampler's path
    (COMPLETIONS, {**PROMPT, "echo": True}),
    (COMPLETIONS, {**PROMPT, "echo": False, "logprobs": 1, "prompt_logprobs": None}),
    (CHAT, {**MESSAGES, "logprobs": True, "top_logprobs": 3}),
    (CHAT, {**MESSAGES, "echo": True}),
]


@pytest.mark.parametrize("route, body, param", ASKING)
async def test_lora_engines_never_see_a_request_for_the_prompts_logprobs(fake_replicas, route,
                                                                         body, param):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], enable_lora=True, lora_affinity=False) \
            as (url, _), httpx.AsyncClient(base_url=url, timeout=10) as client:
        answer = await client.post(route, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and "LoRA enabled" in error["message"]
    assert error["type"] == "BadRequestError"
    assert replica.requests == []


@pytest.mark.parametrize("route, body", NOT_ASKING)
async def test_other_requests_pass_on_lora_engines(fake_replicas, route, body):
    replica = await fake_replicas("r0")
    async with running_router([replica.url], enable_lora=True, lora_affinity=False) \
            as (url, _), httpx.AsyncClient(base_url=url, timeout=10) as client:
        answer = await client.post(route, json=body)
    assert answer.status_code == 200, answer.text
    assert len(replica.requests) == 1


async def test_without_lora_the_prompts_logprobs_pass(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        answers = [await client.post(route, json=body) for route, body, _ in ASKING]
    assert [a.status_code for a in answers] == [200] * len(ASKING)
    assert len(replica.requests) == len(ASKING)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


@given(st.sampled_from([COMPLETIONS, CHAT]),
       st.dictionaries(st.sampled_from(["prompt_logprobs", "echo", "logprobs",
                                        "top_logprobs", "model", "n"]), JSON, max_size=5))
def test_any_body_is_refused_exactly_when_it_asks_for_the_prompts_logprobs(route, body):
    echoed = "top_logprobs" if route == CHAT else "logprobs"
    asks = body.get("prompt_logprobs") is not None or (
        body.get("echo") not in (None, False) and body.get(echoed) is not None)
    try:
        refuse_prompt_logprobs(route, body)
    except RouterError as exc:
        assert asks and exc.status == 400
    else:
        assert not asks
