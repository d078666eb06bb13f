"""InputBatch: rows written and cleared exactly; a step's layout by fancy indexing equals the
per-request layout; the common prefix of the step's block tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anyattn.engine.input_batch import InputBatch


def reference_layout(tokens, computed, num_new, tables, block_size):
    """One request at a time, as the engine laid steps out before the arrays."""
    ids, positions, slots = [], [], []
    for t, c, n, table in zip(tokens, computed, num_new, tables, strict=True):
        for p in range(c, c + n):
            ids.append(t[p])
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    width = max(len(t) for t in tables)
    block_table = [list(t) + [0] * (width - len(t)) for t in tables]
    return ids, positions, slots, block_table


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_reqs = draw(st.integers(1, 6))
    tokens, computed, num_new, tables = [], [], [], []
    for _ in range(num_reqs):
        length = draw(st.integers(1, 40))
        c = draw(st.integers(0, length - 1))
        tokens.append(draw(st.lists(st.integers(0, 999), min_size=length, max_size=length)))
        computed.append(c)
        num_new.append(draw(st.integers(1, length - c)))
        blocks = -(-(c + num_new[-1]) // block_size) + draw(st.integers(0, 2))
        tables.append(draw(st.lists(st.integers(1, 500), min_size=blocks, max_size=blocks)))
    return block_size, tokens, computed, num_new, tables


@settings(max_examples=60, deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_gather_equals_the_per_request_layout(case, random) -> None:
    block_size, tokens, computed, num_new, tables = case
    batch, slots = InputBatch.from_lists(tokens, computed, tables, block_size)
    order = list(range(len(tokens)))
    random.shuffle(order)  # any slot order
    step = batch.gather(slots[order], np.asarray(num_new)[order])
    pick = [[x[i] for i in order] for x in (tokens, computed, num_new, tables)]
    ids, positions, slot_mapping, block_table = reference_layout(*pick, block_size)
    assert step.input_ids.tolist() == ids and step.input_ids.dtype == np.int64
    assert step.positions.tolist() == positions
    assert step.slot_mapping.tolist() == slot_mapping and step.slot_mapping.dtype == np.int64
    assert step.block_table.tolist() == block_table and step.block_table.dtype == np.int32
    assert step.query_start_loc.tolist() == np.cumsum([0, *pick[2]]).tolist()
    assert step.seq_lens.tolist() == [c + n for c, n in zip(pick[1], pick[2], strict=True)]
    assert step.num_computed.tolist() == pick[1]


def test_rows_are_written_grown_advanced_and_cleared() -> None:
    batch = InputBatch(max_num_reqs=3, max_model_len=8, block_size=4)
    a = batch.add([5, 6, 7], 0, [9])
    b = batch.add([1, 2], 1, [4])
    assert (a, b) == (0, 1) and batch.num_free_slots == 1
    batch.advance(np.array([a, b]), np.array([3, 1]))
    batch.append_tokens(np.array([a, b]), np.array([8, 3]))
    batch.extend_blocks(b, [4, 11])
    assert batch.token_ids[a, :4].tolist() == [5, 6, 7, 8] and batch.num_tokens[a] == 4
    assert batch.token_ids[b, :3].tolist() == [1, 2, 3]
    assert batch.num_computed.tolist() == [3, 2, 0]
    assert batch.block_table[b].tolist() == [4, 11] and batch.num_blocks[b] == 2
    batch.remove(b)
    assert batch.block_table[b].tolist() == [0, 0] and batch.num_blocks[b] == 0
    assert batch.add([1], 0, []) == b  # the lowest free slot again
    with pytest.raises(ValueError, match="exceed a row"):
        batch.add(list(range(9)), 0, [])
    batch.add([1], 0, [])
    with pytest.raises(RuntimeError, match="all 3 slots"):
        batch.add([1], 0, [])


@pytest.mark.parametrize(
    ("tables", "computed", "expected"),
    [
        ([[3, 4, 5], [3, 4, 6]], [5, 5], 4),  # two shared blocks of 2
        ([[3, 4, 5], [3, 4, 6]], [5, 3], 2),  # within the shorter context
        ([[3, 4], [3, 4], [7, 4]], [4, 4, 4], 0),  # the first column differs
        ([[3, 4], [3, 4, 5]], [4, 5], 4),  # every column of the shorter table
        ([[3]], [4], 0),  # one request: nothing to share
    ],
)
def test_common_prefix_len(tables, computed, expected) -> None:
    tokens = [[0] * (len(t) * 2 + 1) for t in tables]
    batch, slots = InputBatch.from_lists(tokens, computed, tables, block_size=2)
    assert batch.common_prefix_len(slots) == expected
