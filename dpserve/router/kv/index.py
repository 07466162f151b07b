"""Which replica holds which KV-cache blocks, kept exact by the events each publishes,
and how many of a prompt's leading blocks each one holds.

Every block is known twice. By the engine's hash (with its medium and KV-cache group),
because that is what `BlockRemoved` names. And by a *router-side chain key*: a hash of
the parent's chain key and the block's token ids, rooted in the LoRA adapter's name,
because a prompt arrives as token ids and the engine's hash has a seed the router does
not know (random per process for non-cryptographic hashes) nor needs to.

The chain key is Python's own `hash()` of `(parent_key, tokens_tuple)`: about 0.2 us for
a 16-token block, where blake2b over packed ints costs several times that, and a
prompt of 8k tokens in 16-token blocks is 512 of them per request. Ints and tuples of
ints are not salted, and the root is a digest of the adapter's name, so keys agree
between processes of one Python build: routers tell each other the keys they sent
(`dpserve.router.peers`), checked by `KEY_FINGERPRINT`. It is not collision-resistant
against a crafted prompt: the worst a collision does is send a request to a replica
that lacks its prefix.

A router's own knowledge, blocks it sent that no event has reported yet, lives beside
the index in a :class:`~dpserve.router.kv.forecast.Forecast`, which the index keeps in
step: a block reported stored leaves every forecast.

Ordering: each replica's batches are numbered from 0 by its publisher. A batch that
skips numbers leaves the replica *stale*: it scores 0, and later batches are ignored
until the missing ones are applied in order (the publisher's replay), a batch holding
`AllBlocksCleared` starts it afresh, or `drop` forgets it. A batch numbered 0 after
others means the engine restarted: its cache is empty, so is the replica's state.

The replica's state starts from the first batch seen. Blocks stored before it are
unknown: the index underestimates what such a replica holds, never overestimates.

Copies are not counted, on purpose. Two requests that compute one prefix at once each
cache a copy, and vLLM stores both under the same hashes, then sends a `BlockRemoved`
per copy evicted: the index forgets the block at the first, while the engine still
hits on the other (an underestimate, until the prefix is stored again). Counting
copies would be exact for that, but vLLM also stores again, with no new copy, the
blocks a request reused when it asks for `"vllm_xargs": {"kv_cache_report_mode":
"full"}`, which any client can send: those would never be removed as often as stored,
and the index would overestimate for as long as the replica runs
(tests/router/kv/test_index_vllm_pool.py holds both cases to vLLM's own block pool).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from dpserve.router.kv.events import BlockHash, Cleared, Event, Removed, Stored
from dpserve.router.kv.forecast import Forecast

DEFAULT_MAX_BLOCKS = 1_000_000
"""Blocks remembered per replica: an 80 GiB GPU of a 7B model holds ~30k 16-token
blocks, and CPU offloading tiers a few times that."""

_BlockKey = tuple[str | None, int, BlockHash]
"""(medium, KV-cache group, engine hash): a block's name in the engine's events."""


def root_key(lora: str | None) -> int:
    """The chain key before a prompt's first block: the adapter's (a digest of its name,
    the same in every process), or the base model's."""
    if lora is None:
        return 0
    digest = hashlib.blake2b(lora.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True) or 1


def chain_key(parent: int, tokens: tuple[int, ...]) -> int:
    """The chain key of a block of `tokens` after the block whose key is `parent`."""
    return hash((parent, tokens))


class PromptChain:
    """One prompt's chain keys per block size, each hashed once per request: matching
    hashes them only as deep as some replica holds the prompt, and the forecast of
    where it was sent then takes every full block's, reusing those."""

    __slots__ = ("_keys", "root", "tokens")

    def __init__(self, token_ids: Sequence[int], lora: str | None) -> None:
        self.tokens = tuple(token_ids)
        self.root = root_key(lora)
        self._keys: dict[int, list[int]] = {}

    def hashed(self, block_size: int) -> list[int]:
        """The keys hashed so far, in order: the list itself, which a walk that goes
        deeper extends (`_extend`)."""
        return self._keys.setdefault(block_size, [])

    def keys(self, block_size: int) -> list[int]:
        """The chain keys of every full block, in order (a copy)."""
        keys = self.hashed(block_size)
        _extend(keys, self.tokens, self.root, block_size, len(self.tokens) // block_size)
        return list(keys)


def _extend(keys: list[int], tokens: tuple[int, ...], root: int, block_size: int,
            blocks: int) -> None:
    """Hash `keys` on until it holds the first `blocks` blocks' keys."""
    for n in range(len(keys), blocks):
        keys.append(chain_key(keys[-1] if keys else root,
                              tokens[n * block_size:(n + 1) * block_size]))


def prompt_keys(token_ids: Sequence[int], lora: str | None, block_size: int) -> list[int]:
    """The chain keys of every full block of a prompt, in order."""
    return PromptChain(token_ids, lora).keys(block_size)


KEY_FINGERPRINT = chain_key(root_key("dpserve"), tuple(range(16)))
"""A chain key every process of the same build computes alike: routers whose
fingerprints differ (another Python, another dpserve) cannot share keys."""


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    blocks: int
    """Blocks known to be held (all media and groups)."""
    stale: bool
    """A batch was missed: the replica scores 0 until it is caught up."""
    seq: int | None
    """The last batch applied."""
    applied: int
    """Events applied."""
    skipped: int
    """Events of a kind unknown to the decoder."""
    gaps: int
    """Times a batch arrived with numbers missing before it."""
    evicted: int
    """Blocks forgotten to stay within the cap (the oldest stored first)."""
    unkeyed: int
    """Blocks stored without a chain key (unknown parent, images, cache salt)."""


class _Replica:
    __slots__ = ("applied", "block_size", "blocks", "chains", "evicted", "gaps", "latest",
                 "seq", "skipped", "stale", "unkeyed")

    def __init__(self) -> None:
        self.blocks: OrderedDict[_BlockKey, int | None] = OrderedDict()
        self.chains: dict[int, int] = {}  # chain key -> how many blocks carry it
        self.seq: int | None = None
        self.latest = -1  # the highest batch number seen, applied or not
        self.stale = False
        self.applied = self.skipped = self.gaps = self.evicted = self.unkeyed = 0
        self.block_size: int | None = None
        """Of the keyed blocks it last stored: the size its chain keys are cut at."""

    def clear(self) -> None:
        self.blocks.clear()
        self.chains.clear()

    def forget(self, key: _BlockKey) -> None:
        chain = self.blocks.pop(key, None)
        if chain is not None:
            left = self.chains[chain] - 1
            if left:
                self.chains[chain] = left
            else:
                del self.chains[chain]

    def store(self, event: Stored, max_blocks: int, forecasts: Sequence[Forecast] = (),
              rid: Hashable = None) -> None:
        group = event.group_idx or 0
        size = event.block_size
        if group == 0:
            self.block_size = size
        n = len(event.block_hashes)
        sent = [held for f in forecasts if (held := f.holds(rid))]
        # Only tokens that line up one block per hash can be keyed, and only in the
        # first KV-cache group (a hybrid model's other groups mirror it).
        keyable = group == 0 and len(event.token_ids) == n * size
        if event.parent is None:
            chain: int | None = root_key(event.lora_name)
        else:
            chain = self.blocks.get((event.medium, group, event.parent))
        for i, engine_hash in enumerate(event.block_hashes):
            if chain is not None and keyable and not (event.opaque and event.opaque[i]):
                chain = chain_key(chain, event.token_ids[i * size:(i + 1) * size])
            else:
                chain = None
                self.unkeyed += 1
            key = (event.medium, group, engine_hash)
            if key in self.blocks:
                self.forget(key)
            self.blocks[key] = chain
            if chain is not None:
                self.chains[chain] = self.chains.get(chain, 0) + 1
                for held in sent:
                    held.pop(chain, None)
        while len(self.blocks) > max_blocks:
            self.forget(next(iter(self.blocks)))
            self.evicted += 1

    def remove(self, event: Removed) -> None:
        group = event.group_idx or 0
        for engine_hash in event.block_hashes:
            self.forget((event.medium, group, engine_hash))


class KVIndex:
    """The blocks each replica holds, by replica id (any hashable: dpserve uses the
    replica's URL). Not thread-safe: one owner applies events and matches."""

    def __init__(self, *, max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be at least 1, "
                             f"got {max_blocks_per_replica}")
        self._max_blocks = max_blocks_per_replica
        self._replicas: dict[Hashable, _Replica] = {}
        self._forecasts: list[Forecast] = []

    def forecast(self, forecast: Forecast | None = None) -> Forecast:
        """A forecast (`forecast`, or a new one) kept in step with this index: a block
        reported stored leaves it, a replica cleared, restarted or dropped is cleared in
        it. Each router keeps its own (several share one index in benchmarks)."""
        forecast = forecast if forecast is not None else Forecast()
        self._forecasts.append(forecast)
        return forecast

    def _clear_forecasts(self, replica_id: Hashable) -> None:
        for forecast in self._forecasts:
            forecast.clear(replica_id)

    def apply(self, replica_id: Hashable, seq: int, events: Iterable[Event], *,
              skipped: int = 0) -> int | None:
        """Apply the batch numbered `seq` from `replica_id`.

        Returns None when the replica is up to date, or the number of the first
        batch it is missing (ask the publisher's replay for it) when it is stale."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            replica = self._replicas[replica_id] = _Replica()
        events = tuple(events)
        if replica.seq is not None:
            if seq == 0 and replica.seq > 0:  # the publisher restarted, with it the engine
                replica.clear()
                self._clear_forecasts(replica_id)
                replica.stale = False
                replica.latest = -1
            elif seq <= replica.seq:  # seen already (a replay overlapping the stream)
                return replica.seq + 1 if replica.stale else None
            elif seq > replica.seq + 1:
                replica.latest = max(replica.latest, seq)
                if not any(isinstance(e, Cleared) for e in events):
                    if not replica.stale:
                        replica.gaps += 1
                        replica.stale = True
                    return replica.seq + 1
                replica.gaps += 1  # what was missed is wiped by the Cleared in this batch
                replica.stale = seq < replica.latest
        for event in events:
            if isinstance(event, Stored):
                replica.store(event, self._max_blocks, self._forecasts, replica_id)
            elif isinstance(event, Removed):
                replica.remove(event)
            else:
                replica.clear()
                self._clear_forecasts(replica_id)
        replica.seq = seq
        if replica.stale and seq >= replica.latest:  # the replay has caught up
            replica.stale = False
        replica.applied += len(events)
        replica.skipped += skipped
        return seq + 1 if replica.stale else None

    def drop(self, replica_id: Hashable) -> None:
        """Forget a replica (down, restarted, weights reloaded): it scores 0 until it
        publishes again."""
        self._replicas.pop(replica_id, None)
        self._clear_forecasts(replica_id)

    def block_size(self, replica_id: Hashable) -> int | None:
        """The block size of `replica_id`'s keyed blocks, once it has stored some."""
        replica = self._replicas.get(replica_id)
        return None if replica is None else replica.block_size

    def match(self, token_ids: Sequence[int], lora: str | None,
              block_size: int) -> dict[Hashable, int]:
        """For every known replica, how many of the prompt's leading full blocks it
        holds under adapter `lora` (None: the base model); 0 for a stale replica."""
        return self._match(PromptChain(token_ids, lora), block_size, list(self._replicas))[0]

    def _match(self, chain: PromptChain, block_size: int, rids: list[Hashable],
               forecast: Forecast | None = None, now: float = 0.0
               ) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
        """Leading full blocks held per replica: by its events, and by its events or
        `forecast` (keys not expired at `now`) together."""
        scores: dict[Hashable, int] = dict.fromkeys(rids, 0)
        expected = dict(scores)
        tokens = chain.tokens
        full = len(tokens) // block_size
        keys = chain.hashed(block_size)  # hashed only as deep as a replica goes
        for rid in rids:
            replica = self._replicas[rid]
            sent = forecast.holds(rid) if forecast is not None else None
            if replica.stale or not (replica.chains or sent):
                continue
            chains = replica.chains
            held = 0
            found = True
            while held < full:
                if held == len(keys):
                    end = (held + 1) * block_size
                    keys.append(chain_key(keys[-1] if keys else chain.root,
                                          tokens[end - block_size:end]))
                key = keys[held]
                if key not in chains:
                    if not sent or sent.get(key, now) <= now:
                        break
                    found = False
                held += 1
                if found:
                    scores[rid] = held
            expected[rid] = held
        return scores, expected

    def cached_tokens(self, token_ids: Sequence[int], lora: str | None
                      ) -> dict[Hashable, int]:
        """For every replica whose events the index is up to date with, how many of the
        prompt's leading tokens it holds under adapter `lora`, in whole blocks of its
        own block size (0: none, or nothing keyed stored yet). A stale replica is left
        out: what it holds is not known."""
        return self.expected_tokens(token_ids, lora)[0]

    def uncached_tokens(self, replica_id: Hashable, token_ids: Sequence[int],
                        lora: str | None) -> int | None:
        """How many of the prompt's tokens `replica_id`'s engine must compute afresh, by
        its events: the prefill a request costs there (None: what it holds is not known,
        stale or never heard from)."""
        held = self.cached_tokens(token_ids, lora).get(replica_id)
        return None if held is None else len(token_ids) - min(held, len(token_ids))

    def expected_tokens(self, token_ids: Sequence[int] | PromptChain, lora: str | None,
                        forecast: Forecast | None = None, now: float = 0.0
                        ) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
        """`cached_tokens`, and beside it the same counting also the blocks `forecast`
        says were sent there (unexpired at `now`) and not reported yet: a prefix counts
        as long as each of its blocks is held or forecast. A `PromptChain` given for
        the prompt keeps the keys hashed (`lora` is then its own)."""
        chain = (token_ids if isinstance(token_ids, PromptChain)
                 else PromptChain(token_ids, lora))
        by_size: dict[int, list[Hashable]] = {}
        found: dict[Hashable, int] = {}
        for rid, replica in self._replicas.items():
            if replica.stale:
                continue
            found[rid] = 0
            if replica.block_size is not None:
                by_size.setdefault(replica.block_size, []).append(rid)
        expected = dict(found)
        for size, rids in by_size.items():
            blocks, with_sent = self._match(chain, size, rids, forecast, now)
            for rid in rids:
                found[rid] = blocks[rid] * size
                expected[rid] = with_sent[rid] * size
        return found, expected

    def stats(self) -> dict[Hashable, ReplicaStats]:
        return {rid: ReplicaStats(blocks=len(r.blocks), stale=r.stale, seq=r.seq,
                                  applied=r.applied, skipped=r.skipped, gaps=r.gaps,
                                  evicted=r.evicted, unkeyed=r.unkeyed)
                for rid, r in self._replicas.items()}
