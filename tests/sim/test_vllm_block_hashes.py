"""A simulated replica names and publishes KV blocks as vLLM 0.32 does: for the same
token ids, its block hashes are the ones a vLLM engine with the default prefix-caching
hash (sha256) computes, and the ints in its events the ones vLLM's events carry, for
the same PYTHONHASHSEED (or none). vLLM's own functions compute the expected values
here; the simulator never imports vLLM (it is installed for the tests)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from dpserve.sim import kv_events
from dpserve.sim.adapters import Adapter
from dpserve.sim.prefix_cache import ROOT_HASH, block_hashes
from tests.sim.conftest import FAST, running_engine
from tests.waiting import wait_for

SEQUENCES = [
    list(range(64)),  # small ids: one-byte pickle opcodes
    [255, 256, 65535, 65536, 151_643, 0, 1, 2**31 - 1] * 8,  # every int opcode width
    [*range(40), 999, *range(41, 64)],  # shares its first two 16-token blocks with the first
]


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    """vLLM's hashing functions, imported only here (the import takes seconds)."""
    return SimpleNamespace(
        hashing=pytest.importorskip("vllm.utils.hashing"),
        utils=pytest.importorskip("vllm.v1.core.kv_cache_utils"),
        request=pytest.importorskip("vllm.v1.request"),
        sampling=pytest.importorskip("vllm.sampling_params"))


@pytest.fixture
def engine_hashes(vllm: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A vLLM `Request` factory whose block hashes are computed as vLLM's engine core
    computes them (`init_none_hash`, then `get_request_block_hasher`), with this
    process's PYTHONHASHSEED, which the simulator read at import. vLLM's NONE_HASH is
    set again afterwards, for the environment as it was."""
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    sha256 = vllm.hashing.sha256
    vllm.utils.init_none_hash(sha256)

    def request(ids: list[int], block_size: int, lora_request: Any = None) -> Any:
        hasher = vllm.utils.get_request_block_hasher(block_size, sha256)
        return vllm.request.Request("r", ids, vllm.sampling.SamplingParams(max_tokens=1),
                                    None, block_hasher=hasher, lora_request=lora_request)

    yield request
    monkeypatch.undo()
    vllm.utils.init_none_hash(sha256)


def published(request: Any, vllm: SimpleNamespace) -> list[int]:
    return [vllm.utils.maybe_convert_block_hash(h) for h in request.block_hashes]


def digests(hashes: list[int]) -> list[bytes]:
    """The simulator's hashes as vLLM's `BlockHash` bytes (it keeps them as ints)."""
    return [h.to_bytes(32, "big") for h in hashes]


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("ids", SEQUENCES)
def test_block_hashes_are_vllm_s_for_the_same_tokens(
        ids: list[int], block_size: int, vllm: SimpleNamespace, engine_hashes: Any) -> None:
    request = engine_hashes(ids, block_size)
    assert ROOT_HASH.to_bytes(32, "big") == vllm.utils.NONE_HASH
    assert digests(block_hashes(ids, block_size)) == request.block_hashes
    assert [kv_events.wire_hash(h) for h in block_hashes(ids, block_size)] == published(
        request, vllm)


def test_a_chain_continued_from_a_parent_is_vllm_s_continued_chain(
        vllm: SimpleNamespace, engine_hashes: Any) -> None:
    """The simulator hashes an answer's blocks as they fill, each run from the last
    hash so far; vLLM extends a request's hashes as output tokens are appended."""
    ids = SEQUENCES[1]
    request = engine_hashes(ids[:20], 16)
    request.append_output_token_ids(ids[20:])
    head = block_hashes(ids[:16], 16)
    assert digests(head + block_hashes(ids[16:], 16, head[-1])) == request.block_hashes


async def test_a_replica_publishes_vllm_s_ints_for_its_prompt_and_answer(
        vllm: SimpleNamespace, engine_hashes: Any) -> None:
    bs = FAST.block_size
    prompt = [7, 300, 70_000, *range(1000, 1000 + 2 * bs)]  # 2 blocks and 3 tokens
    batches: list[list[kv_events.Event]] = []
    async with running_engine(FAST, on_kv_events=batches.append) as engine:
        seq = engine.add(prompt, max_tokens=3 * bs)
        while not seq.finished:
            await seq.wait_beyond(seq.output_count)
    events = [e for b in batches for e in b if isinstance(e, kv_events.BlockStored)]
    request = engine_hashes(prompt, bs)
    request.append_output_token_ids(seq.token_ids(len(prompt), seq.num_tokens))
    expected = published(request, vllm)
    hashes = [h for e in events for h in e.block_hashes]
    assert len(hashes) >= 4 and hashes == expected[:len(hashes)]
    assert [t for e in events for t in e.token_ids] == seq.token_ids(0, len(hashes) * bs)
    # each event's parent is the block before its first, none for the prompt's first
    starts = [sum(len(e.block_hashes) for e in events[:i]) for i in range(len(events))]
    assert [e.parent_block_hash for e in events] == [
        hashes[i - 1] if i else None for i in starts]


def test_with_the_same_pythonhashseed_as_vllm_the_hashes_are_vllm_s(
        vllm: SimpleNamespace, engine_hashes: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM seeds its first block's parent with PYTHONHASHSEED when it is set; so does
    the simulator, read at import (a fresh process here)."""
    ids, seed = SEQUENCES[0], "1234"
    code = ("from dpserve.sim.prefix_cache import block_hashes; "
            "from dpserve.sim.kv_events import wire_hash; "
            f"print([wire_hash(h) for h in block_hashes({ids!r}, 16)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": seed}).stdout
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    vllm.utils.init_none_hash(vllm.hashing.sha256)
    expected = published(engine_hashes(ids, 16), vllm)
    assert out == f"{expected}\n"
    assert expected != [kv_events.wire_hash(h) for h in block_hashes(ids, 16)]


# --- LoRA adapters --------------------------------------------------------------------

ADAPTER = Adapter(name="sql-lora", path="/adapters/sql", id=3)


@pytest.fixture
def lora_request(vllm: SimpleNamespace) -> Any:
    lora = pytest.importorskip("vllm.lora.request")
    return lora.LoRARequest(ADAPTER.name, ADAPTER.id, ADAPTER.path)


@pytest.mark.parametrize("ids", SEQUENCES)
def test_block_hashes_under_an_adapter_are_vllm_s_for_a_lora_request(
        ids: list[int], vllm: SimpleNamespace, engine_hashes: Any, lora_request: Any) -> None:
    request = engine_hashes(ids, 16, lora_request)
    ours = block_hashes(ids, 16, ROOT_HASH, ADAPTER.hash_keys)
    assert digests(ours) == request.block_hashes
    # vLLM's own extra keys for one of those blocks are the ones hashed
    keys, _ = vllm.utils.generate_block_hash_extra_keys(request, 0, 16, 0)
    assert keys == ADAPTER.hash_keys
    # no block of the chain is the base model's, nor another adapter's (or another path's)
    renamed = Adapter(name="other", path=ADAPTER.path, id=3)
    moved = Adapter(name=ADAPTER.name, path="/adapters/sql-v2", id=3)
    others = [block_hashes(ids, 16), *(block_hashes(ids, 16, ROOT_HASH, a.hash_keys)
                                       for a in (renamed, moved))]
    assert all(not set(ours) & set(other) for other in others)


def _vllm_stored(vllm: SimpleNamespace, request: Any, num_blocks: int, block_size: int
                 ) -> Any:
    """The `BlockStored` vLLM 0.32's block pool writes when `request`'s first `num_blocks`
    blocks are cached, stamped with the group's kind as its KV-cache manager does."""
    pool_module = pytest.importorskip("vllm.v1.core.block_pool")
    pool = pool_module.BlockPool(num_blocks + 1, True, block_size, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(num_blocks), 0, num_blocks,
                           block_size, 0)
    (event,) = pool.take_events()
    event.kv_cache_spec_kind = "full_attention"  # KVCacheManager.take_events, a dense model
    return event


@pytest.mark.parametrize("adapter", [None, ADAPTER])
async def test_a_replica_s_stored_event_is_the_one_vllm_writes(
        adapter: Adapter | None, vllm: SimpleNamespace, engine_hashes: Any,
        lora_request: Any) -> None:
    """Field for field and byte for byte, for the base model (`extra_keys` one nil per
    block) and under an adapter (its id and name, and the name per block)."""
    vllm_events = pytest.importorskip("vllm.distributed.kv_events")
    bs = FAST.block_size
    prompt = list(range(500, 500 + 3 * bs + 5))
    batches: list[list[kv_events.Event]] = []
    async with running_engine(FAST, on_kv_events=batches.append) as engine:
        seq = engine.add(prompt, max_tokens=1, lora=adapter)
        await wait_for(lambda: batches, "the prompt's blocks stored")
        await seq.wait_beyond(0)
    (ours,) = batches[0]
    request = engine_hashes(prompt, bs, lora_request if adapter else None)
    theirs = _vllm_stored(vllm, request, 3, bs)
    assert msgspec.msgpack.encode(ours) == msgspec.msgpack.encode(theirs)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(ours), type=vllm_events.BlockStored)
    assert (decoded.lora_id, decoded.lora_name, decoded.extra_keys) == (
        (None, None, [None] * 3) if adapter is None else (3, "sql-lora", [("sql-lora",)] * 3))
