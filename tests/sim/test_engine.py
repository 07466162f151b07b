"""The engine follows its timing model: prefill cost, queueing, chunked prefill,
batching, preemption, seeded jitter. Times are read from the engine's own clock
(exact up to the loop's wake-up latency); test_server.py checks them over HTTP."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from dpserve.sim import Engine
from dpserve.sim.tokenizer import output_ids
from tests.sim.conftest import FAST, TOLERANCE_S, running_engine


def ttft(seq) -> float:
    assert seq.first_token_at is not None
    return seq.first_token_at - seq.arrival


async def finish(*seqs) -> None:
    for seq in seqs:
        await seq.wait_beyond(seq.max_tokens - 1)


async def test_ttft_is_one_step_with_the_prompt_prefilled():
    async with running_engine() as engine:
        for length in (16, 1000, 2000):
            seq = engine.add(list(range(length, 2 * length)), max_tokens=1)  # nothing cached
            await finish(seq)
            modelled = FAST.step_base_s + FAST.prefill_per_token_s * length
            assert ttft(seq) == pytest.approx(modelled, abs=TOLERANCE_S)


async def test_ttft_grows_with_queue_depth_when_one_sequence_runs_at_a_time():
    config = dataclasses.replace(FAST, max_num_seqs=1)
    prompt, out = 200, 5
    prefill_s = config.step_base_s + config.prefill_per_token_s * prompt
    service_s = prefill_s + (out - 1) * (config.step_base_s + config.decode_per_seq_s)
    async with running_engine(config) as engine:
        seqs = [engine.add([i] * prompt, max_tokens=out) for i in range(4)]
        assert (engine.num_running, engine.num_waiting) == (0, 4)
        await finish(*seqs)
    for depth, seq in enumerate(seqs):
        assert ttft(seq) == pytest.approx(depth * service_s + prefill_s, abs=TOLERANCE_S)


async def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget():
    config = dataclasses.replace(FAST, max_num_batched_tokens=512)
    async with running_engine(config) as engine:
        seq = engine.add(list(range(1300)), max_tokens=1)
        await finish(seq)
    # 512 + 512 + 276 tokens in three steps
    modelled = 3 * config.step_base_s + config.prefill_per_token_s * 1300
    assert ttft(seq) == pytest.approx(modelled, abs=TOLERANCE_S)
    assert engine.stats.steps == 3


async def test_a_batch_decodes_one_token_per_sequence_per_step():
    async with running_engine() as engine:
        seqs = [engine.add([i] * 32, max_tokens=10) for i in range(8)]
        await finish(*seqs)
    # one step prefills all eight prompts, nine more decode them together
    assert engine.stats.steps == 10
    assert engine.stats.generation_tokens == 80
    assert all(s.output_count == 10 and s.finished for s in seqs)
    assert engine.pool.num_used == 0


async def test_cached_prefix_blocks_cost_no_prefill_time():
    shared = list(range(1024))
    async with running_engine() as engine:
        first = engine.add([*shared, 1, 2, 3], max_tokens=1)
        await finish(first)
        second = engine.add([*shared, 4, 5, 6], max_tokens=1)
        await finish(second)
    assert second.num_cached == 1024
    assert engine.stats.prefix_cache_hits == 1024
    assert engine.stats.prefix_cache_queries == 2 * 1027
    assert ttft(second) == pytest.approx(FAST.step_base_s + FAST.prefill_per_token_s * 3,
                                         abs=TOLERANCE_S)
    assert ttft(second) < ttft(first) - 0.015


async def test_a_fully_cached_prompt_still_computes_its_last_token():
    async with running_engine() as engine:
        for _ in range(2):
            seq = engine.add(list(range(64)), max_tokens=1)
            await finish(seq)
    assert seq.num_cached == 48  # the last block is recomputed for its final token


async def test_a_follow_up_that_repeats_the_answer_finds_the_answer_s_blocks_cached():
    prompt = list(range(100, 132))  # two blocks
    async with running_engine() as engine:
        first = engine.add(prompt, max_tokens=40)  # 71 tokens computed: 4 full blocks
        await finish(first)
        answer = output_ids(prompt, 0, 40)
        second = engine.add([*prompt, *answer, 7, 8], max_tokens=1)
        await finish(second)
    assert second.num_cached == 64  # the prompt's 2 blocks and the answer's first 2


async def test_without_prefix_caching_nothing_is_cached():
    config = dataclasses.replace(FAST, enable_prefix_caching=False)
    async with running_engine(config) as engine:
        for _ in range(2):
            seq = engine.add(list(range(512)), max_tokens=1)
            await finish(seq)
    assert seq.num_cached == 0 and engine.stats.prefix_cache_hits == 0


async def test_a_full_kv_cache_preempts_the_newest_sequence_which_still_completes():
    config = dataclasses.replace(FAST, max_model_len=512, kv_cache_tokens=1024,
                                 step_base_s=0.001)
    async with running_engine(config) as engine:
        seqs = [engine.add([i] * 200, max_tokens=150) for i in range(4)]
        await finish(*seqs)
    assert engine.stats.preemptions > 0
    assert [s.output_count for s in seqs] == [150] * 4
    assert engine.pool.num_used == 0


async def test_aborting_a_running_sequence_frees_its_blocks():
    async with running_engine() as engine:
        seq = engine.add(list(range(300)), max_tokens=1000)
        await seq.wait_beyond(2)
        assert engine.pool.num_used > 0
        engine.abort(seq)
        assert seq.finished and engine.num_running == 0 and engine.pool.num_used == 0
        assert engine.stats.requests_aborted == 1
        await asyncio.sleep(FAST.step_base_s * 2)  # a step in flight must not revive it
        assert engine.pool.num_used == 0


async def test_step_jitter_is_seeded():
    config = dataclasses.replace(FAST, step_jitter=0.2, seed=7)

    def step_times(engine: Engine) -> list[float]:
        return [engine._step_time([]) for _ in range(5)]

    assert step_times(Engine(config)) == step_times(Engine(config))
    assert step_times(Engine(config)) != step_times(Engine(config, seed=8))
    assert all(0.8 * FAST.step_base_s <= t <= 1.2 * FAST.step_base_s
               for t in step_times(Engine(config)))


async def test_slowdown_stretches_every_step():
    async with running_engine() as engine:
        engine.slowdown = 3.0
        seq = engine.add(list(range(100)), max_tokens=1)
        await finish(seq)
    modelled = 3 * (FAST.step_base_s + FAST.prefill_per_token_s * 100)
    assert ttft(seq) == pytest.approx(modelled, abs=TOLERANCE_S)


def test_a_reset_preempts_running_sequences_which_then_recompute_everything():
    # Stepped by hand, as the virtual-clock benchmarks step it: a reset is served
    # between two steps, never while one is in flight.
    engine = Engine(FAST)
    seq = engine.add(list(range(64)), max_tokens=10)
    batch, _ = engine._schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.reset_prefix_cache(reset_running_requests=True)
    engine._finish_step(batch, 1.0)
    assert engine.pool.num_cached == 4
    assert not engine.reset_prefix_cache()  # the running sequence holds its blocks
    assert engine.reset_prefix_cache(reset_running_requests=True)
    assert (engine.running, list(engine.waiting)) == ([], [seq])
    assert (engine.pool.num_cached, engine.pool.num_used, engine.stats.preemptions) == (0, 0, 1)
    batch, _ = engine._schedule()
    assert batch == [(seq, 65)]  # the prompt and the token emitted, nothing cached
    engine._finish_step(batch, 2.0)
    assert seq.output_count == 2 and seq.num_cached == 0
