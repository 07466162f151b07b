"""KV blocks and the prefix cache, accounted the way vLLM's block pool does.

The KV cache is `num_blocks` blocks of `block_size` tokens. A running sequence
holds the blocks its tokens occupy. A full block, of prompt or of generated
tokens, is named by a chained hash once its tokens' KV is computed, so equal
hashes mean equal prefixes up to and including that block. When a sequence ends,
its named blocks are not wiped: they become *evictable*, keep their hash, and
serve later requests that start with the same tokens. New blocks are taken first
from never-named free blocks, then from evictable ones, least recently used
first; a block is evicted (its hash forgotten) only then. So the prefix cache is
whatever part of the KV cache the running batch does not need, as in vLLM, and
it shrinks under load.

Only counts and hashes are kept; no token data. The hashes are vLLM 0.32's own under its
default `--prefix-caching-hash-algo sha256` (`vllm/v1/core/kv_cache_utils.py`,
`hash_block_tokens`): the SHA-256 digest of ``pickle.dumps((parent_digest,
tuple(block_token_ids), None), HIGHEST_PROTOCOL)``, ``None`` being the extra keys of a
block without LoRA, multimodal input, cache salt or prompt embeddings (under a LoRA
adapter they are ``(("lora", name, path),)``, so its blocks are no hit for another
adapter or the base model), and a prompt's first block the child of vLLM's ``NONE_HASH``
(`ROOT_HASH`). A digest is kept as the unsigned int its 32 bytes spell big-endian (so
the engine's bookkeeping stays in ints); its low 64 bits are the int vLLM publishes
(`kv_events.wire_hash`). So a replica names and publishes a block as a vLLM engine does
for the same token ids and PYTHONHASHSEED: a subscriber that recomputes vLLM's hashes
from token ids finds it, and one that keys on token ids and uses the hashes only to
chain and remove blocks (dpserve's index, vllm-router 0.1.17's) sees the same events as
from vLLM. vLLM is not imported: the few lines are mirrored here, and
tests/sim/test_vllm_block_hashes.py holds them to vLLM's. About 1.3 us a 16-token block
(pickle and SHA-256 in C), five times Python's `hash` of the tuple used before: some 0.2
ms for a 2,000-token prompt.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

DIGEST_BYTES: Final = 32
DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"
"""What vLLM derives `NONE_HASH` from for a cryptographic hash when PYTHONHASHSEED is
not set (`kv_cache_utils.resolve_none_hash_seed`)."""


def sha256(value: Any) -> bytes:
    """vLLM's `vllm.utils.hashing.sha256`, the default prefix-caching hash: pickle (the
    interpreter's highest protocol, as vLLM's), then SHA-256. Pickle writes the same
    bytes for the same ints, bytes, tuples and None in every process."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash_seed() -> str:
    """The seed vLLM derives `NONE_HASH` from: PYTHONHASHSEED when set (any value, the
    empty string too, as `os.getenv` returns it), else `DEFAULT_NONE_HASH_SEED`. A
    simulator and a vLLM engine started with the same PYTHONHASHSEED, or both
    without, name equal blocks alike."""
    seed = os.getenv("PYTHONHASHSEED")
    return DEFAULT_NONE_HASH_SEED if seed is None else seed


ROOT_HASH: Final = int.from_bytes(sha256(none_hash_seed()), "big")
"""Parent hash of a prompt's first block: vLLM's `NONE_HASH` for this process's
PYTHONHASHSEED, read once at import as vLLM's engine core reads it at start-up."""


def block_hashes(token_ids: Sequence[int], block_size: int,
                 parent: int = ROOT_HASH, extra_keys: tuple[Any, ...] | None = None
                 ) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block has none),
    the first one the child of `parent` (the block before them, or none), as vLLM's
    `hash_block_tokens` computes them. `extra_keys` are hashed with every block: vLLM's
    for a request under a LoRA adapter, ``(("lora", name, path),)``
    (`adapters.Adapter.hash_keys`); None for the base model. `token_ids` must be Python
    ints: pickle writes other integer types (numpy's) differently."""
    digest = parent.to_bytes(DIGEST_BYTES, "big")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = sha256((digest, tuple(token_ids[start:start + block_size]), extra_keys))
        hashes.append(int.from_bytes(digest, "big"))
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
