"""KV blocks and the prefix cache, accounted the way vLLM's block pool does.

The KV cache is `num_blocks` blocks of `block_size` tokens. A running sequence
holds the blocks its tokens occupy. A full block, of prompt or of generated
tokens, is named by a chained hash, ``hash((parent_hash, block_token_ids))``,
once its tokens' KV is computed, so equal hashes mean equal prefixes up to and
including that block. When a sequence ends, its named
blocks are not wiped: they become *evictable*, keep their hash, and serve later
requests that start with the same tokens. New blocks are taken first from
never-named free blocks, then from evictable ones, least recently used first;
a block is evicted (its hash forgotten) only then. So the prefix cache is
whatever part of the KV cache the running batch does not need, as in vLLM, and
it shrinks under load.

Only counts and hashes are kept; no token data. Hashes use Python's `hash` on
tuples of ints, which is the same in every process (no hash randomization).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

ROOT_HASH = 0x5151_5151
"""Parent hash of a prompt's first block."""


def block_hashes(token_ids: Sequence[int], block_size: int,
                 parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block has none),
    the first one the child of `parent` (the block before them, or none)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class BlockPool:
    """Free, held and cached KV blocks. Every method is O(blocks touched)."""

    def __init__(self, num_blocks: int, *, on_evict: Callable[[int], None] | None = None) -> None:
        """`on_evict(hash)` is called for each block evicted (its hash forgotten)."""
        self.num_blocks = num_blocks
        self._on_evict = on_evict
        self._free_unnamed = num_blocks
        self._refs: dict[int, int] = {}
        """Hash -> number of sequences holding that block (0: evictable)."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Named blocks no sequence holds, least recently used first."""

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never-named plus evictable)."""
        return self._free_unnamed + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose hash is known, held or evictable."""
        return len(self._refs)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    def acquire(self, hashes: Iterable[int]) -> None:
        """Hold cached blocks (from `match`) for a sequence."""
        for h in hashes:
            refs = self._refs[h]
            if refs == 0:
                del self._evictable[h]
            self._refs[h] = refs + 1

    def allocate(self, n: int) -> bool:
        """Hand out `n` unnamed blocks, evicting least recently used cached ones as
        needed; False (and nothing changed) when fewer than `n` are free."""
        if n > self.num_free:
            return False
        take = min(n, self._free_unnamed)
        self._free_unnamed -= take
        for _ in range(n - take):
            h, _ = self._evictable.popitem(last=False)
            del self._refs[h]
            if self._on_evict is not None:
                self._on_evict(h)
        return True

    def name(self, h: int) -> bool:
        """Give a held unnamed block, now full, its hash. False if that hash is cached
        already (another sequence computed the same block): the block stays unnamed."""
        if h in self._refs:
            return False
        self._refs[h] = 1
        return True

    def release(self, hashes: Sequence[int], unnamed: int) -> None:
        """Give back a sequence's blocks. Named blocks are released last block first, so
        a prompt's tail is evicted before its head, which more requests share."""
        for h in reversed(hashes):
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._evictable[h] = None
        self._free_unnamed += unnamed

    def reset_prefix_cache(self) -> bool:
        """Forget every block's hash, as vLLM's pool does when its prefix cache is reset
        (after a weight reload, whose KV would differ). False, and nothing changed, while
        a sequence holds any block: its KV is in use. Evictions are not reported one by
        one: the engine reports the reset as a whole (`AllBlocksCleared`)."""
        if self.num_used:
            return False
        self._refs.clear()
        self._evictable.clear()
        self._free_unnamed = self.num_blocks
        return True
