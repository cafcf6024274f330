"""Paged-KV block manager: fixed-size blocks, reference counts and prefix caching.

Pure Python, no tensors: it only decides which block ids hold which request's tokens. The runner
turns block tables into slot mappings.

Every block is in exactly one of three states:
- free: ref count 0, no prefix hash; kept in `_free_block_ids`.
- cached: ref count 0 but still holds a prefix hash; evictable, and a prefix lookup can revive it.
  Kept in `_cached_block_ids` in the order the blocks were freed (least recently freed first).
- used: ref count > 0 (one reference per block table that holds it).

Prefix caching: block i of a sequence is keyed by a chained hash
`hash_fn(hash of block i-1 or None, tokens of block i)`, so equal tokens at a different position or
after a different prefix give a different key. A hash hit is confirmed by comparing the block's
stored tokens AND its parent: every registration gets a unique serial number and remembers its
parent's serial, so even a forced hash collision can never hand out KV computed for another prefix.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HashFn = Callable[[int | None, tuple[int, ...]], int]


def _default_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is deterministic (no per-process salt), 64-bit.
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class _Block:
    """Mutable per-block bookkeeping; never leaves this module."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    # Unique id of this registration and of the parent block's registration (None at the root).
    serial: int | None = None
    parent_serial: int | None = None


@dataclass(slots=True)
class _ChainLink:
    """What a request knows about one of its full, registered blocks: the chained hash, and the
    serial of the block that holds that content in the index (its own or an identical one)."""

    block_hash: int
    serial: int


class BlockManager:
    """Hands out KV blocks of `block_size` tokens to requests, keyed by request id.

    Contract with the scheduler: `get_computed_blocks` then `allocate_slots(..., computed_blocks)`
    for a new request, with no other allocation in between (an allocation may evict those blocks);
    `allocate_slots` before every step to grow the table; `cache_blocks` after the KV is written;
    `trim` to drop blocks that only held rejected draft positions; `free` when the request ends or
    is preempted. Every call costs O(1) or O(blocks touched).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}."
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn: HashFn = hash_fn or _default_hash
        self._blocks = [_Block(block_id=i) for i in range(num_blocks)]
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        # Insertion order == free order, so the first key is the least recently freed block.
        self._cached_block_ids: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block_id: dict[int, int] = {}
        self._serial_to_block_id: dict[int, int] = {}
        self._next_serial = 0
        self._block_tables: dict[str, list[int]] = {}
        self._chains: dict[str, list[_ChainLink]] = {}

    # ---- counts ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus cached-but-unreferenced (evictable)."""
        return len(self._free_block_ids) + len(self._cached_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a prefix hash (evictable, still hittable)."""
        return len(self._cached_block_ids)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's block table, NOT a copy: read it, never mutate it. Unknown id: []."""
        return self._block_tables.get(request_id, [])

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs so that its table holds `num_tokens` tokens."""
        num_held = len(self._block_tables.get(request_id, ()))
        return max(0, self._cdiv(num_tokens) - num_held)

    # ---- prefix lookup --------------------------------------------------------------------

    def get_computed_blocks(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching the start of `token_ids`.

        Returns (block_ids, num_cached_tokens). Only full blocks of token_ids[:-1] count, so at
        least one token is always left to compute (its logits are needed). Takes no references.
        """
        if not self.enable_prefix_caching:
            return [], 0
        block_ids: list[int] = []
        parent_hash: int | None = None
        parent_serial: int | None = None
        for start in range(
            0, (len(token_ids) - 1) // self.block_size * self.block_size, self.block_size
        ):
            block_tokens = tuple(token_ids[start : start + self.block_size])
            block_hash = self._hash_fn(parent_hash, block_tokens)
            block_id = self._hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.token_ids != block_tokens or block.parent_serial != parent_serial:
                break  # hash collision: same key, other content
            block_ids.append(block_id)
            parent_hash, parent_serial = block_hash, block.serial
        return block_ids, len(block_ids) * self.block_size

    # ---- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow the request's table to hold `num_tokens` tokens in total.

        `computed_blocks` (from `get_computed_blocks`, first allocation only) are taken first.
        New blocks come from the free list, then by evicting the least recently freed cached
        block. Not enough blocks: nothing changes and False is returned.
        """
        table = self._block_tables.get(request_id)
        if computed_blocks and table:
            raise ValueError(
                f"computed_blocks given for request {request_id!r}, which already "
                "holds blocks; they are only taken on the first allocation."
            )
        num_held = len(table or ()) + len(computed_blocks)
        num_new = max(0, self._cdiv(num_tokens) - num_held)
        if num_new == 0 and not computed_blocks:
            return True
        for block_id in computed_blocks:
            if self._blocks[block_id].block_hash is None:
                raise ValueError(
                    f"computed block {block_id} holds no prefix hash any more; "
                    "allocate right after get_computed_blocks."
                )
        # Unreferenced computed blocks leave the evictable pool, so they count against it.
        num_revived = sum(1 for b in computed_blocks if self._blocks[b].ref_count == 0)
        if num_new + num_revived > self.num_free_blocks:
            return False
        if table is None:
            table = self._block_tables[request_id] = []
        for block_id in computed_blocks:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._cached_block_ids[block_id]
            block.ref_count += 1
            table.append(block_id)
        if computed_blocks:
            # Taken blocks are registered, so the chain of hashes continues from them.
            self._chains[request_id] = [self._link_of(self._blocks[b]) for b in computed_blocks]
        for _ in range(num_new):
            table.append(self._take_block())
        return True

    def _take_block(self) -> int:
        if self._free_block_ids:
            block_id = self._free_block_ids.popleft()
        else:
            block_id, _ = self._cached_block_ids.popitem(last=False)
            self._drop_hash(self._blocks[block_id])
        self._blocks[block_id].ref_count = 1
        return block_id

    def _drop_hash(self, block: _Block) -> None:
        assert block.block_hash is not None and block.serial is not None
        del self._hash_to_block_id[block.block_hash]
        del self._serial_to_block_id[block.serial]
        block.block_hash = block.token_ids = block.serial = block.parent_serial = None

    # ---- prefix registration ----------------------------------------------------------------

    def cache_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Register prefix hashes for the request's full blocks within `num_computed_tokens`.

        `token_ids[:num_computed_tokens]` must have their KV written. Blocks registered earlier
        are skipped. If an identical block (same hash, tokens and parent) is already registered,
        the existing entry is kept and this request's copy stays unregistered. A true collision
        (same hash, other content) stops registration here; a later call retries.
        """
        if not self.enable_prefix_caching:
            return
        if num_computed_tokens > len(token_ids):
            raise ValueError(
                f"num_computed_tokens {num_computed_tokens} exceeds the "
                f"{len(token_ids)} token ids given for request {request_id!r}."
            )
        table = self._block_tables.get(request_id, [])
        num_full = num_computed_tokens // self.block_size
        if num_full > len(table):
            raise ValueError(
                f"request {request_id!r} holds {len(table)} blocks, fewer than the "
                f"{num_full} full blocks of its computed tokens."
            )
        chain = self._chains.setdefault(request_id, [])
        for index in range(len(chain), num_full):
            start = index * self.block_size
            block_tokens = tuple(token_ids[start : start + self.block_size])
            link = self._register(table[index], block_tokens, chain[-1] if chain else None)
            if link is None:
                break
            chain.append(link)

    def _register(
        self, block_id: int, block_tokens: tuple[int, ...], parent: _ChainLink | None
    ) -> _ChainLink | None:
        parent_hash = parent.block_hash if parent else None
        parent_serial = parent.serial if parent else None
        block_hash = self._hash_fn(parent_hash, block_tokens)
        existing_id = self._hash_to_block_id.get(block_hash)
        if existing_id is not None:
            existing = self._blocks[existing_id]
            if existing.token_ids == block_tokens and existing.parent_serial == parent_serial:
                return self._link_of(existing)  # identical content: keep the existing entry
            if not self._is_orphan(existing):
                return None  # true collision with a reachable entry
            # The existing entry's parent was evicted, so no lookup can reach it: replace it.
            self._drop_hash(existing)
            if existing.ref_count == 0:
                del self._cached_block_ids[existing_id]
                self._free_block_ids.append(existing_id)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            raise ValueError(
                f"block {block_id} is already registered under another hash; "
                "token_ids do not match what was cached before."
            )
        block.block_hash, block.token_ids = block_hash, block_tokens
        block.serial, block.parent_serial = self._next_serial, parent_serial
        self._next_serial += 1
        self._hash_to_block_id[block_hash] = block_id
        self._serial_to_block_id[block.serial] = block_id
        return self._link_of(block)

    @staticmethod
    def _link_of(block: _Block) -> _ChainLink:
        assert block.block_hash is not None and block.serial is not None
        return _ChainLink(block.block_hash, block.serial)

    def _is_orphan(self, block: _Block) -> bool:
        return (
            block.parent_serial is not None and block.parent_serial not in self._serial_to_block_id
        )

    # ---- release --------------------------------------------------------------------------

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release trailing blocks not needed to hold `num_tokens` tokens (rejected drafts).

        If the new last block is partial and registered, its hash is dropped: its slots past
        `num_tokens` will be rewritten. Raises ValueError (changing nothing) if that block is
        shared, since another request relies on its content.
        """
        table = self._block_tables.get(request_id)
        if not table:
            return
        num_keep = self._cdiv(num_tokens)
        last = self._blocks[table[num_keep - 1]] if 0 < num_keep <= len(table) else None
        is_partial = num_tokens % self.block_size != 0
        if last and is_partial and last.block_hash is not None and last.ref_count > 1:
            raise ValueError(f"trim({request_id!r}, {num_tokens}) cuts into a shared cached block.")
        while len(table) > num_keep:
            self._release(table.pop())
        if last and is_partial and last.block_hash is not None:
            self._drop_hash(last)
        chain = self._chains.get(request_id)
        if chain is not None:
            del chain[num_tokens // self.block_size :]

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, last block first, so that a sequence's tail is
        evicted before its head. Unknown id: no-op."""
        table = self._block_tables.pop(request_id, None)
        self._chains.pop(request_id, None)
        for block_id in reversed(table or ()):
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is not None:
            self._cached_block_ids[block_id] = None
        else:
            self._free_block_ids.append(block_id)

    def reset_prefix_cache(self) -> None:
        """Drop the hashes of all unreferenced blocks; blocks in use keep theirs."""
        while self._cached_block_ids:
            block_id, _ = self._cached_block_ids.popitem(last=False)
            self._drop_hash(self._blocks[block_id])
            self._free_block_ids.append(block_id)

    # ---- checks ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent. O(num_blocks + table
        entries): for tests and idle-time checks, not for every step."""
        free_ids, cached_ids = set(self._free_block_ids), set(self._cached_block_ids)
        assert len(free_ids) == len(self._free_block_ids), "a block is on the free list twice"
        assert not free_ids & cached_ids, f"blocks both free and cached: {free_ids & cached_ids}"
        refs = [0] * self.num_blocks
        for request_id, table in self._block_tables.items():
            assert len(set(table)) == len(table), f"request {request_id!r} holds a block twice"
            for block_id in table:
                refs[block_id] += 1
        num_used = 0
        for block in self._blocks:
            bid = block.block_id
            assert block.ref_count == refs[bid], (
                f"block {bid}: ref count {block.ref_count} but held by {refs[bid]} block tables"
            )
            if block.ref_count > 0:
                num_used += 1
                assert bid not in cached_ids | free_ids, f"used block {bid} is also free/cached"
            elif block.block_hash is None:
                assert bid in free_ids, f"unreferenced unhashed block {bid} is not on the free list"
            else:
                assert bid in cached_ids, f"unreferenced hashed block {bid} is not in the cache"
        total = len(free_ids) + len(cached_ids) + num_used
        assert total == self.num_blocks, (
            f"free {len(free_ids)} + cached {len(cached_ids)} + used {num_used} "
            f"!= total {self.num_blocks}"
        )
        self._check_indexes()

    def _check_indexes(self) -> None:
        num_hashed = 0
        for block in self._blocks:
            if block.block_hash is None:
                continue
            num_hashed += 1
            assert self._hash_to_block_id.get(block.block_hash) == block.block_id, (
                f"block {block.block_id} holds hash {block.block_hash} but the index disagrees"
            )
            assert block.serial is not None, f"block {block.block_id} is hashed without a serial"
            assert self._serial_to_block_id.get(block.serial) == block.block_id, (
                f"block {block.block_id}: serial index disagrees"
            )
        for block_hash, bid in self._hash_to_block_id.items():
            assert self._blocks[bid].block_hash == block_hash, (
                f"index entry {block_hash} points at block {bid}, which holds another hash"
            )
        assert len(self._hash_to_block_id) == len(self._serial_to_block_id) == num_hashed, (
            "hash index, serial index and hashed blocks disagree in number"
        )
        for request_id, chain in self._chains.items():
            assert len(chain) <= len(self._block_tables.get(request_id, ())), (
                f"request {request_id!r} has more registered blocks than blocks"
            )

    def _cdiv(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
