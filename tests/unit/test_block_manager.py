"""Tests for the paged-KV block manager: allocation, reference counts, trimming, misuse and the
integrity check. Prefix caching and eviction are in test_prefix_cache.py, the randomized run in
test_block_manager_stress.py."""

from __future__ import annotations

import pytest

from engine.scheduling.block_manager import BlockManager
from tests.unit.block_manager_helpers import BS, run_request, snapshot, token_range


def test_allocate_grow_free_counts() -> None:
    bm = BlockManager(num_blocks=10, block_size=BS)
    assert bm.allocate_slots("a", 5)  # ceil(5 / 4) = 2 blocks
    bm.check_integrity()
    assert len(bm.get_block_table("a")) == 2
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (2, 8, 0)
    assert bm.usage == pytest.approx(0.2)
    assert bm.num_blocks_needed("a", 13) == 2
    assert bm.num_blocks_needed("a", 8) == 0
    assert bm.num_blocks_needed("new", 1) == 1
    table_before = list(bm.get_block_table("a"))
    assert bm.allocate_slots("a", 13)  # grow to 4 blocks, existing ones kept in place
    bm.check_integrity()
    assert bm.get_block_table("a")[:2] == table_before
    assert len(bm.get_block_table("a")) == 4
    assert bm.allocate_slots("b", 4)
    assert len(set(bm.get_block_table("a")) | set(bm.get_block_table("b"))) == 5
    bm.free("a")
    bm.check_integrity()
    assert (bm.num_used_blocks, bm.num_free_blocks) == (1, 9)
    assert bm.get_block_table("a") == []
    bm.free("a")  # unknown id: no-op
    bm.free("b")
    bm.check_integrity()
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.usage) == (0, 10, 0.0)


def test_allocate_already_covered_is_noop() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.allocate_slots("a", 8)
    before = snapshot(bm, ["a"])
    assert bm.allocate_slots("a", 7)
    assert bm.allocate_slots("a", 8)
    assert snapshot(bm, ["a"]) == before
    bm.check_integrity()


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS)
    prompt = token_range(9)
    run_request(bm, "owner", prompt)  # 3 blocks, 2 of them full and registered
    bm.free("owner")
    assert bm.num_cached_blocks == 2
    assert bm.allocate_slots("other", 4)  # 1 block from the free list
    computed, num_cached = bm.get_computed_blocks(prompt)
    assert num_cached == 8
    before = snapshot(bm, ["other", "new"])
    # 2 computed (unreferenced, so they count) + 3 new > 4 allocatable.
    assert not bm.allocate_slots("new", 20, computed)
    assert not bm.allocate_slots("other", 4 * 6)
    assert snapshot(bm, ["other", "new"]) == before
    bm.check_integrity()
    # The cached blocks survived the failed attempts: the same hit still works.
    assert bm.get_computed_blocks(prompt) == (computed, 8)
    assert bm.allocate_slots("new", 12, computed)
    assert bm.get_block_table("new")[:2] == computed
    assert (bm.num_used_blocks, bm.num_free_blocks) == (4, 1)
    bm.check_integrity()


def test_trim_releases_trailing_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.allocate_slots("a", 16)
    table = list(bm.get_block_table("a"))
    bm.trim("a", 9)  # needs 3 blocks
    bm.check_integrity()
    assert bm.get_block_table("a") == table[:3]
    assert bm.num_used_blocks == 3
    bm.trim("a", 12)  # already within: no-op
    assert bm.get_block_table("a") == table[:3]
    bm.trim("unknown", 0)
    bm.trim("a", 0)
    bm.check_integrity()
    assert (bm.get_block_table("a"), bm.num_free_blocks) == ([], 8)


def test_trim_into_a_registered_block_unregisters_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = token_range(12)
    table = run_request(bm, "a", prompt)
    bm.trim("a", 6)  # block 1 keeps only 2 valid tokens and will be rewritten
    bm.check_integrity()
    assert bm.get_computed_blocks(prompt + [0]) == (table[:1], 4)
    # Recomputing the same tokens registers them again; the trimmed tail block (cached, its
    # parent registration gone) is replaced instead of blocking the chain.
    assert bm.allocate_slots("a", 12)
    bm.cache_blocks("a", prompt, 12)
    bm.check_integrity()
    computed, num_cached = bm.get_computed_blocks(prompt + [0])
    assert num_cached == 12
    assert computed == bm.get_block_table("a")


def test_trim_into_a_shared_block_raises() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = token_range(9)
    run_request(bm, "a", prompt)
    computed, _ = bm.get_computed_blocks(prompt)
    assert bm.allocate_slots("b", 9, computed)
    before = snapshot(bm, ["a", "b"])
    with pytest.raises(ValueError, match="shared"):
        bm.trim("b", 6)
    assert snapshot(bm, ["a", "b"]) == before
    bm.check_integrity()


def test_misuse_of_computed_blocks_raises() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    prompt = token_range(5)
    run_request(bm, "a", prompt)
    bm.free("a")
    computed, _ = bm.get_computed_blocks(prompt)
    assert bm.allocate_slots("b", 4)
    with pytest.raises(ValueError, match="first allocation"):
        bm.allocate_slots("b", 8, computed)
    assert bm.allocate_slots("c", 4)  # evicts the cached block
    with pytest.raises(ValueError, match="no prefix hash"):
        bm.allocate_slots("d", 8, computed)


def test_check_integrity_catches_corruption() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    run_request(bm, "a", token_range(9))
    bm.check_integrity()
    block = bm._blocks[bm.get_block_table("a")[0]]
    block.ref_count += 1
    with pytest.raises(AssertionError, match="ref count 2 but held by 1"):
        bm.check_integrity()
    block.ref_count -= 1
    bm.check_integrity()
    bm._free_block_ids.append(bm._free_block_ids[0])
    with pytest.raises(AssertionError, match="free list twice"):
        bm.check_integrity()
    bm._free_block_ids.pop()
    bm._hash_to_block_id[12345] = bm.get_block_table("a")[2]
    with pytest.raises(AssertionError, match="holds another hash"):
        bm.check_integrity()
    del bm._hash_to_block_id[12345]
    bm._free_block_ids.popleft()  # a block lost: in no set at all
    with pytest.raises(AssertionError, match="not on the free list"):
        bm.check_integrity()
