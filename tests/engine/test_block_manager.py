"""BlockManager: hand-worked cases, every block id and counter checked exactly."""

from __future__ import annotations

import pytest

from anyattn.engine.block_manager import NULL_BLOCK, BlockManager, hash_block_tokens
from anyattn.engine.sampling_params import SamplingParams
from anyattn.engine.sequence import Sequence

_ids = iter(range(1_000_000))


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(next(_ids), tokens, SamplingParams())


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit `seq`, give it blocks for all its tokens and mark them computed, as a step would."""
    assert bm.allocate(seq)
    bm.append(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_constructor_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks must be an int >= 2"):
        BlockManager(1, 4)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        BlockManager(8, 0)


def test_allocation_in_order_and_null_block_never_handed_out() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.num_usable_blocks == 4 and bm.num_free_blocks == 4
    seq = make_seq(list(range(10)))
    assert bm.allocate(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0  # nothing cached yet
    assert bm.can_append(seq, 10)
    bm.append(seq, 10)
    assert seq.block_table == [1, 2, 3]
    assert [bm.ref_count(b) for b in range(5)] == [0, 1, 1, 1, 0]
    other = make_seq(list(range(100, 120)))
    assert bm.allocate(other)
    assert not bm.can_append(other, 5)  # needs 2 blocks, 1 left
    with pytest.raises(RuntimeError, match="Check can_append"):
        bm.append(other, 5)
    bm.append(other, 4)
    assert other.block_table == [4]
    assert bm.num_free_blocks == 0
    assert NULL_BLOCK not in seq.block_table + other.block_table
    # Appending within the last block needs nothing new.
    seq.num_computed_tokens = 10
    assert bm.can_append(seq, 2) and not bm.can_append(seq, 3)


def test_commit_registers_full_computed_blocks_with_chained_hashes() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    seq = make_seq(tokens)
    bm.allocate(seq)
    bm.append(seq, 10)
    seq.num_computed_tokens = 6  # a chunk of 6: only block 1 is full and computed
    bm.commit(seq)
    h0 = hash_block_tokens(None, tokens[0:4])
    assert bm.block_hash(1) == h0 and bm.block_hash(2) is None
    seq.num_computed_tokens = 10
    bm.commit(seq)
    assert bm.block_hash(2) == hash_block_tokens(h0, tokens[4:8])
    assert bm.block_hash(3) is None  # partial block: never cached
    assert bm.num_cached_blocks == 2


def test_prefix_hit_reuses_blocks_and_counts_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(10)))
    run_prefill(bm, a)
    assert a.block_table == [1, 2, 3]
    b = make_seq([*range(8), 50, 51, 52])
    assert bm.cached_prefix_len(b) == 8
    assert bm.allocate(b, 3)
    assert b.block_table == [1, 2, 4]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.num_cached_blocks_reused == 2
    # The shared blocks are held twice, the private ones once.
    assert [bm.ref_count(i) for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    bm.free(a)
    assert [bm.ref_count(i) for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert bm.evictable_blocks() == []  # still held by b
    bm.free(b)
    assert bm.evictable_blocks() == [2, 1]  # released tail first
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_hit_never_covers_the_whole_sequence() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    run_prefill(bm, make_seq(list(range(8))))
    again = make_seq(list(range(8)))
    # Both blocks are cached, but the last token must be recomputed to get a logit.
    assert bm.allocate(again)
    assert again.num_computed_tokens == 4 and again.block_table == [1]
    assert bm.num_cached_blocks_reused == 1
    assert bm.allocate(b := make_seq(list(range(9))))
    assert b.num_computed_tokens == 8 and b.block_table == [1, 2]


def test_same_tokens_after_a_different_prefix_do_not_hit() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    run_prefill(bm, make_seq([*x, *y, 0]))
    for tokens in ([*y, *y, 0], [9, 9, 9, 9, *y, 0], [*y, 0]):
        probe = make_seq(tokens)
        assert bm.cached_prefix_len(probe) == 0, tokens
    assert bm.cached_prefix_len(make_seq([*x, 0])) == 4
    assert bm.cached_prefix_len(make_seq([*x, *y, 1, 2])) == 8


def test_free_and_commit_interplay() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(list(range(6)))
    bm.allocate(a)
    bm.append(a, 6)
    bm.free(a)  # never computed, never committed: nothing is cached
    assert bm.num_cached_blocks == 0 and bm.evictable_blocks() == []
    assert bm.num_free_blocks == 5
    b = make_seq(list(range(6)))
    run_prefill(bm, b)  # takes the next free blocks (FIFO)
    assert b.block_table == [3, 4]
    bm.free(b)
    assert bm.evictable_blocks() == [3]  # full and committed; block 4 was partial
    assert bm.num_free_blocks == 5
    c = make_seq([*range(6), 6])
    assert bm.allocate(c)
    assert c.block_table == [3] and c.num_computed_tokens == 4
    assert bm.evictable_blocks() == [] and bm.num_free_blocks == 4


def test_duplicate_block_computed_twice_stays_uncached() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(list(range(5))), make_seq(list(range(5)))
    for seq in (a, b):  # both admitted before either committed: no hit
        assert bm.allocate(seq, 5)
    for seq in (a, b):
        seq.num_computed_tokens = 5
        bm.commit(seq)
    assert a.block_table == [1, 2] and b.block_table == [3, 4]
    assert bm.block_hash(1) is not None and bm.block_hash(3) is None
    bm.free(a)
    bm.free(b)
    assert bm.evictable_blocks() == [1] and bm.num_cached_blocks == 1


def test_lru_eviction_order_tail_first_and_only_when_needed() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    assert a.block_table == [1, 2, 3]
    bm.free(a)
    assert bm.evictable_blocks() == [2, 1]
    b = make_seq([7, 8, 9])
    run_prefill(bm, b)
    assert b.block_table == [4, 5]  # clean blocks first: nothing evicted
    assert bm.num_evictions == 0
    bm.free(b)
    assert bm.evictable_blocks() == [2, 1, 4]
    c = make_seq(list(range(20, 28)))
    assert bm.allocate(c, 8)
    # Free blocks 3 and 5 first, then the least recently released cached blocks, 2 then 1.
    assert c.block_table == [3, 5, 2, 1]
    assert bm.num_evictions == 2
    assert bm.block_hash(1) is None and bm.block_hash(2) is None
    assert bm.evictable_blocks() == [4]
    assert bm.cached_prefix_len(make_seq([1, 2, 3, 4, 5])) == 0
    assert bm.cached_prefix_len(make_seq([7, 8, 9])) == 2


def test_reused_block_becomes_most_recently_released() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    x, y = make_seq([1, 2, 0]), make_seq([3, 4, 0])
    run_prefill(bm, x)
    run_prefill(bm, y)
    assert (x.block_table, y.block_table) == ([1, 2], [3, 4])
    bm.free(x)
    bm.free(y)
    assert x.block_table == [] and bm.evictable_blocks() == [1, 3]
    again = make_seq([1, 2, 9])
    assert bm.allocate(again) and again.block_table == [1]
    bm.free(again)
    assert bm.evictable_blocks() == [3, 1]
    z = make_seq(list(range(10, 20)))
    assert bm.allocate(z, 10)
    # Clean blocks in release order (5, then 2 and 4 freed by x and y), then evict 3 before 1.
    assert z.block_table == [5, 2, 4, 3, 1]
    assert bm.num_evictions == 2


def test_allocate_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    bm.free(a)
    assert bm.evictable_blocks() == [2, 1] and bm.num_free_blocks == 3
    b = make_seq([1, 2, 3, 4, 6, 7, 8])
    assert bm.cached_prefix_len(b) == 4
    # 4 cached + 3 new tokens = 4 blocks: 2 reused, 2 new, but reusing leaves only 1 free.
    assert not bm.can_allocate(b, 3)
    assert not bm.allocate(b, 3)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.evictable_blocks() == [2, 1] and bm.num_cached_blocks_reused == 0
    assert [bm.ref_count(i) for i in range(4)] == [0, 0, 0, 0]
    assert bm.allocate(b, 2)
    assert b.block_table == [1, 2, 3] and b.num_computed_tokens == 4


def test_allocate_rejects_a_sequence_holding_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3])
    bm.allocate(seq, 3)
    with pytest.raises(ValueError, match="already holds 2 blocks"):
        bm.allocate(seq)


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    assert bm.num_cached_blocks == 0
    bm.free(a)
    assert bm.evictable_blocks() == [] and bm.num_free_blocks == 5
    b = make_seq([1, 2, 3, 4, 5])
    assert bm.allocate(b) and b.num_computed_tokens == 0 and bm.num_cached_blocks_reused == 0
