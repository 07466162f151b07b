"""A simulated replica speaks vLLM's OpenAI API: the official client works with it,
streams have one chunk per token, usage adds up, errors come in OpenAI's envelope,
/metrics parses and follows the engine, and time to first token behaves as modelled."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from dpserve.sim import SimReplica, tokenizer
from dpserve.sim.engine import TIMER_SLACK_S
from tests.sim.conftest import FAST, TOLERANCE_S, scrape
from tests.waiting import wait_for


@pytest.fixture
async def replica() -> AsyncIterator[SimReplica]:
    r = await SimReplica(FAST).start()
    yield r
    await r.stop()


@pytest.fixture
async def client(replica: SimReplica) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="unused",
                                  max_retries=0) as c:
        yield c


async def test_the_openai_client_streams_one_chunk_per_token_and_a_usage_chunk(client):
    prompt = "Plan a fleet of replicas for a chat service with long shared system prompts."
    stream = await client.completions.create(
        model=FAST.model, prompt=prompt, max_tokens=17, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    tokens = [c for c in chunks if c.choices]
    assert len(tokens) == 17
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 16 + ["length"]
    text = "".join(c.choices[0].text for c in tokens)
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.prompt_tokens == tokenizer.count(prompt)
    assert usage.completion_tokens == 17 == tokenizer.count(text)
    assert usage.total_tokens == usage.prompt_tokens + 17


async def test_the_openai_client_chats_streamed_and_not(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is data parallelism?"}]
    reply = await client.chat.completions.create(model=FAST.model, messages=messages,
                                                 max_tokens=6)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.role == "assistant"
    assert tokenizer.count(reply.choices[0].message.content or "") == 6
    assert reply.usage is not None and reply.usage.completion_tokens == 6

    stream = await client.chat.completions.create(
        model=FAST.model, messages=messages, max_completion_tokens=6, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert len(content) == 6
    assert "".join(content) == reply.choices[0].message.content  # deterministic output
    assert chunks[-1].usage == reply.usage


async def test_models_and_tokenize_agree_with_usage(client, replica):
    models = await client.models.list()
    assert [m.id for m in models.data] == [FAST.model]
    prompt = "count these words please"
    async with aiohttp.ClientSession() as s:
        async with s.post(replica.url + "/tokenize", json={"prompt": prompt}) as resp:
            counted = (await resp.json())["count"]
    done = await client.completions.create(model=FAST.model, prompt=prompt, max_tokens=1)
    assert done.usage is not None and done.usage.prompt_tokens == counted == 8  # coun t thes e ...


async def test_a_completion_that_would_overrun_the_context_is_cut_there(client):
    done = await client.completions.create(model=FAST.model, prompt=list(range(4090)),
                                           max_tokens=100)
    assert done.usage is not None and done.usage.completion_tokens == 6
    assert done.choices[0].finish_reason == "length"


async def test_token_id_prompts_are_accepted(client):
    done = await client.completions.create(model=FAST.model, prompt=list(range(40)),
                                           max_tokens=2)
    assert done.usage is not None and done.usage.prompt_tokens == 40


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "other", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "hi " * 5000, "max_tokens": 1}, 400, "input_tokens"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
])
async def test_invalid_requests_get_vllms_error_envelope(replica, body, status, param):
    async with aiohttp.ClientSession() as s, s.post(replica.url + "/v1/completions",
                                                    json=body) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["code"] == status and error["param"] == param and error["message"]


async def test_metrics_show_running_and_waiting_requests():
    config = dataclasses.replace(FAST, max_num_seqs=2)
    small = await SimReplica(config).start()
    try:
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(s.post(small.url + "/v1/completions", json={
                "prompt": f"request {i}", "max_tokens": 1000})) for i in range(5)]

            async def two_run_three_wait() -> bool:
                m = await scrape(small.url)
                return (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (2, 3)

            await wait_for(two_run_three_wait, what="2 running and 3 waiting in /metrics")
            m = await scrape(small.url)
            assert 0 < m["vllm:kv_cache_usage_perc"] < 1
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        async def all_aborted() -> bool:
            m = await scrape(small.url)
            return (m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 0
                    and m["vllm:request_success_total{finished_reason=abort}"] == 5)

        await wait_for(all_aborted, what="disconnected clients' requests aborted")
        assert (await scrape(small.url))["vllm:kv_cache_usage_perc"] == 0
    finally:
        await small.stop()


async def first_token_after(url: str, prompt: str) -> float:
    """Seconds from sending a streamed request to reading its first event."""
    async with aiohttp.ClientSession() as s:
        start = time.perf_counter()
        async with s.post(url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": 2, "stream": True}) as resp:
            await resp.content.readuntil(b"\n\n")
            first = time.perf_counter() - start
            await resp.read()
    return first


async def test_a_repeated_long_prefix_hits_the_cache_and_comes_back_sooner(replica):
    system = " ".join(f"rule{i:04d}" for i in range(400))  # 800 tokens of shared prefix
    ttfts = replica.engine.stats.ttft
    fresh = await first_token_after(replica.url, f"{system} first question?")
    fresh_engine = ttfts.sum
    cached = await first_token_after(replica.url, f"{system} second question?")
    cached_engine = ttfts.sum - fresh_engine

    m = await scrape(replica.url)
    assert m["vllm:prefix_cache_hits_total"] == 800
    assert m["vllm:prefix_cache_queries_total"] == tokenizer.count(
        f"{system} first question? {system} second question?")
    step_s, per_token_s = FAST.step_base_s, FAST.prefill_per_token_s
    assert fresh_engine == pytest.approx(step_s + 805 * per_token_s, abs=TOLERANCE_S)
    assert cached_engine == pytest.approx(step_s + 5 * per_token_s, abs=TOLERANCE_S)
    assert cached_engine < fresh_engine - 700 * per_token_s
    assert fresh >= fresh_engine - TIMER_SLACK_S and cached >= cached_engine - TIMER_SLACK_S


async def test_a_prefix_cache_reset_over_http_makes_a_repeated_prefix_miss(replica):
    system = " ".join(f"rule{i:04d}" for i in range(400))  # 800 tokens
    await first_token_after(replica.url, f"{system} first question?")
    async with aiohttp.ClientSession() as s, s.post(
            replica.url + "/reset_prefix_cache") as resp:
        assert resp.status == 200 and await resp.json() == {"success": True}
    await first_token_after(replica.url, f"{system} second question?")
    assert (await scrape(replica.url))["vllm:prefix_cache_hits_total"] == 0


async def test_a_reset_under_a_running_stream_needs_reset_running_requests_as_in_vllm(replica):
    prompt = " ".join(f"rule{i:04d}" for i in range(100))  # blocks the stream holds
    async with aiohttp.ClientSession() as s:
        async with s.post(replica.url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": 200, "stream": True}) as stream:
            await stream.content.readuntil(b"\n\n")  # running, mid-step most of the time
            async with s.post(replica.url + "/reset_prefix_cache") as resp:
                assert await resp.json() == {"success": False}  # nothing dropped
            async with s.post(replica.url + "/reset_prefix_cache",
                              params={"reset_running_requests": "true"}) as resp:
                assert await resp.json() == {"success": True}
            async with s.post(replica.url + "/reset_prefix_cache",
                              params={"reset_running_requests": "maybe"}) as resp:
                assert resp.status == 400
            chunks = (await stream.read()).split(b"\n\n")
        # preempted and recomputed, not failed: the stream still ends with every token
        assert sum(b'"text"' in c for c in chunks) == 199 and chunks[-2] == b"data: [DONE]"
    m = await scrape(replica.url)
    assert m["vllm:num_preemptions_total"] == 1
    assert m["vllm:prefix_cache_queries_total"] > m["vllm:prefix_cache_hits_total"] == 0


async def test_client_measured_ttft_grows_with_prompt_length_as_modelled(replica):
    for tokens in (100, 1000, 2000):
        prompt = tokenizer.decode((tokens + i) % tokenizer.VOCAB_SIZE for i in range(tokens))
        measured = await first_token_after(replica.url, prompt)
        modelled = FAST.step_base_s + tokens * FAST.prefill_per_token_s
        assert measured >= modelled - TIMER_SLACK_S  # the engine may wake that early
    # the engine's own clock, which the client's adds only network and wake-up time to
    modelled_sum = 3 * FAST.step_base_s + 3100 * FAST.prefill_per_token_s
    assert replica.engine.stats.ttft.sum == pytest.approx(modelled_sum, abs=TOLERANCE_S)


async def test_a_replica_whose_engine_died_fails_its_health_checks(replica, caplog):
    def crash() -> None:
        raise RuntimeError("a bug in the scheduler")

    replica.engine._schedule = crash  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as s:
        async with s.post(replica.url + "/v1/completions", json={"prompt": "hi"}) as resp:
            assert resp.status == 503  # the request it was running is aborted, not hung
        async with s.get(replica.url + "/health") as resp:
            assert resp.status == 500
        async with s.post(replica.url + "/v1/completions", json={"prompt": "hi"}) as resp:
            assert resp.status == 500
    assert "engine 0 died" in caplog.text


async def test_an_unknown_body_shape_is_a_400(replica):
    async with aiohttp.ClientSession() as s, s.post(
            replica.url + "/v1/chat/completions", data=b"not json",
            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        assert json.loads(await resp.text())["error"]["type"] == "BadRequestError"

