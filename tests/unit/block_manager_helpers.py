"""What the block manager tests share: a block size, token ranges, a snapshot of the
manager's counts and tables, and a request run through lookup, allocation and registration."""

from __future__ import annotations

from engine.scheduling.block_manager import BlockManager

BS = 4  # block size used by most tests


def token_range(num_tokens: int, start: int = 100) -> list[int]:
    return list(range(start, start + num_tokens))


def snapshot(bm: BlockManager, request_ids: list[str]) -> tuple:
    return (
        bm.num_free_blocks,
        bm.num_used_blocks,
        bm.num_cached_blocks,
        {rid: list(bm.get_block_table(rid)) for rid in request_ids},
    )


def run_request(bm: BlockManager, request_id: str, token_ids: list[int]) -> list[int]:
    """Admit a request with prefix lookup, 'compute' all of it, register its blocks."""
    computed, _ = bm.get_computed_blocks(token_ids)
    assert bm.allocate_slots(request_id, len(token_ids), computed)
    bm.cache_blocks(request_id, token_ids, len(token_ids))
    bm.check_integrity()
    return list(bm.get_block_table(request_id))
