"""With `kv_events`, a simulated replica publishes its prefix cache's changes as vLLM
does: a router's subscriber (a plain ZMQ SUB socket here) decodes them with dpserve's
decoder and with vLLM's own, their blocks carry the prompt's and the answer's token
ids, evictions name exactly the blocks evicted, the replay returns what was missed,
`/kv_event_sources` says where to connect, and a subscriber that never reads does
not hold the engine up. Fed into the router's `KVIndex`, the events point at the
replica that served a prompt."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from dpserve.config import ConfigError
from dpserve.router.kv.events import END_SEQ, Batch, Cleared, Removed, Stored, decode
from dpserve.router.kv.index import KVIndex
from dpserve.router.kv.sources import parse_sources
from dpserve.sim import Fleet, SimReplica, tokenizer
from dpserve.sim.kv_events import KVEventBatch, KVEventPublisher, wire_hash
from dpserve.sim.prefix_cache import ROOT_HASH, block_hashes
from tests.sim.conftest import FAST, running_engine
from tests.waiting import wait_for

EVENTS = dataclasses.replace(FAST, kv_events=True)
BS = EVENTS.block_size
PROMPT = ("A fleet of replicas serves a chat product whose every conversation opens with "
          "the same long system prompt; the router should send each turn to the replica "
          "that already holds that prompt's KV blocks in its prefix cache.")
_probes = itertools.count(1)


@contextlib.asynccontextmanager
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


async def post(session: aiohttp.ClientSession, url: str, prompt: Any,
               max_tokens: int = 1) -> dict[str, Any]:
    async with session.post(url + "/v1/completions",
                            json={"prompt": prompt, "max_tokens": max_tokens}) as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


async def receive(sock: zmq.asyncio.Socket, within_s: float = 5.0) -> list[bytes]:
    if not await sock.poll(int(within_s * 1000)):
        raise AssertionError(f"no ZMQ message within {within_s:g} s")
    return list(await sock.recv_multipart())


async def subscribe(ctx: zmq.asyncio.Context, session: aiohttp.ClientSession,
                    url: str) -> tuple[zmq.asyncio.Socket, list[Batch]]:
    """A SUB socket on the endpoint `url`'s `/kv_event_sources` names, once it receives:
    a subscription takes effect some time after `connect`, so one-block probe requests
    are sent until one's batch arrives. Returns the socket and the batches seen."""
    async with session.get(url + "/kv_event_sources") as resp:
        source = parse_sources(await resp.read(), url)  # as the router reads it
    assert source is not None
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(source.topic.encode())
    sub.connect(source.endpoint)

    async def probe() -> list[Batch]:
        await post(session, url, [10_000 + next(_probes)] * BS)  # one new block
        return [decode(await sub.recv_multipart())] if await sub.poll(100) else []

    return sub, await wait_for(probe, f"the first event from {source.endpoint}")


def stored_ids(batches: list[Batch]) -> list[int]:
    return [t for b in batches for e in b.events if isinstance(e, Stored) for t in e.token_ids]


async def test_a_subscriber_sees_the_prompt_s_blocks_stored_with_the_tokenizer_s_ids():
    ids = tokenizer.encode(PROMPT)
    full = len(ids) // BS
    assert full >= 3
    async with Fleet(n=1, config=EVENTS) as fleet, zmq_context() as ctx, \
            aiohttp.ClientSession() as s:
        sub, probes = await subscribe(ctx, s, fleet.urls[0])
        await post(s, fleet.urls[0], PROMPT)
        batch = decode(await receive(sub))
    assert batch.seq == probes[-1].seq + 1
    assert batch.data_parallel_rank == 0 and batch.skipped == 0
    assert batch.events == (Stored(
        block_hashes=tuple(wire_hash(h) for h in block_hashes(ids, BS)), parent=None,
        token_ids=tuple(ids[:full * BS]), block_size=BS, lora_name=None, lora_id=None,
        medium="GPU", group_idx=0, opaque=(False,) * full),)  # vLLM's extra_keys: [nil] * n


async def test_the_answer_s_blocks_are_stored_as_their_tokens_are_computed():
    prompt = list(range(100, 120))  # a block and 4 tokens
    async with Fleet(n=1, config=EVENTS) as fleet, zmq_context() as ctx, \
            aiohttp.ClientSession() as s:
        sub, probes = await subscribe(ctx, s, fleet.urls[0])
        answer = (await post(s, fleet.urls[0], prompt, max_tokens=30))["choices"][0]["text"]
        batches = [decode(await receive(sub)) for _ in range(3)]  # 49 tokens computed
    tokens = [*prompt, *tokenizer.encode(answer)]
    assert stored_ids(batches) == tokens[:3 * BS]
    assert [b.seq for b in batches] == [probes[-1].seq + k for k in (1, 2, 3)]
    hashes = [wire_hash(h) for h in block_hashes(tokens, BS)]
    assert [(e.block_hashes, e.parent) for b in batches for e in b.events] == [
        ((hashes[0],), None), ((hashes[1],), hashes[0]), ((hashes[2],), hashes[1])]


async def test_vllm_s_own_decoder_reads_the_batches_byte_for_byte():
    vllm_events = pytest.importorskip("vllm.distributed.kv_events")
    async with Fleet(n=1, config=EVENTS) as fleet, zmq_context() as ctx, \
            aiohttp.ClientSession() as s:
        sub, _ = await subscribe(ctx, s, fleet.urls[0])
        await post(s, fleet.urls[0], PROMPT)
        topic, seq, payload = await receive(sub)
    batch = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(payload)
    (event,) = batch.events
    ours = decode([topic, seq, payload]).events[0]
    assert isinstance(event, vllm_events.BlockStored) and isinstance(ours, Stored)
    assert (event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
            event.medium, event.lora_name, event.group_idx) == (
        list(ours.block_hashes), None, list(ours.token_ids), BS, "GPU", None, 0)
    assert batch.data_parallel_rank == 0 and topic == b"kv"
    # vLLM writes the same bytes: same field order, tags and omitted defaults
    assert msgspec.msgpack.encode(batch) == payload


async def test_evictions_remove_exactly_the_evicted_blocks_and_the_index_follows():
    config = dataclasses.replace(FAST, kv_cache_tokens=10 * BS, max_model_len=8 * BS)
    first, second = list(range(4 * BS)), list(range(1000, 1000 + 7 * BS + 8))
    batches: list[list[Any]] = []
    async with running_engine(config, on_kv_events=batches.append) as engine:
        for prompt in (first, second):
            seq = engine.add(prompt, max_tokens=1)
            await seq.wait_beyond(0)
    # the second prompt needs 8 of 10 blocks: 6 never used, then the first prompt's
    # tail, least recently used first
    a = block_hashes(first, BS)
    evicted = [h for h in reversed(a) if not engine.pool.match([h])]
    assert len(evicted) == 2
    payloads = [msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events, data_parallel_rank=0))
                for events in batches]
    decoded = [decode([b"kv", i.to_bytes(8, "big"), p]) for i, p in enumerate(payloads)]
    assert [e for e in decoded[1].events if isinstance(e, Removed)] == [
        Removed(block_hashes=(wire_hash(h),), medium="GPU", group_idx=0) for h in evicted]
    index = KVIndex()
    for b in decoded:
        assert index.apply("r0", b.seq, b.events) is None
    assert index.match(first, None, BS) == {"r0": 2}
    assert index.match(second, None, BS) == {"r0": 7}


async def test_the_replay_returns_the_buffered_batches_then_the_end_marker():
    small = dataclasses.replace(EVENTS, kv_events_buffer_steps=3)
    async with Fleet(config=[EVENTS, small]) as fleet, zmq_context() as ctx, \
            aiohttp.ClientSession() as s:
        for url in fleet.urls:  # 5 batches each, no subscriber yet
            for k in range(5):
                await post(s, url, [20_000 + k] * BS)
        replies = []
        for replica, start in ((fleet[0], 2), (fleet[1], 0)):
            assert replica.kv_events is not None and replica.kv_events.replay_endpoint
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replica.kv_events.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            frames = [await receive(dealer)]
            while frames[-1][2] != END_SEQ:
                frames.append(await receive(dealer))
            replies.append(frames)
    for frames in replies:  # both replay 2, 3, 4: one was asked from 2, one holds 3
        assert frames[-1] == [b"", b"", END_SEQ, b""]
        batches = [decode(f[1:]) for f in frames[:-1]]
        assert [f[1] for f in frames[:-1]] == [b"kv"] * 3
        assert [b.seq for b in batches] == [2, 3, 4]
        assert stored_ids(batches) == [t for k in (2, 3, 4) for t in [20_000 + k] * BS]


async def test_kv_event_sources_names_the_endpoints_as_vllm_does():
    async with Fleet(config=[EVENTS, FAST]) as fleet, aiohttp.ClientSession() as s:
        answers = []
        for url in fleet.urls:
            async with s.get(url + "/kv_event_sources") as resp:
                assert resp.status == 200
                answers.append(await resp.json())
        publisher = fleet[0].kv_events
        assert publisher is not None
        assert answers == [{"0": {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": "tcp://*:" + publisher.endpoint.rsplit(":", 1)[1],
            "replay_endpoint": "tcp://*:" + publisher.replay_endpoint.rsplit(":", 1)[1],
            "buffer_steps": 10_000, "hwm": 100_000, "max_queue_size": 100_000,
            "topic": "kv"}}, {}]  # events off: {} as from vLLM
        assert fleet.kv_event_endpoints == [publisher.endpoint, None]
    kv_config = pytest.importorskip("vllm.config.kv_events")
    assert list(answers[0]["0"]) == [f.name for f in dataclasses.fields(
        kv_config.KVEventsConfig)]


async def test_a_subscriber_that_never_reads_does_not_hold_the_engine_up():
    config = dataclasses.replace(EVENTS, kv_events_hwm=1, step_base_s=0.001,
                                 prefill_per_token_s=0.0, max_num_batched_tokens=32_768)
    async with zmq_context() as ctx:
        publisher = KVEventPublisher(config)
        publisher.bind(0, ctx)
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.subscribe(b"")
        stuck.connect(publisher.endpoint)
        try:
            # ~10 MB of events: 400 prompts of 250 blocks, and the evictions they cause
            async with running_engine(config, on_kv_events=publisher.publish) as engine:
                seqs = [engine.add([i, *range(1, 4000)], max_tokens=1) for i in range(400)]
                await wait_for(lambda: all(s.finished for s in seqs),
                               "every request to finish", within_s=60)
            # the batches that found its queue full were dropped for it, not waited on
            got = []
            while await stuck.poll(500):
                got.append(decode(await stuck.recv_multipart()).seq)
            assert got == sorted(got) and len(got) < publisher.next_seq
        finally:
            await publisher.close()


async def test_the_index_fed_by_the_events_finds_the_replica_that_served_the_prompt():
    ids = tokenizer.encode(PROMPT)
    async with Fleet(n=3, config=EVENTS) as fleet, zmq_context() as ctx, \
            aiohttp.ClientSession() as s:
        index = KVIndex()
        subs = {}
        for url in fleet.urls:
            subs[url], probes = await subscribe(ctx, s, url)
            for b in probes:
                index.apply(url, b.seq, b.events)
        served = fleet.urls[1]
        await post(s, served, PROMPT, max_tokens=4)

        async def caught_up() -> bool:
            while await subs[served].poll(0):
                b = decode(await subs[served].recv_multipart())
                assert index.apply(served, b.seq, b.events) is None  # no batch missed
            return index.match(ids, None, BS)[served] > 0

        await wait_for(caught_up, "the served prompt's blocks in the index")
    assert index.match(ids, None, BS) == {url: len(ids) // BS if url == served else 0
                                          for url in fleet.urls}


async def test_event_ports_follow_the_http_ports_when_only_a_base_port_is_given():
    # Below Linux's ephemeral range (32768+), where busy machines hold thousands of ports.
    for base in random.Random(1).sample(range(20000, 32000, 8), 20):
        fleet = Fleet(n=2, config=EVENTS, base_port=base)
        try:
            await fleet.start()
        except OSError:
            continue
        try:
            assert fleet.urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
            assert fleet.kv_event_endpoints == [f"tcp://127.0.0.1:{base + 2}",
                                                f"tcp://127.0.0.1:{base + 4}"]
            assert [r.kv_events.replay_endpoint for r in fleet if r.kv_events] == [
                f"tcp://127.0.0.1:{base + 3}", f"tcp://127.0.0.1:{base + 5}"]
        finally:
            await fleet.stop()
        return
    pytest.fail("no six consecutive free ports found in 20 tries")


def test_event_ports_that_overlap_the_http_ports_are_refused():
    with pytest.raises(ConfigError, match="kv_events_port"):
        Fleet(n=4, config=EVENTS, base_port=20000, kv_events_port=20002)
    with pytest.raises(ConfigError, match="kv_events_port"):
        Fleet(n=2, config=EVENTS, kv_events_port=65533)


async def test_a_taken_event_port_fails_start_and_leaves_nothing_running():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        fleet = Fleet(n=2, config=EVENTS, kv_events_port=taken.getsockname()[1] - 2)
        with pytest.raises(OSError, match="KV events"):
            await fleet.start()
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_replica_started_alone_publishes_on_ports_the_os_picks():
    replica = await SimReplica(EVENTS).start()
    try:
        assert replica.kv_events is not None
        assert replica.kv_events.endpoint != replica.kv_events.replay_endpoint
        async with zmq_context() as ctx, aiohttp.ClientSession() as s:
            await subscribe(ctx, s, replica.url)  # fails unless events arrive
    finally:
        await replica.stop()


async def test_a_prefix_cache_reset_sends_all_blocks_cleared_and_the_index_forgets_all():
    first, second = list(range(4 * BS)), list(range(1000, 1000 + 2 * BS))
    batches: list[list[Any]] = []
    async with running_engine(EVENTS, on_kv_events=batches.append) as engine:
        await engine.add(first, max_tokens=1).wait_beyond(0)
        assert engine.reset_prefix_cache()  # idle: between steps
        assert len(batches) == 1  # the clear goes out with the next step, as vLLM's does
        await engine.add(second, max_tokens=1).wait_beyond(0)
    payloads = [msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events, data_parallel_rank=0))
                for events in batches]
    decoded = [decode([b"kv", i.to_bytes(8, "big"), p]) for i, p in enumerate(payloads)]
    assert isinstance(decoded[1].events[0], Cleared)
    assert [type(e) for e in decoded[1].events[1:]] == [Stored]
    index = KVIndex()
    assert index.apply("r0", 0, decoded[0].events) is None
    assert index.match(first, None, BS) == {"r0": 4}
    assert index.apply("r0", 1, decoded[1].events) is None
    assert index.match(first, None, BS) == {"r0": 0}
    assert index.match(second, None, BS) == {"r0": 2}


async def test_the_index_finds_a_prompt_served_under_an_adapter_for_that_adapter_only():
    """A subscriber decoding the events of a prompt served under adapter A finds it cached
    for A, not for the base model nor for adapter B: the blocks carry A's `lora_name`
    (and `lora_id`, and A's name per block in `extra_keys`), which roots their chain."""
    ids = tokenizer.encode(PROMPT)
    config = dataclasses.replace(EVENTS, lora=["a=/adapters/a", "b=/adapters/b"])
    async with Fleet(n=1, config=config) as fleet, zmq_context() as ctx, \
            aiohttp.ClientSession() as s:
        url = fleet.urls[0]
        index = KVIndex()
        sub, probes = await subscribe(ctx, s, url)
        for b in probes:
            index.apply(url, b.seq, b.events)
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 4}
        async with s.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200 and (await resp.json())["model"] == "a"
        seen: list[Stored] = []

        async def caught_up() -> bool:
            while await sub.poll(0):
                b = decode(await sub.recv_multipart())
                assert index.apply(url, b.seq, b.events) is None  # no batch missed
                seen.extend(e for e in b.events if isinstance(e, Stored))
            return index.match(ids, "a", BS)[url] > 0

        await wait_for(caught_up, "the prompt's blocks under adapter a in the index")
    full = len(ids) // BS
    assert index.match(ids, "a", BS) == {url: full}
    assert index.match(ids, None, BS) == {url: 0}
    assert index.match(ids, "b", BS) == {url: 0}
    assert seen and all(e.lora_name == "a" and e.lora_id == 1 and e.opaque
                        and not any(e.opaque) for e in seen)
    # the hashes are those of vLLM's chain under a: the tokens with ("lora", "a", path)
    a = fleet[0].adapters.get("a")
    assert a is not None
    assert seen[0].block_hashes == tuple(
        wire_hash(h) for h in block_hashes(ids, BS, ROOT_HASH, a.hash_keys))
