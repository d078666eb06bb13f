"""BlockManager: paged KV-cache blocks with reference counts and prefix caching.

Block 0 is the null block (tables are padded with it), never handed out. Every other block is
free, in use (`ref_count > 0`), or evictable: unreferenced but in the prefix cache, reclaimed in
least-recently-released order when no free block is left. Only full blocks are cached, by a hash
of their parent's hash and their own tokens, so equal tokens after a different prefix never
match; a full block is never written again, so sharing needs no copy-on-write.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as TokenIds

from anyattn.engine.sequence import Sequence

__all__ = ["NULL_BLOCK", "BlockManager", "hash_block_tokens"]

NULL_BLOCK = 0


def hash_block_tokens(parent_hash: bytes | None, token_ids: TokenIds[int]) -> bytes:
    """16-byte chained hash of one full block (`parent_hash`: the previous block's, None for
    the first); cryptographic, as a collision would silently reuse the wrong K/V."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash if parent_hash is not None else b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    """Hands out KV-cache blocks to sequences and caches full blocks by their prefix.

    `num_blocks` counts the null block (at least 2). `num_cached_blocks_reused` and
    `num_evictions` count prefix-cache hits taken by `allocate` and cached blocks reclaimed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"BlockManager: num_blocks must be an int >= 2 (got {num_blocks!r}); block 0 is "
                "the null block, so at least one more is needed."
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"BlockManager: block_size must be an int >= 1 (got {block_size!r}).")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cached_blocks_reused = 0
        self.num_evictions = 0
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(1, num_blocks))
        # Insertion order is release order: the first key is the least recently released.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to a new allocation: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or evictable."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold `block_id`."""
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The prefix-cache hash `block_id` is registered under, or None."""
        return self._hashes[block_id]

    def evictable_blocks(self) -> list[int]:
        """Evictable cached blocks, the next one to be evicted first."""
        return list(self._evictable)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def cached_prefix_len(self, seq: Sequence) -> int:
        """Tokens `allocate(seq)` would reuse from the prefix cache now (always < num_tokens)."""
        return len(self._prefix_hits(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed now."""
        return self._can_allocate(seq, self._prefix_hits(seq), num_new_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Admit a sequence that holds no blocks (else ValueError): reuse the cached blocks of
        its longest cached prefix (never its last token, which is computed to sample), count
        them computed, and make room for `num_new_tokens` more. Returns False, changing
        nothing, when the blocks are not there."""
        if seq.block_table:
            raise ValueError(
                f"BlockManager.allocate: request {seq.request_id!r} already holds "
                f"{len(seq.block_table)} blocks (expected none). Call free() before re-admitting."
            )
        hits = self._prefix_hits(seq)
        if not self._can_allocate(seq, hits, num_new_tokens):
            return False
        for block_id in hits:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1
        seq.block_table = list(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        self.num_cached_blocks_reused += len(hits)
        self.append(seq, num_new_tokens)
        return True

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `append(seq, num_new_tokens)` would find enough blocks."""
        return self._num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover `num_computed_tokens + num_new_tokens` tokens
        (RuntimeError when the blocks are not there: check `can_append` first)."""
        missing = self._num_missing_blocks(seq, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(
                f"BlockManager.append: request {seq.request_id!r} needs {missing} more blocks "
                f"but {self.num_free_blocks} are free. Check can_append() first."
            )
        seq.block_table.extend(self._take_block() for _ in range(missing))

    def commit(self, seq: Sequence) -> None:
        """Register the full, computed blocks of `seq` not yet offered to the prefix cache
        (after a step advanced it). When an equal block is cached already, that one stays."""
        num_full = seq.num_computed_tokens // self.block_size
        if self.enable_prefix_caching:
            for index in range(seq.num_committed_blocks, num_full):
                block_hash = self._seq_block_hash(seq, index)
                block_id = seq.block_table[index]
                assert self._hashes[block_id] is None, "a fresh block cannot be cached already"
                if block_hash not in self._cached:
                    self._cached[block_hash] = block_id
                    self._hashes[block_id] = block_hash
        seq.num_committed_blocks = max(seq.num_committed_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references and empty its block table. Blocks nobody holds become
        free, or evictable when cached, tail first: a chain's later blocks are reachable only
        through its head, so they go first."""
        for block_id in reversed(seq.block_table):
            self._ref_counts[block_id] -= 1
            assert self._ref_counts[block_id] >= 0, "block released more often than taken"
            if self._ref_counts[block_id] == 0:
                if self._hashes[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(needed - len(seq.block_table), 0)

    def _can_allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        needed = self.num_blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        # an evictable hit, once reused, is no longer in the pool new blocks come from
        num_evictable_hits = sum(1 for block_id in hits if self._ref_counts[block_id] == 0)
        return needed <= self.num_free_blocks - num_evictable_hits

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        # full blocks of all tokens but the last, which must be computed to sample
        for index in range((seq.num_tokens - 1) // self.block_size):
            block_id = self._cached.get(self._seq_block_hash(seq, index))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _seq_block_hash(self, seq: Sequence, index: int) -> bytes:
        hashes = seq.block_hashes
        size = self.block_size
        while len(hashes) <= index:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, seq.token_ids[start : start + size]))
        return hashes[index]

    def _take_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block_hash = self._hashes[block_id]
            assert block_hash is not None and self._cached[block_hash] == block_id, (
                f"evictable block {block_id} is not the cached block of its hash"
            )
            del self._cached[block_hash]
            self._hashes[block_id] = None
            self.num_evictions += 1
        self._ref_counts[block_id] = 1
        return block_id
