"""anyattn.metadata: batch splitting, decode-first reordering, slot mappings, block tables."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from anyattn.metadata import (
    CommonAttentionMetadata,
    apply_swaps,
    compute_slot_mapping,
    expand_block_table,
    make_common_attn_metadata,
    reorder_batch_to_split_decodes_and_prefills,
    split_decodes_and_prefills,
)


def metadata(query_lens, seq_lens=None, block_size=16, **kwargs) -> CommonAttentionMetadata:
    """A batch on one wide block table (block ids are irrelevant to the helpers under test)."""
    seq_lens = list(query_lens) if seq_lens is None else seq_lens
    max_blocks = max([(s + block_size - 1) // block_size for s in seq_lens], default=1)
    table = torch.arange(1, len(seq_lens) * max_blocks + 1, dtype=torch.int32)
    return make_common_attn_metadata(
        query_lens, seq_lens, table.view(len(seq_lens), max_blocks), block_size, **kwargs
    )


# --- make_common_attn_metadata ---------------------------------------------------------------


def test_make_common_attn_metadata_hand_case():
    block_table = torch.tensor([[3, 7, 0], [5, 0, 0]], dtype=torch.int32)
    # request 0: 4 tokens of context + 2 new; request 1: a fresh prompt of 3
    m = make_common_attn_metadata([2, 3], [6, 3], block_table, block_size=4)
    assert m.query_start_loc_cpu.tolist() == [0, 2, 5]
    assert m.query_start_loc.tolist() == [0, 2, 5]
    assert m.seq_lens_cpu.tolist() == [6, 3]
    assert m.num_computed_tokens_cpu.tolist() == [4, 0]
    assert m.query_lens_cpu.tolist() == [2, 3]
    assert (m.num_reqs, m.num_actual_tokens, m.max_query_len, m.max_seq_len) == (2, 5, 3, 6)
    assert m.slot_mapping.tolist() == [7 * 4 + 0, 7 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2]
    assert m.slot_mapping.dtype is torch.int64
    assert m.query_start_loc.dtype is torch.int32 and m.seq_lens.dtype is torch.int32
    assert m.causal and m.encoder_seq_lens is None and m.encoder_seq_lens_cpu is None
    assert m.device == torch.device("cpu")
    # the CPU mirrors of the block table and the slot mapping (here the tensors themselves)
    assert m.block_table_cpu is block_table and m.slot_mapping_cpu is m.slot_mapping


def test_make_common_attn_metadata_padding_and_encoder():
    table = torch.tensor([[1]], dtype=torch.int32)
    m = make_common_attn_metadata(
        [1], [3], table, block_size=4, causal=False, encoder_seq_lens=[9], num_padded_tokens=4
    )
    assert m.slot_mapping.tolist() == [6, -1, -1, -1]
    assert m.num_actual_tokens == 1
    assert not m.causal
    assert m.encoder_seq_lens_cpu.tolist() == [9] and m.encoder_seq_lens.dtype is torch.int32
    with pytest.raises(ValueError, match=r"query_lens and seq_lens differ in length \(got 1 and 2"):
        make_common_attn_metadata([1], [3, 4], table, block_size=4)


# --- split_decodes_and_prefills --------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "threshold", "uniform", "expected"),
    [
        ([1, 1, 3, 5], 1, False, (2, 2, 2, 8)),
        ([1, 1, 3, 5], 3, False, (3, 1, 5, 5)),
        ([1, 1, 3, 5], 5, False, (4, 0, 10, 0)),
        ([4, 6], 1, False, (0, 2, 0, 10)),
        ([1, 1, 1], 1, False, (3, 0, 3, 0)),
        # Not reordered: the first prefill ends the decode run.
        ([1, 5, 1], 1, False, (1, 2, 1, 6)),
        # require_uniform: decodes are the leading run with the first request's length.
        ([2, 2, 1, 5], 2, False, (3, 1, 5, 5)),
        ([2, 2, 1, 5], 2, True, (2, 2, 4, 6)),
        ([1, 2, 2], 2, True, (1, 2, 1, 4)),
        ([3, 3, 1], 2, True, (0, 3, 0, 7)),
        ([4, 4, 4], 4, True, (3, 0, 12, 0)),
    ],
)
def test_split_decodes_and_prefills(query_lens, threshold, uniform, expected):
    seq_lens = [q + 10 for q in query_lens]
    m = metadata(query_lens, seq_lens)
    assert (
        split_decodes_and_prefills(m, decode_threshold=threshold, require_uniform=uniform)
        == expected
    )


def test_split_empty_batch():
    m = metadata([], [])
    assert split_decodes_and_prefills(m) == (0, 0, 0, 0)


def test_split_reads_only_the_real_requests():
    m = metadata([1, 1, 4])
    # CUDA-graph padding: tensors longer than num_reqs must not count.
    loc = torch.tensor([0, 1, 2, 6, 6, 6], dtype=torch.int32)
    m = dataclasses.replace(m, query_start_loc_cpu=loc)
    assert split_decodes_and_prefills(m) == (2, 1, 2, 4)


# --- reorder_batch_to_split_decodes_and_prefills ---------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "threshold", "swaps"),
    [
        ([], 1, []),
        ([7], 1, []),
        ([1, 1, 5, 5], 1, []),
        ([5, 1], 1, [(0, 1)]),
        ([5, 5, 1, 1], 1, [(0, 3), (1, 2)]),
        # 2 decodes; position 0 of the first 2 holds a prefill: one swap, the leftmost misplaced
        # prefill with the rightmost misplaced decode.
        ([5, 1, 5, 1], 1, [(0, 3)]),
        # 3 decodes; the first 3 positions hold one prefill (position 1).
        ([1, 5, 1, 5, 1], 1, [(1, 4)]),
        ([9, 8, 7, 1, 1, 1], 1, [(0, 5), (1, 4), (2, 3)]),
        ([2, 3, 1], 2, [(1, 2)]),
        ([2, 3, 1], 1, [(0, 2)]),
        ([2, 3, 1], 3, []),
    ],
)
def test_reorder_hand_cases(query_lens, threshold, swaps):
    assert reorder_batch_to_split_decodes_and_prefills(query_lens, threshold) == swaps


def test_apply_swaps():
    items = ["a", "b", "c", "d"]
    assert apply_swaps(items, [(0, 3), (1, 2)]) is items
    assert items == ["d", "c", "b", "a"]
    assert apply_swaps(items, []) == ["d", "c", "b", "a"]


@given(
    query_lens=st.lists(st.integers(min_value=1, max_value=8), max_size=40),
    threshold=st.integers(min_value=1, max_value=4),
)
def test_reorder_is_decodes_first_with_fewest_swaps(query_lens, threshold):
    swaps = reorder_batch_to_split_decodes_and_prefills(query_lens, threshold)
    is_decode = [q <= threshold for q in query_lens]
    num_decodes = sum(is_decode)
    reordered = apply_swaps(list(query_lens), swaps)
    assert sorted(reordered) == sorted(query_lens)
    assert all(q <= threshold for q in reordered[:num_decodes])
    assert all(q > threshold for q in reordered[num_decodes:])
    # Each misplaced prefill (in the decode part) needs a swap and one swap fixes one of them:
    # that count is the minimum, and it is what the helper uses.
    assert len(swaps) == num_decodes - sum(is_decode[:num_decodes])
    # Every swap moves a prefill out of the decode part and a decode into it; nothing that
    # already sits in its own part is touched, and no request moves twice.
    for i, j in swaps:
        assert i < num_decodes <= j
        assert not is_decode[i] and is_decode[j]
    moved = [index for pair in swaps for index in pair]
    assert len(moved) == len(set(moved))


# --- compute_slot_mapping --------------------------------------------------------------------


def test_compute_slot_mapping_hand_case():
    block_table = torch.tensor([[9, 4, 0], [5, 0, 0]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3, 5], dtype=torch.int32)
    # request 0: context 3, new positions 3, 4, 5 cross from block 9 into block 4;
    # request 1: fresh, positions 0, 1 in block 5.
    seq_lens = torch.tensor([6, 2], dtype=torch.int32)
    slots = compute_slot_mapping(block_table, query_start_loc, seq_lens, block_size=4)
    assert slots.dtype is torch.int64
    assert slots.tolist() == [9 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1]


def test_compute_slot_mapping_pads_with_minus_one():
    block_table = torch.tensor([[2]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 2], dtype=torch.int32)
    seq_lens = torch.tensor([2], dtype=torch.int32)
    slots = compute_slot_mapping(block_table, query_start_loc, seq_lens, 8, num_tokens=5)
    assert slots.tolist() == [16, 17, -1, -1, -1]
    empty = compute_slot_mapping(
        torch.zeros(0, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        8,
        num_tokens=3,
    )
    assert empty.tolist() == [-1, -1, -1]


def test_compute_slot_mapping_errors():
    block_table = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError) as raised:
        compute_slot_mapping(block_table, query_start_loc, torch.tensor([13]), 4)
    assert str(raised.value) == (
        "compute_slot_mapping: block_table too narrow for the longest sequence (got 3 columns, "
        "expected >= 4 for block_size 4)."
    )
    # 12 tokens fill exactly 3 blocks of 4.
    assert compute_slot_mapping(block_table, query_start_loc, torch.tensor([12]), 4).tolist() == [
        3 * 4 + 3
    ]
    with pytest.raises(ValueError, match=r"num_tokens is smaller than the real tokens \(got 0,"):
        compute_slot_mapping(block_table, query_start_loc, torch.tensor([12]), 4, num_tokens=0)


# --- expand_block_table ----------------------------------------------------------------------


def test_expand_block_table():
    table = torch.tensor([[3, 7], [5, 0]], dtype=torch.int32)
    expanded = expand_block_table(table, block_size=32, kernel_block_size=16)
    assert expanded.dtype is torch.int32
    assert expanded.tolist() == [[6, 7, 14, 15], [10, 11, 0, 1]]
    assert expand_block_table(table, 64, 16).tolist() == [
        [12, 13, 14, 15, 28, 29, 30, 31],
        [20, 21, 22, 23, 0, 1, 2, 3],
    ]
    assert expand_block_table(table, 16, 16) is table
    with pytest.raises(ValueError, match=r"multiple of kernel_block_size \(got 48 and 32\)"):
        expand_block_table(table, 48, 32)


def test_expanded_table_gives_the_same_slots():
    # Engine blocks of 32 seen as kernel blocks of 16 address the same cache slots.
    table = torch.tensor([[3, 7], [5, 0]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 40, 43], dtype=torch.int32)
    seq_lens = torch.tensor([40, 20], dtype=torch.int32)
    coarse = compute_slot_mapping(table, query_start_loc, seq_lens, 32)
    fine = compute_slot_mapping(expand_block_table(table, 32, 16), query_start_loc, seq_lens, 16)
    assert torch.equal(coarse, fine)


# --- CommonAttentionMetadata: checked when made ----------------------------------------------


def valid() -> CommonAttentionMetadata:
    return metadata([1, 3], [5, 3])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"seq_lens_cpu": torch.tensor([5], dtype=torch.int32)},
            "seq_lens_cpu must be 1-D with at least 2 entries (got shape (1,))",
        ),
        (
            {"query_start_loc_cpu": torch.tensor([[0, 1, 4]], dtype=torch.int32)},
            "query_start_loc_cpu must be 1-D with at least 3 entries (got shape (1, 3))",
        ),
        (
            {"num_computed_tokens_cpu": torch.tensor([4], dtype=torch.int32)},
            "num_computed_tokens_cpu must be 1-D with at least 2 entries",
        ),
        (
            {"block_table_tensor": torch.zeros(2, dtype=torch.int32)},
            "block_table_tensor must be [num_reqs, max_blocks] with num_reqs >= 2 (got shape (2,))",
        ),
        (
            {"block_table_tensor": torch.zeros(1, 4, dtype=torch.int32)},
            "block_table_tensor must be [num_reqs, max_blocks]",
        ),
        (
            {"slot_mapping": torch.zeros(4, dtype=torch.int32)},
            "slot_mapping must be int64 (got torch.int32)",
        ),
        (
            {"block_table_tensor": torch.zeros(2, 4, dtype=torch.int64)},
            "block_table_tensor must be int32 (got torch.int64)",
        ),
        (
            {"query_start_loc_cpu": torch.tensor([1, 2, 4], dtype=torch.int32)},
            "query_start_loc must start at 0 and never decrease",
        ),
        (
            {"query_start_loc_cpu": torch.tensor([0, 3, 2], dtype=torch.int32)},
            "query_start_loc must start at 0 and never decrease",
        ),
        (
            {"num_actual_tokens": 5},
            "num_actual_tokens disagrees with query_start_loc (got 5, expected 4)",
        ),
        (
            {"seq_lens_cpu": torch.tensor([5, 2], dtype=torch.int32)},
            "a request has seq_len shorter than its query length",
        ),
        (
            {"num_computed_tokens_cpu": torch.tensor([4, 1], dtype=torch.int32)},
            "num_computed_tokens_cpu must equal seq_lens - query lens per request",
        ),
        (  # kernels sized by these would skip queries or keys
            {"max_query_len": 2},
            "max_query_len / max_seq_len below the mirrors' longest (got 2 / 5, expected >= 3 / 5)",
        ),
        (
            {"max_seq_len": 4},
            "max_query_len / max_seq_len below the mirrors' longest (got 3 / 4, expected >= 3 / 5)",
        ),
    ],
)
def test_validate_errors(changes, message):
    with pytest.raises(ValueError) as raised:
        dataclasses.replace(valid(), **changes)
    assert str(raised.value).startswith("CommonAttentionMetadata: ")
    assert message in str(raised.value)


def test_validate_accepts_padding_past_num_reqs():
    m = dataclasses.replace(
        valid(),
        query_start_loc_cpu=torch.tensor([0, 1, 4, 4], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([5, 3, 0], dtype=torch.int32),
        num_computed_tokens_cpu=torch.tensor([4, 0, 0], dtype=torch.int32),
        block_table_tensor=torch.zeros(3, 2, dtype=torch.int32),
        block_table_cpu=None,
    )
    host = m.host_batch
    # the real requests' mirrors, for the builder's host planning
    assert host.query_start_loc.tolist() == [0, 1, 4]
    assert host.query_lens.tolist() == [1, 3]
    assert host.seq_lens.tolist() == [5, 3]
    assert host.context_lens.tolist() == [4, 0]
    # the real requests' longest (the padding's 0 tokens and the fields' bounds aside)
    assert (host.max_query_len, host.max_seq_len) == (3, 5)
    assert all(type(v) is int for v in (host.max_query_len, host.max_seq_len))
    arrays = (host.query_start_loc, host.query_lens, host.seq_lens, host.context_lens)
    assert all(a.dtype == np.int64 for a in arrays)
    # copies, not views: the engine may refill its mirrors once the build has returned
    m.query_start_loc_cpu[1] = 2
    m.num_computed_tokens_cpu[0] = 7
    m.seq_lens_cpu[0] = 9
    assert host.query_start_loc[1] == 1 and host.context_lens[0] == 4 and host.seq_lens[0] == 5
    # every builder of the step reads the same arrays: none may write them
    assert not any(a.flags.writeable for a in arrays)


def test_validate_of_an_empty_step_gives_empty_arrays():
    host = metadata([], []).host_batch
    assert host.query_start_loc.tolist() == [0]
    assert host.query_lens.size == host.seq_lens.size == host.context_lens.size == 0
    assert (host.max_query_len, host.max_seq_len) == (0, 0)


@pytest.mark.gpu
def test_validate_rejects_device_mirrors():
    m = valid()
    with pytest.raises(ValueError, match="seq_lens_cpu must be a CPU tensor"):
        dataclasses.replace(m, seq_lens_cpu=m.seq_lens_cpu.cuda())


def test_validate_rejects_mirrors_off_the_cpu():
    meta = torch.tensor([4, 0], dtype=torch.int32, device="meta")
    with pytest.raises(
        ValueError, match=r"num_computed_tokens_cpu must be a CPU tensor \(got meta"
    ):
        dataclasses.replace(valid(), num_computed_tokens_cpu=meta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.bool])
@pytest.mark.parametrize("field", ["query_start_loc_cpu", "num_computed_tokens_cpu"])
def test_validate_rejects_mirrors_that_are_not_integers(field, dtype):
    m = valid()
    with pytest.raises(ValueError, match=rf"{field} must be an integer tensor \(got {dtype}"):
        dataclasses.replace(m, **{field: getattr(m, field).to(dtype)})


def with_mirror_dtype(m: CommonAttentionMetadata, dtype: torch.dtype) -> CommonAttentionMetadata:
    return dataclasses.replace(
        m,
        query_start_loc_cpu=m.query_start_loc_cpu.to(dtype),
        seq_lens_cpu=m.seq_lens_cpu.to(dtype),
        num_computed_tokens_cpu=m.num_computed_tokens_cpu.to(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.uint8])
def test_validate_any_integer_mirror_dtype(dtype):
    # differences are taken without wrapping around, unsigned mirrors included
    with_mirror_dtype(valid(), dtype)
    cases = [
        ({"query_start_loc_cpu": torch.tensor([0, 3, 2])}, "start at 0 and never decrease"),
        ({"num_actual_tokens": 5}, "num_actual_tokens disagrees"),
        ({"seq_lens_cpu": torch.tensor([5, 2])}, "seq_len shorter than its query length"),
        ({"num_computed_tokens_cpu": torch.tensor([4, 1])}, "num_computed_tokens_cpu must equal"),
    ]
    for changes, message in cases:
        changes = {k: v.to(dtype) if torch.is_tensor(v) else v for k, v in changes.items()}
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(with_mirror_dtype(valid(), dtype), **changes)


# --- the block table's and slot mapping's CPU mirrors -----------------------------------------


def test_mirrors_are_required_for_device_tensors():
    m = make_common_attn_metadata([1, 3], [5, 3], torch.tensor([[2], [3]]).int(), 16, "meta")
    assert m.block_table_cpu.is_cpu and m.slot_mapping_cpu.is_cpu
    for name in ("block_table", "slot_mapping"):
        with pytest.raises(ValueError, match=rf"{name}_cpu is required for a {name} on meta"):
            dataclasses.replace(m, **{f"{name}_cpu": None})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"block_table_cpu": torch.zeros(2, 3, dtype=torch.int32)},
            "block_table_cpu must mirror its device tensor on the CPU (got cpu torch.int32 (2, 3),"
            " expected cpu torch.int32 (2, 1))",
        ),
        (
            {"block_table_cpu": torch.zeros(2, 1, dtype=torch.int64)},
            "block_table_cpu must mirror its device tensor",
        ),
        (
            {"slot_mapping_cpu": torch.zeros(4, dtype=torch.int32)},
            "slot_mapping_cpu must mirror its device tensor",
        ),
        (
            {"slot_mapping_cpu": torch.tensor([80, 81, -2, 83])},
            "slot_mapping has a negative slot at entry 2 (got -2, expected -1 for padding or a "
            "slot >= 0)",
        ),
        (
            {"slot_mapping_cpu": torch.tensor([80, 81, 82, 81])},
            "slot_mapping gives slot 81 to two tokens (got entries 1 and 3, expected distinct "
            "slots, -1 excepted)",
        ),
    ],
)
def test_mirrors_are_checked_when_made(changes, message):
    m = make_common_attn_metadata([1, 3], [5, 3], torch.tensor([[4], [5]]).int(), 16, "meta")
    assert m.slot_mapping_cpu.tolist() == [68, 80, 81, 82]
    with pytest.raises(ValueError) as raised:
        dataclasses.replace(m, **changes)
    assert str(raised.value).startswith("CommonAttentionMetadata: ")
    assert message in str(raised.value)


def test_metadata_is_read_only_once_made():
    m = valid()
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.max_seq_len = 40
    # a copy with changes is made, and checked, anew
    assert dataclasses.replace(m, causal=False).checks is not m.checks
