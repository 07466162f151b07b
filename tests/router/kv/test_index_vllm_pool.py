"""The index against the events vLLM's own block pool writes (vLLM 0.32, installed for
the tests), encoded as its ZMQ publisher sends them and read by the router's decoder:
the index never says a replica holds more than the pool would hit on, and says as
much when each block was stored once."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from dpserve.router.kv.events import decode
from dpserve.router.kv.index import KVIndex

BS = 4
PROMPT = list(range(100, 112))  # 3 blocks


@pytest.fixture(scope="module")
def vllm() -> Iterator[SimpleNamespace]:
    """vLLM's block pool, request and hashing (the import takes seconds)."""
    ns = SimpleNamespace(
        hashing=pytest.importorskip("vllm.utils.hashing"),
        utils=pytest.importorskip("vllm.v1.core.kv_cache_utils"),
        pool=pytest.importorskip("vllm.v1.core.block_pool"),
        request=pytest.importorskip("vllm.v1.request"),
        sampling=pytest.importorskip("vllm.sampling_params"),
        events=pytest.importorskip("vllm.distributed.kv_events"))
    ns.utils.init_none_hash(ns.hashing.sha256)
    yield ns
    ns.utils.init_none_hash(ns.hashing.sha256)


class Engine:
    """vLLM's `BlockPool` with events on, and the index following what it publishes."""

    def __init__(self, vllm: SimpleNamespace, num_blocks: int) -> None:
        self.vllm = vllm
        self.pool = vllm.pool.BlockPool(num_blocks, True, BS, enable_kv_cache_events=True)
        self.index = KVIndex()
        self.seq = 0
        self._ids = 0

    def request(self, ids: list[int], **extra_args: str) -> Any:
        self._ids += 1
        params = self.vllm.sampling.SamplingParams(max_tokens=1, extra_args=extra_args or None)
        return self.vllm.request.Request(
            f"r{self._ids}", ids, params, None,
            block_hasher=self.vllm.utils.get_request_block_hasher(BS, self.vllm.hashing.sha256))

    def compute(self, ids: list[int]) -> Any:
        """A request that computed `ids` in blocks of its own (no prefix hit taken, as
        when two arrive in one step), its full blocks cached; returns the blocks."""
        request = self.request(ids)
        n = len(ids) // BS
        blocks = self.pool.get_new_blocks(n)
        self.pool.cache_full_blocks(request, blocks, 0, n, BS, 0)
        self.publish()
        return blocks

    def evict(self, blocks: Any) -> None:
        """`blocks` freed, then every free block taken by new work: the cached ones are
        evicted, as under memory pressure."""
        self.pool.free_blocks(blocks)
        taken = self.pool.get_new_blocks(self.pool.get_num_free_blocks())
        self.publish()
        self.pool.free_blocks(taken)

    def publish(self) -> None:
        batch = self.vllm.events.KVEventBatch(ts=1.0, events=self.pool.take_events())
        frames = [b"kv", self.seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]
        decoded = decode(frames)
        assert self.index.apply("r0", decoded.seq, decoded.events) is None
        self.seq += 1

    def hits(self, ids: list[int]) -> int:
        """Leading blocks of `ids` the pool itself would hit on."""
        hasher = self.vllm.utils.get_request_block_hasher(BS, self.vllm.hashing.sha256)
        request = self.vllm.request.Request(
            "probe", ids, self.vllm.sampling.SamplingParams(max_tokens=1), None,
            block_hasher=hasher)
        n = 0
        for h in request.block_hashes:
            if self.pool.get_cached_block(h, [0]) is None:
                break
            n += 1
        return n


def test_a_second_copy_s_eviction_makes_the_index_underestimate_never_over(vllm):
    engine = Engine(vllm, num_blocks=10)
    first = engine.compute(PROMPT)
    assert engine.index.match(PROMPT, None, BS) == {"r0": 3} == {"r0": engine.hits(PROMPT)}
    second = engine.compute(PROMPT)  # its own copy: vLLM stores the same hashes again
    engine.evict(first)
    assert engine.hits(PROMPT) == 3  # the pool still hits on the second copy
    assert engine.index.match(PROMPT, None, BS) == {"r0": 0}  # forgotten: see index.py
    engine.evict(second)
    assert engine.hits(PROMPT) == engine.index.match(PROMPT, None, BS)["r0"] == 0


def test_reused_blocks_a_client_asks_announced_again_are_gone_when_evicted(vllm):
    """`"vllm_xargs": {"kv_cache_report_mode": "full"}` makes vLLM store again the
    blocks a request reused (no new copy): one removal must still forget them."""
    engine = Engine(vllm, num_blocks=10)
    blocks = engine.compute(PROMPT)
    reuse = engine.request(PROMPT, kv_cache_report_mode="full")
    assert reuse.kv_cache_report_mode == "full"
    engine.pool.emit_cached_block_events(reuse, 3, BS, 0)  # as KVCacheManager does
    engine.publish()
    assert engine.index.match(PROMPT, None, BS) == {"r0": 3}
    engine.evict(blocks)
    assert engine.hits(PROMPT) == 0
    assert engine.index.match(PROMPT, None, BS) == {"r0": 0}
