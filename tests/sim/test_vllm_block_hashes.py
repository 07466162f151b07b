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

import pytest

from dpserve.sim import kv_events
from dpserve.sim.prefix_cache import ROOT_HASH, block_hashes
from tests.sim.conftest import FAST, running_engine

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

    def request(ids: list[int], block_size: int) -> Any:
        hasher = vllm.utils.get_request_block_hasher(block_size, sha256)
        return vllm.request.Request("r", ids, vllm.sampling.SamplingParams(max_tokens=1),
                                    None, block_hasher=hasher)

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
