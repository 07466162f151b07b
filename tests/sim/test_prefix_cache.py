"""Block hashes chain like vLLM's, and the pool evicts least recently used blocks,
a prompt's tail before its head."""

from __future__ import annotations

import subprocess
import sys

from dpserve.sim.prefix_cache import BlockPool, block_hashes


def test_equal_prefixes_have_equal_block_hashes_up_to_the_first_difference():
    a = block_hashes(list(range(64)), 16)
    b = block_hashes([*range(40), 999, *range(41, 64)], 16)
    assert len(a) == 4
    assert a[:2] == b[:2] and a[2] != b[2]
    assert a[3] != b[3]  # chained: a later equal block does not match after a difference


def test_a_partial_last_block_has_no_hash():
    assert len(block_hashes(list(range(47)), 16)) == 2


def _hashes_in_a_new_process(env: dict[str, str]) -> str:
    code = "from dpserve.sim.prefix_cache import block_hashes; print(block_hashes(range(48), 16))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=env).stdout


def test_block_hashes_are_the_same_in_every_process_with_the_same_seed():
    """As vLLM's: the first block's parent derives from PYTHONHASHSEED when it is set,
    from a fixed seed otherwise, so processes (replicas, engines) agree unless told
    apart on purpose."""
    unset = {_hashes_in_a_new_process({}) for _ in range(2)}
    seeded = {_hashes_in_a_new_process({"PYTHONHASHSEED": "1"}) for _ in range(2)}
    assert len(unset) == len(seeded) == 1
    assert unset != seeded != {_hashes_in_a_new_process({"PYTHONHASHSEED": "2"})}


def test_released_blocks_stay_cached_until_their_space_is_needed():
    pool = BlockPool(4)
    hashes = block_hashes(list(range(48)), 16)
    assert pool.allocate(3)
    assert all(pool.name(h) for h in hashes)
    pool.release(hashes, 0)
    assert (pool.num_used, pool.num_free, pool.match(hashes)) == (0, 4, 3)
    assert pool.allocate(2)  # one never-used block, then the prompt's last block
    assert pool.match(hashes) == 2
    assert pool.allocate(2)  # then the second, then the first
    assert pool.match(hashes) == 0
    assert not pool.allocate(1)


def test_held_blocks_are_never_evicted():
    pool = BlockPool(2)
    (h,) = block_hashes(list(range(16)), 16)
    assert pool.allocate(1) and pool.name(h)
    assert pool.allocate(1)
    assert not pool.allocate(1)
    assert pool.match([h]) == 1


def test_a_hit_makes_a_block_most_recently_used():
    pool = BlockPool(2)
    a, b = block_hashes(list(range(16)), 16)[0], block_hashes(list(range(1, 17)), 16)[0]
    for h in (a, b):
        assert pool.allocate(1) and pool.name(h)
        pool.release([h], 0)
    pool.acquire([a])
    pool.release([a], 0)
    assert pool.allocate(1)
    assert (pool.match([a]), pool.match([b])) == (1, 0)


def test_a_block_computed_twice_is_cached_once():
    pool = BlockPool(4)
    (h,) = block_hashes(list(range(16)), 16)
    assert pool.allocate(2)
    assert pool.name(h) and not pool.name(h)
    pool.release([h], 1)
    assert (pool.num_cached, pool.num_free) == (1, 4)


def test_a_reset_forgets_every_cached_block_but_not_while_one_is_held():
    evicted: list[int] = []
    pool = BlockPool(4, on_evict=evicted.append)
    hashes = block_hashes(list(range(48)), 16)
    assert pool.allocate(3) and all(pool.name(h) for h in hashes)
    assert not pool.reset_prefix_cache()  # a running sequence's KV
    assert pool.match(hashes) == 3
    pool.release(hashes, 0)
    assert pool.reset_prefix_cache()
    assert (pool.match(hashes), pool.num_cached, pool.num_free) == (0, 0, 4)
    assert pool.allocate(4)
    assert evicted == []  # a reset is reported whole, not block by block
