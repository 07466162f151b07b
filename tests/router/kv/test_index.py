from dpserve.router.kv.events import Cleared, Removed, Stored
from dpserve.router.kv.index import KVIndex

BS = 4
PROMPT = list(range(100, 132))  # 8 blocks of 4


def stored(tokens, hashes, parent=None, lora=None, **kw):
    return Stored(block_hashes=tuple(hashes), parent=parent, token_ids=tuple(tokens),
                  block_size=BS, lora_name=lora, lora_id=None, **kw)


def prefix_events(n_blocks, lora=None, base=0):
    """The first n blocks of PROMPT stored in two events, as an engine stores a prompt
    and then its continuation (hashes base+1..)."""
    half = n_blocks // 2
    first = stored(PROMPT[:half * BS], range(base + 1, base + half + 1), lora=lora)
    rest = stored(PROMPT[half * BS:n_blocks * BS], range(base + half + 1, base + n_blocks + 1),
                  parent=base + half, lora=lora)
    return [first, rest]


def test_a_replica_that_stored_a_prefix_scores_that_many_blocks():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(6))
    index.apply("r1", 0, prefix_events(2))
    assert index.match(PROMPT, None, BS) == {"r0": 6, "r1": 2}
    assert index.match(PROMPT[:10], None, BS) == {"r0": 2, "r1": 2}  # full blocks only


def test_a_prompt_that_differs_in_its_first_block_scores_nothing():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(6))
    assert index.match([7, *PROMPT[1:]], None, BS) == {"r0": 0}


def test_removing_a_middle_block_cuts_the_score_there():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(6))
    index.apply("r0", 1, [Removed(block_hashes=(4,))])
    assert index.match(PROMPT, None, BS) == {"r0": 3}


def test_cleared_or_dropped_replicas_score_zero():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(6))
    index.apply("r1", 0, prefix_events(6))
    index.apply("r0", 1, [Cleared()])
    index.drop("r1")
    assert index.match(PROMPT, None, BS) == {"r0": 0}
    assert index.stats()["r0"].blocks == 0


def test_what_a_replica_must_prefill_is_the_prompt_past_its_cached_blocks():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(6))
    index.apply("r1", 0, prefix_events(6, lora="sql"))
    assert index.uncached_tokens("r0", PROMPT, None) == len(PROMPT) - 6 * BS
    assert index.uncached_tokens("r0", PROMPT[:10], None) == 2  # two blocks, 2 tokens over
    assert index.uncached_tokens("r1", PROMPT, None) == len(PROMPT)  # cached for another
    assert index.uncached_tokens("r1", PROMPT, "sql") == len(PROMPT) - 6 * BS
    assert index.uncached_tokens("r2", PROMPT, None) is None  # never heard from
    index.apply("r0", 5, [Removed(block_hashes=(1,))])  # a gap: stale, not known
    assert index.uncached_tokens("r0", PROMPT, None) is None


def test_a_gap_makes_the_replica_stale_until_the_missing_batches_arrive():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(4))
    assert index.apply("r0", 3, [Removed(block_hashes=(1,))]) == 1
    assert index.stats()["r0"].stale
    assert index.match(PROMPT, None, BS) == {"r0": 0}
    assert index.apply("r0", 1, []) == 2  # replayed, still behind
    assert index.apply("r0", 2, []) == 3  # the batch that showed the gap was not applied
    assert index.apply("r0", 3, [Removed(block_hashes=(3,))]) is None
    assert index.match(PROMPT, None, BS) == {"r0": 2}
    assert index.stats()["r0"].gaps == 1


def test_a_gap_batch_that_clears_the_cache_needs_no_replay():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(4))
    assert index.apply("r0", 9, [Cleared(), *prefix_events(2)]) is None
    assert index.match(PROMPT, None, BS) == {"r0": 2}


def test_a_restarted_publisher_starts_the_replica_afresh():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(6))
    index.apply("r0", 1, [])
    index.apply("r0", 0, prefix_events(2))
    assert index.match(PROMPT, None, BS) == {"r0": 2}


def test_a_batch_seen_twice_is_applied_once():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(4))
    index.apply("r0", 1, [Removed(block_hashes=(2,))])
    index.apply("r0", 1, [Removed(block_hashes=(2,))])
    assert index.stats()["r0"].applied == 3


def test_a_block_stored_under_an_adapter_is_no_hit_for_another_or_the_base():
    index = KVIndex()
    index.apply("r0", 0, prefix_events(4, lora="a"))
    index.apply("r1", 0, prefix_events(4))
    assert index.match(PROMPT, "a", BS) == {"r0": 4, "r1": 0}
    assert index.match(PROMPT, "b", BS) == {"r0": 0, "r1": 0}
    assert index.match(PROMPT, None, BS) == {"r0": 0, "r1": 4}


def test_a_block_hashed_with_an_image_or_salt_is_not_found_by_tokens():
    index = KVIndex()
    index.apply("r0", 0, [stored(PROMPT[:8], [1, 2], opaque=(True, False))])
    assert index.match(PROMPT, None, BS) == {"r0": 0}
    assert index.stats()["r0"].unkeyed == 2  # the child's key depends on the salted parent


def test_a_child_of_an_unknown_parent_is_held_but_not_keyed():
    index = KVIndex()
    index.apply("r0", 0, [stored(PROMPT[4:8], [2], parent=1)])
    assert index.match(PROMPT, None, BS) == {"r0": 0}
    index.apply("r0", 1, [Removed(block_hashes=(2,))])
    assert index.stats()["r0"].blocks == 0


def test_the_cap_forgets_the_oldest_blocks_first():
    index = KVIndex(max_blocks_per_replica=5)
    index.apply("r0", 0, prefix_events(4))
    index.apply("r0", 1, [stored(PROMPT[16:24], [5, 6], parent=4)])
    assert index.stats()["r0"].evicted == 1
    assert index.stats()["r0"].blocks == 5
    assert index.match(PROMPT, None, BS) == {"r0": 0}  # block 1 went first


def test_storing_a_block_again_makes_it_the_newest():
    index = KVIndex(max_blocks_per_replica=4)
    index.apply("r0", 0, prefix_events(4))
    index.apply("r0", 1, [stored(PROMPT[:4], [1])])  # reused: vLLM reports it again
    index.apply("r0", 2, [stored([1, 2, 3, 4], [99])])
    assert index.match(PROMPT, None, BS) == {"r0": 1}  # block 2 evicted, not block 1


def test_blocks_on_another_medium_are_removed_separately():
    index = KVIndex()
    index.apply("r0", 0, [stored(PROMPT[:8], [1, 2], medium="GPU"),
                          stored(PROMPT[:8], [1, 2], medium="CPU")])
    index.apply("r0", 1, [Removed(block_hashes=(1, 2), medium="GPU")])
    assert index.match(PROMPT, None, BS) == {"r0": 2}


def test_a_block_stored_again_is_gone_at_its_first_removal():
    """A block stored twice (a second copy, or reused blocks announced again) is
    forgotten at the first `BlockRemoved`: never held longer than the engine holds it."""
    index = KVIndex()
    index.apply("r0", 0, prefix_events(4))
    index.apply("r0", 1, prefix_events(4))
    index.apply("r0", 2, [Removed(block_hashes=(3,))])
    assert index.match(PROMPT, None, BS) == {"r0": 2}
    assert index.stats()["r0"].blocks == 3
