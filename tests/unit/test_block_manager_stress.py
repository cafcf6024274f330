"""A randomized run of the block manager against a shadow of what each KV slot would hold:
admissions with prefix hits, prefill chunks, drafts, trims, frees and cache resets."""

from __future__ import annotations

import random

import pytest

from engine.scheduling.block_manager import BlockManager
from tests.unit.block_manager_helpers import snapshot


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
    before = snapshot(bm, list(requests))
    if not bm.allocate_slots(request_id, end):
        stats["failures"] += 1
        assert snapshot(bm, list(requests)) == before
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
    before = snapshot(bm, list(requests) + [request_id])
    if not bm.allocate_slots(request_id, num_cached + rng.randrange(1, 5), computed):
        stats["failures"] += 1
        assert snapshot(bm, list(requests) + [request_id]) == before
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
