"""Tests for the paged-KV block manager: allocation, reference counts, prefix caching, eviction."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager

BS = 4  # block size used by most tests


def _tokens(num_tokens: int, start: int = 100) -> list[int]:
    return list(range(start, start + num_tokens))


def _snapshot(bm: BlockManager, request_ids: list[str]) -> tuple:
    return (
        bm.num_free_blocks,
        bm.num_used_blocks,
        bm.num_cached_blocks,
        {rid: list(bm.get_block_table(rid)) for rid in request_ids},
    )


def _run_request(bm: BlockManager, request_id: str, token_ids: list[int]) -> list[int]:
    """Admit a request with prefix lookup, 'compute' all of it, register its blocks."""
    computed, _ = bm.get_computed_blocks(token_ids)
    assert bm.allocate_slots(request_id, len(token_ids), computed)
    bm.cache_blocks(request_id, token_ids, len(token_ids))
    bm.check_integrity()
    return list(bm.get_block_table(request_id))


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
    before = _snapshot(bm, ["a"])
    assert bm.allocate_slots("a", 7)
    assert bm.allocate_slots("a", 8)
    assert _snapshot(bm, ["a"]) == before
    bm.check_integrity()


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS)
    prompt = _tokens(9)
    _run_request(bm, "owner", prompt)  # 3 blocks, 2 of them full and registered
    bm.free("owner")
    assert bm.num_cached_blocks == 2
    assert bm.allocate_slots("other", 4)  # 1 block from the free list
    computed, num_cached = bm.get_computed_blocks(prompt)
    assert num_cached == 8
    before = _snapshot(bm, ["other", "new"])
    # 2 computed (unreferenced, so they count) + 3 new > 4 allocatable.
    assert not bm.allocate_slots("new", 20, computed)
    assert not bm.allocate_slots("other", 4 * 6)
    assert _snapshot(bm, ["other", "new"]) == before
    bm.check_integrity()
    # The cached blocks survived the failed attempts: the same hit still works.
    assert bm.get_computed_blocks(prompt) == (computed, 8)
    assert bm.allocate_slots("new", 12, computed)
    assert bm.get_block_table("new")[:2] == computed
    assert (bm.num_used_blocks, bm.num_free_blocks) == (4, 1)
    bm.check_integrity()


def test_prefix_hit_after_free_revives_cached_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = _tokens(10)  # 2 full blocks + 2 tokens
    owner_table = _run_request(bm, "a", prompt)
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
    prompt = _tokens(12)
    owner_table = _run_request(bm, "a", prompt)
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


def test_hashes_are_chained_by_position_and_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    block_x = [1, 2, 3, 4]
    _run_request(bm, "a", [9, 9, 9, 9] + block_x + [0])
    bm.free("a")
    # Same block tokens at position 0 (no prefix) and after another prefix: no hit.
    assert bm.get_computed_blocks(block_x + [0]) == ([], 0)
    assert bm.get_computed_blocks([8, 8, 8, 8] + block_x + [0]) == ([], 0)
    assert bm.get_computed_blocks([9, 9, 9, 9] + block_x + [0])[1] == 8


def test_unchained_hash_fn_still_cannot_hit_at_wrong_position() -> None:
    # A hash that ignores the parent makes block contents collide across positions; the parent
    # check must still turn those into misses.
    bm = BlockManager(num_blocks=8, block_size=BS, hash_fn=lambda parent, tokens: hash(tokens))
    block_x = [1, 2, 3, 4]
    _run_request(bm, "a", [9, 9, 9, 9] + block_x + [0])
    bm.free("a")
    assert bm.get_computed_blocks(block_x + [0]) == ([], 0)
    assert bm.get_computed_blocks([8, 8, 8, 8] + block_x + [0]) == ([], 0)
    assert bm.get_computed_blocks([9, 9, 9, 9] + block_x + [0])[1] == 8


def test_partial_last_block_is_never_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = _tokens(6)
    table = _run_request(bm, "a", prompt)
    bm.free("a")
    assert bm.num_cached_blocks == 1  # only the full block; the half block went to the free list
    computed, num_cached = bm.get_computed_blocks(prompt + _tokens(4, start=7))
    assert (computed, num_cached) == (table[:1], 4)


def test_at_least_one_token_is_left_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = _tokens(8)
    table = _run_request(bm, "a", prompt)
    bm.free("a")
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(prompt) == (table[:1], 4)  # the second block holds the last token
    assert bm.get_computed_blocks(prompt + [1]) == (table[:2], 8)
    assert bm.get_computed_blocks(prompt[:1]) == ([], 0)
    assert bm.get_computed_blocks([]) == ([], 0)


def test_forced_hash_collision_is_a_miss() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, hash_fn=lambda parent, tokens: 42)
    block_x, block_y = [1, 2, 3, 4], [5, 6, 7, 8]
    table_a = _run_request(bm, "a", block_x + block_y + [0])
    # Every block hashes to 42, so only the first registration exists.
    assert bm.get_computed_blocks(block_y + [0]) == ([], 0)  # same hash, other tokens
    # Block 1 hashes to 42 and its entry even holds block_x, but as block 0 (no parent): miss.
    assert bm.get_computed_blocks(block_x + block_x + [0]) == (table_a[:1], 4)
    assert bm.get_computed_blocks(block_x + block_y + [0]) == (table_a[:1], 4)
    _run_request(bm, "b", block_y + [0])  # its block collides: stays unregistered
    bm.free("a")
    bm.free("b")
    bm.check_integrity()
    assert bm.num_cached_blocks == 1
    assert bm.get_computed_blocks(block_y + [0]) == ([], 0)


def test_duplicate_content_keeps_the_existing_entry() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = _tokens(9)
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
    prompt_a, prompt_b = _tokens(8, start=0), _tokens(8, start=50)
    table_a = _run_request(bm, "a", prompt_a)
    bm.free("a")  # freed last block first: pool order a1, a0
    table_b = _run_request(bm, "b", prompt_b)
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
    prompt_a, prompt_b = _tokens(4, start=0), _tokens(4, start=50)
    (block_a,) = _run_request(bm, "a", prompt_a)
    bm.free("a")
    (block_b,) = _run_request(bm, "b", prompt_b)
    bm.free("b")  # order: a, b
    _run_request(bm, "a2", prompt_a + [1])  # revives a (and one free block)
    bm.free("a2")  # order: b, a
    assert bm.allocate_slots("c", 8)  # the free block, then evicts b
    assert block_b in bm.get_block_table("c")
    assert bm.get_computed_blocks(prompt_a + [1]) == ([block_a], 4)
    assert bm.get_computed_blocks(prompt_b + [1]) == ([], 0)
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
    prompt = _tokens(12)
    table = _run_request(bm, "a", prompt)
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
    prompt = _tokens(9)
    _run_request(bm, "a", prompt)
    computed, _ = bm.get_computed_blocks(prompt)
    assert bm.allocate_slots("b", 9, computed)
    before = _snapshot(bm, ["a", "b"])
    with pytest.raises(ValueError, match="shared"):
        bm.trim("b", 6)
    assert _snapshot(bm, ["a", "b"]) == before
    bm.check_integrity()


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = _tokens(12)
    assert bm.allocate_slots("a", 12)
    bm.cache_blocks("a", prompt, 12)
    bm.free("a")
    bm.check_integrity()
    assert (bm.num_cached_blocks, bm.num_free_blocks) == (0, 8)
    assert bm.get_computed_blocks(prompt + [0]) == ([], 0)
    assert bm.get_computed_blocks(prompt) == ([], 0)


def test_prefix_lookups_count_cached_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = _tokens(10)
    assert bm.get_computed_blocks(prompt)[1] == 0  # nothing registered yet
    _run_request(bm, "a", prompt)
    # The prompt's two full blocks of 4 hit; an unrelated prompt hits none.
    assert [bm.get_computed_blocks(t)[1] for t in (prompt, [0] * 5)] == [8, 0]


def test_reset_prefix_cache_drops_only_unreferenced_hashes() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt_a, prompt_b = _tokens(9, start=0), _tokens(9, start=50)
    _run_request(bm, "a", prompt_a)
    table_b = _run_request(bm, "b", prompt_b)
    bm.free("a")
    bm.reset_prefix_cache()
    bm.check_integrity()
    assert (bm.num_cached_blocks, bm.num_free_blocks) == (0, 5)
    assert bm.get_computed_blocks(prompt_a) == ([], 0)
    assert bm.get_computed_blocks(prompt_b) == (table_b[:2], 8)


def test_misuse_of_computed_blocks_raises() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    prompt = _tokens(5)
    _run_request(bm, "a", prompt)
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
    _run_request(bm, "a", _tokens(9))
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


class _Shadow:
    """What each KV slot would hold in a real cache: the token prefix ending at its position."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, table: list[int], seq: list[int], start: int, end: int) -> None:
        for pos in range(start, end):
            block_id = table[pos // self.block_size]
            self.slots[(block_id, pos % self.block_size)] = tuple(seq[: pos + 1])

    def assert_holds(self, block_ids: list[int], token_ids: list[int]) -> None:
        for index, block_id in enumerate(block_ids):
            for offset in range(self.block_size):
                pos = index * self.block_size + offset
                assert self.slots[(block_id, offset)] == tuple(token_ids[: pos + 1]), (
                    f"prefix hit on block {block_id} returned KV of another prefix"
                )


def _stress_step(bm, rng, shadow, requests, request_id, stats) -> None:
    """One scheduler-like step for one request: prefill chunk or decode with drafts."""
    state = requests[request_id]
    tokens, num_computed = state["tokens"], state["num_computed"]
    is_decode = num_computed == len(tokens) - 1
    drafts = [rng.randrange(3) for _ in range(rng.randrange(4))] if is_decode else []
    seq = tokens + drafts
    end = min(len(seq), num_computed + rng.randrange(1, 7))
    before = _snapshot(bm, list(requests))
    if not bm.allocate_slots(request_id, end):
        stats["failures"] += 1
        assert _snapshot(bm, list(requests)) == before
        return
    table = bm.get_block_table(request_id)
    others = {
        b for rid, r in requests.items() if rid != request_id for b in bm.get_block_table(rid)
    }
    written = {table[pos // bm.block_size] for pos in range(num_computed, end)}
    assert not written & others, "a request would write into a block another request holds"
    shadow.write(table, seq, num_computed, end)
    if is_decode:
        num_accepted = rng.randrange(end - num_computed)  # drafts computed = end - num_computed - 1
        state["tokens"] = tokens + drafts[:num_accepted] + [rng.randrange(3)]
        state["num_computed"] = len(tokens) + num_accepted
    else:
        state["num_computed"] = end
        if end == len(tokens):
            tokens.append(rng.randrange(3))
    if rng.random() < 0.7:
        bm.trim(request_id, len(state["tokens"]))
    bm.cache_blocks(request_id, state["tokens"], state["num_computed"])


def _stress_admit(bm, rng, shadow, requests, request_id, stats, prefixes) -> None:
    prompt = list(rng.choice(prefixes)) + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
    computed, num_cached = bm.get_computed_blocks(prompt)
    assert num_cached == len(computed) * bm.block_size < len(prompt)
    shadow.assert_holds(computed, prompt)
    stats["hits"] += num_cached
    before = _snapshot(bm, list(requests) + [request_id])
    if not bm.allocate_slots(request_id, num_cached + rng.randrange(1, 5), computed):
        stats["failures"] += 1
        assert _snapshot(bm, list(requests) + [request_id]) == before
        return
    requests[request_id] = {"tokens": prompt, "num_computed": num_cached}


@pytest.mark.parametrize(
    ("seed", "hash_fn"),
    [(0, None), (1, None), (2, lambda parent, tokens: hash(tokens) % 5), (3, lambda p, t: 0)],
)
def test_randomized_stress(seed, hash_fn) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=2, hash_fn=hash_fn)
    shadow = _Shadow(block_size=2)
    prefixes = [tuple(rng.randrange(3) for _ in range(rng.randrange(0, 9))) for _ in range(4)]
    requests: dict[str, dict] = {}
    stats = {"failures": 0, "hits": 0}
    for _ in range(3000):
        request_id = f"r{rng.randrange(8)}"
        op = rng.random()
        if request_id not in requests:
            _stress_admit(bm, rng, shadow, requests, request_id, stats, prefixes)
        elif op < 0.75 and len(requests[request_id]["tokens"]) < 30:
            _stress_step(bm, rng, shadow, requests, request_id, stats)
        elif op < 0.98:
            bm.free(request_id)
            del requests[request_id]
        else:
            bm.reset_prefix_cache()
        bm.check_integrity()
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for request_id in list(requests):
        bm.free(request_id)
        bm.check_integrity()
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, bm.num_blocks)
    # The run must have exercised the interesting paths: prefix hits and pool exhaustion.
    assert stats["hits"] > 0 and stats["failures"] > 0
