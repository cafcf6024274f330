"""Tests for the block manager's prefix cache: hits on chained hashes, collisions, duplicate
content, LRU eviction of cached blocks, and turning the cache off or resetting it."""

from __future__ import annotations

import pytest

from engine.scheduling.block_manager import BlockManager
from tests.unit.block_manager_helpers import BS, run_request, token_range


def test_prefix_hit_after_free_revives_cached_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = token_range(10)  # 2 full blocks + 2 tokens
    owner_table = run_request(bm, "a", prompt)
    bm.free("a")
    bm.check_integrity()
    assert (bm.num_cached_blocks, bm.num_used_blocks, bm.num_free_blocks) == (2, 0, 8)
    computed, num_cached = bm.get_computed_blocks(prompt + [7, 8])
    assert (computed, num_cached) == (owner_table[:2], 8)
    assert bm.num_cached_blocks == 2  # lookup takes no reference
    assert bm.allocate_slots("b", 12, computed)
    bm.check_integrity()
    assert bm.get_block_table("b")[:2] == owner_table[:2]
    assert (bm.num_cached_blocks, bm.num_used_blocks, bm.num_free_blocks) == (0, 3, 5)


def test_prefix_hit_while_owner_running_shares_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = token_range(12)
    owner_table = run_request(bm, "a", prompt)
    computed, num_cached = bm.get_computed_blocks(prompt)
    assert (computed, num_cached) == (owner_table[:2], 8)  # last block left: one token to compute
    assert bm.allocate_slots("b", 12, computed)
    bm.check_integrity()  # checks ref counts: the 2 shared blocks are held by 2 tables
    assert bm.num_used_blocks == 4
    bm.free("a")
    bm.check_integrity()
    # Still referenced by "b": used, not cached. The owner's unshared last block is cached.
    assert (bm.num_used_blocks, bm.num_cached_blocks) == (3, 1)
    bm.free("b")
    bm.check_integrity()
    assert (bm.num_used_blocks, bm.num_cached_blocks) == (0, 3)


@pytest.mark.parametrize(
    "hash_fn",
    [None, lambda parent, tokens: hash(tokens)],
    ids=["chained", "unchained-hash"],
)
def test_hashes_are_chained_by_position_and_prefix(hash_fn) -> None:
    """Same block tokens at position 0 (no prefix) and after another prefix: no hit. With a hash
    that ignores the parent (block contents collide across positions) the parent check must
    still turn those into misses."""
    extra = {} if hash_fn is None else {"hash_fn": hash_fn}
    bm = BlockManager(num_blocks=8, block_size=BS, **extra)
    block_x = [1, 2, 3, 4]
    run_request(bm, "a", [9, 9, 9, 9] + block_x + [0])
    bm.free("a")
    assert bm.get_computed_blocks(block_x + [0]) == ([], 0)
    assert bm.get_computed_blocks([8, 8, 8, 8] + block_x + [0]) == ([], 0)
    assert bm.get_computed_blocks([9, 9, 9, 9] + block_x + [0])[1] == 8


def test_partial_last_block_is_never_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = token_range(6)
    table = run_request(bm, "a", prompt)
    bm.free("a")
    assert bm.num_cached_blocks == 1  # only the full block; the half block went to the free list
    computed, num_cached = bm.get_computed_blocks(prompt + token_range(4, start=7))
    assert (computed, num_cached) == (table[:1], 4)


def test_at_least_one_token_is_left_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = token_range(8)
    table = run_request(bm, "a", prompt)
    bm.free("a")
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(prompt) == (table[:1], 4)  # the second block holds the last token
    assert bm.get_computed_blocks(prompt + [1]) == (table[:2], 8)
    assert bm.get_computed_blocks(prompt[:1]) == ([], 0)
    assert bm.get_computed_blocks([]) == ([], 0)


def test_forced_hash_collision_is_a_miss() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, hash_fn=lambda parent, tokens: 42)
    block_x, block_y = [1, 2, 3, 4], [5, 6, 7, 8]
    table_a = run_request(bm, "a", block_x + block_y + [0])
    # Every block hashes to 42, so only the first registration exists.
    assert bm.get_computed_blocks(block_y + [0]) == ([], 0)  # same hash, other tokens
    # Block 1 hashes to 42 and its entry even holds block_x, but as block 0 (no parent): miss.
    assert bm.get_computed_blocks(block_x + block_x + [0]) == (table_a[:1], 4)
    assert bm.get_computed_blocks(block_x + block_y + [0]) == (table_a[:1], 4)
    run_request(bm, "b", block_y + [0])  # its block collides: stays unregistered
    bm.free("a")
    bm.free("b")
    bm.check_integrity()
    assert bm.num_cached_blocks == 1
    assert bm.get_computed_blocks(block_y + [0]) == ([], 0)


def test_duplicate_content_keeps_the_existing_entry() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = token_range(9)
    # Both compute the same prompt before either registered it: two copies of the same KV.
    assert bm.allocate_slots("a", 9)
    assert bm.allocate_slots("b", 9)
    bm.cache_blocks("a", prompt, 9)
    bm.cache_blocks("b", prompt, 9)
    bm.check_integrity()
    table_a, table_b = bm.get_block_table("a"), bm.get_block_table("b")
    assert bm.get_computed_blocks(prompt + [1]) == (table_a[:2], 8)
    # b's chain goes on from a's identical entries: its next block is registered and reachable.
    tokens_b = prompt + [7, 7, 7]
    bm.cache_blocks("b", tokens_b, 12)
    bm.check_integrity()
    assert bm.get_computed_blocks(tokens_b + [0]) == ([*table_a[:2], table_b[2]], 12)
    bm.free("b")
    assert bm.num_cached_blocks == 1  # b's copies of a's blocks were never registered: free
    bm.free("a")
    assert bm.num_cached_blocks == 3
    bm.check_integrity()


def test_eviction_is_lru_and_drops_the_hash() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt_a, prompt_b = token_range(8, start=0), token_range(8, start=50)
    table_a = run_request(bm, "a", prompt_a)
    bm.free("a")  # freed last block first: pool order a1, a0
    table_b = run_request(bm, "b", prompt_b)
    bm.free("b")  # pool order a1, a0, b1, b0
    assert (bm.num_cached_blocks, bm.num_free_blocks) == (4, 4)
    assert bm.allocate_slots("c", 4)
    bm.check_integrity()
    assert bm.get_block_table("c") == [table_a[1]]  # least recently freed: the tail of "a"
    assert bm.num_cached_blocks == 3
    assert bm.get_computed_blocks(prompt_a + [0]) == (table_a[:1], 4)  # its hash is gone
    assert bm.allocate_slots("c", 8)
    assert bm.get_block_table("c") == [table_a[1], table_a[0]]
    assert bm.get_computed_blocks(prompt_a + [0]) == ([], 0)
    assert bm.get_computed_blocks(prompt_b + [0]) == (table_b, 8)
    bm.check_integrity()


def test_revived_block_moves_to_the_back_of_the_eviction_order() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    prompt_a, prompt_b = token_range(4, start=0), token_range(4, start=50)
    (block_a,) = run_request(bm, "a", prompt_a)
    bm.free("a")
    (block_b,) = run_request(bm, "b", prompt_b)
    bm.free("b")  # order: a, b
    run_request(bm, "a2", prompt_a + [1])  # revives a (and one free block)
    bm.free("a2")  # order: b, a
    assert bm.allocate_slots("c", 8)  # the free block, then evicts b
    assert block_b in bm.get_block_table("c")
    assert bm.get_computed_blocks(prompt_a + [1]) == ([block_a], 4)
    assert bm.get_computed_blocks(prompt_b + [1]) == ([], 0)
    bm.check_integrity()


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = token_range(12)
    assert bm.allocate_slots("a", 12)
    bm.cache_blocks("a", prompt, 12)
    bm.free("a")
    bm.check_integrity()
    assert (bm.num_cached_blocks, bm.num_free_blocks) == (0, 8)
    assert bm.get_computed_blocks(prompt + [0]) == ([], 0)
    assert bm.get_computed_blocks(prompt) == ([], 0)


def test_prefix_lookups_count_cached_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = token_range(10)
    assert bm.get_computed_blocks(prompt)[1] == 0  # nothing registered yet
    run_request(bm, "a", prompt)
    # The prompt's two full blocks of 4 hit; an unrelated prompt hits none.
    assert [bm.get_computed_blocks(t)[1] for t in (prompt, [0] * 5)] == [8, 0]


def test_reset_prefix_cache_drops_only_unreferenced_hashes() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt_a, prompt_b = token_range(9, start=0), token_range(9, start=50)
    run_request(bm, "a", prompt_a)
    table_b = run_request(bm, "b", prompt_b)
    bm.free("a")
    bm.reset_prefix_cache()
    bm.check_integrity()
    assert (bm.num_cached_blocks, bm.num_free_blocks) == (0, 5)
    assert bm.get_computed_blocks(prompt_a) == ([], 0)
    assert bm.get_computed_blocks(prompt_b) == (table_b[:2], 8)
