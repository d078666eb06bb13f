"""FLASHINFER planning arrays, exactly: the decode / ragged / paged split, FlashInfer's CSR page
table (indptr, indices, last-page lengths), CUDA-graph padding; hand-built cases and random
batches against a loop-by-loop reference, and the single-token decode fast path against the
general path."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anyattn.backends import flashinfer_plan
from anyattn.backends.flashinfer import _gather_pages
from anyattn.backends.flashinfer_plan import (
    BatchSplit,
    _plan_any,
    decode_part,
    decode_step_arrays,
    paged_kv_gather_index,
    paged_kv_indices,
    paged_kv_indptr,
    plan_step,
    qo_indptr,
    ragged_kv_indptr,
    split_batch,
)


def loc_of(query_lens):
    return np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)


def split(query_lens, context_lens, **kwargs) -> BatchSplit:
    return split_batch(loc_of(query_lens), np.asarray(context_lens), **kwargs)


# --- split_batch -------------------------------------------------------------------------------


def test_split_all_decodes():
    s = split([1, 1, 1], [5, 0, 3])
    assert s == BatchSplit(3, 3, (3, 3), (3, 3), (3, 3), (3, 3))


def test_split_decodes_then_fresh_prefills_go_ragged():
    s = split([1, 1, 17, 5], [39, 2, 0, 0])
    assert s == BatchSplit(2, 2, (2, 4), (4, 4), (2, 24), (24, 24))


def test_split_prefills_with_context_go_paged():
    s = split([1, 9, 4], [39, 30, 1])
    assert s == BatchSplit(1, 1, (1, 1), (1, 3), (1, 1), (1, 14))


def test_split_interleaved_takes_the_larger_leading_run():
    # prefills: fresh 10, context 3, fresh 4 -> leading run (10 tokens) is ragged
    s = split([1, 10, 3, 4], [5, 0, 7, 0])
    assert s == BatchSplit(1, 1, (1, 2), (2, 4), (1, 11), (11, 18))


def test_split_interleaved_takes_the_larger_trailing_run():
    # prefills: fresh 2, context 3, fresh 8 + fresh 9 -> trailing run (17 tokens) is ragged
    s = split([1, 2, 3, 8, 9], [5, 0, 7, 0, 0])
    assert s == BatchSplit(1, 1, (3, 5), (1, 3), (6, 23), (1, 6))


def test_split_tie_takes_the_leading_run():
    s = split([4, 3, 4], [0, 7, 0])
    assert s == BatchSplit(0, 0, (0, 1), (1, 3), (0, 4), (4, 11))


def test_split_without_ragged_sends_every_prefill_to_the_paged_wrapper():
    s = split([1, 17, 5], [39, 0, 0], allow_ragged=False)
    assert s == BatchSplit(1, 1, (1, 1), (1, 3), (1, 1), (1, 23))


def test_split_a_decode_after_a_prefill_is_served_as_a_prefill():
    s = split([1, 5, 1], [3, 0, 9])
    assert s == BatchSplit(1, 1, (1, 2), (2, 3), (1, 6), (6, 7))


def test_split_decode_threshold():
    s = split([2, 3, 1, 4], [10, 10, 10, 10], decode_threshold=3)
    assert (s.num_decodes, s.num_decode_tokens, s.paged_reqs) == (3, 6, (3, 4))


def test_split_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="num_reqs \\+ 1"):
        split_batch(np.array([0, 1, 2]), np.array([0]))


# --- page table --------------------------------------------------------------------------------


def test_paged_kv_indptr_and_last_page_len():
    indptr, last = paged_kv_indptr(np.array([1, 16, 17, 33, 0]), 16)
    assert indptr.tolist() == [0, 1, 2, 4, 7, 7]
    assert last.tolist() == [1, 16, 1, 1, 1]
    assert indptr.dtype == np.int32 and last.dtype == np.int32


def test_paged_kv_indices_read_each_rows_first_pages():
    table = np.array([[7, 3, 0, 0], [9, 0, 0, 0], [4, 8, 2, 0]], dtype=np.int32)
    indices = paged_kv_indices(table, np.array([17, 1, 48]), 16)
    assert indices.tolist() == [7, 3, 9, 4, 8, 2]
    # rows 1 and 2 only: positions start at row 1 of the flat table
    index = paged_kv_gather_index(np.array([1, 48]), 16, first_row=1, num_cols=4)
    assert index.tolist() == [4, 8, 9, 10]
    assert paged_kv_indices(table, np.array([1, 48]), 16, first_row=1).tolist() == [9, 4, 8, 2]


def test_paged_kv_gather_index_rejects_a_narrow_table():
    with pytest.raises(ValueError, match="block_table too narrow"):
        paged_kv_gather_index(np.array([65]), 16, first_row=0, num_cols=4)


def test_qo_and_ragged_indptr():
    loc = loc_of([1, 1, 17, 5])
    assert qo_indptr(loc, (2, 4)).tolist() == [0, 17, 22]
    assert ragged_kv_indptr(loc, np.array([3, 4, 0, 0]), (2, 4)).tolist() == [0, 17, 22]
    with pytest.raises(ValueError, match="fresh prefill"):
        ragged_kv_indptr(loc, np.array([3, 4, 0, 2]), (2, 4))


# --- plan_step ---------------------------------------------------------------------------------


def test_plan_step_mixed_batch():
    # decodes (seq 40, 3), a fresh prefill of 17, a chunk of 5 on 65 tokens of context
    loc = loc_of([1, 1, 17, 5])
    arrays = plan_step(loc, np.array([40, 3, 17, 70]), 16, num_cols=5)
    assert arrays.split == BatchSplit(2, 2, (2, 3), (3, 4), (2, 19), (19, 24))
    d = arrays.decode
    assert d.qo_indptr is None
    assert d.paged_kv_indptr.tolist() == [0, 3, 4]
    assert d.paged_kv_last_page_len.tolist() == [8, 3]
    assert d.seq_lens.tolist() == [40, 3]
    assert d.gather_positions(5).tolist() == [0, 1, 2, 5]
    p = arrays.paged
    assert p.qo_indptr.tolist() == [0, 5]
    assert p.paged_kv_indptr.tolist() == [0, 5]
    assert p.paged_kv_last_page_len.tolist() == [6]
    assert p.rectangle == (slice(3, 4), slice(0, 5))  # one request: a rectangle
    assert p.gather_positions(5).tolist() == [15, 16, 17, 18, 19]
    assert arrays.ragged_qo_indptr.tolist() == [0, 17]
    assert arrays.ragged_kv_indptr.tolist() == [0, 17]


def test_plan_step_fp8_plans_every_prefill_paged():
    arrays = plan_step(loc_of([1, 17]), np.array([40, 17]), 16, num_cols=3, allow_ragged=False)
    assert arrays.ragged_qo_indptr is None and arrays.ragged_kv_indptr is None
    assert arrays.paged.qo_indptr.tolist() == [0, 17]
    assert arrays.paged.paged_kv_last_page_len.tolist() == [1]


def test_plan_step_cudagraph_padding_needs_room():
    with pytest.raises(ValueError, match="more requests than the padded size"):
        plan_step(loc_of([1, 1, 1]), np.array([5, 40, 16]), 16, num_cols=3, cudagraph_num_reqs=2)


def test_plan_step_cudagraph_pads_the_decodes():
    arrays = plan_step(loc_of([1, 1, 1]), np.array([5, 40, 16]), 16, num_cols=3,
                       cudagraph_num_reqs=8)  # fmt: skip
    d = arrays.decode
    assert d.paged_kv_indptr.tolist() == [0, 1, 4, 5, 5, 5, 5, 5, 5]
    assert d.paged_kv_last_page_len.tolist() == [5, 8, 16, 1, 1, 1, 1, 1]
    assert d.seq_lens.tolist() == [5, 40, 16, 0, 0, 0, 0, 0]
    assert d.num_reqs == 8
    assert d.gather_positions(3).tolist() == [0, 3, 4, 5, 6]
    # one array holds both, for one copy to the device
    joint = d.paged_kv_indptr.tolist() + d.paged_kv_last_page_len.tolist()
    assert d.indptr_and_last.tolist() == joint
    assert np.shares_memory(d.indptr_and_last, d.paged_kv_indptr)
    assert arrays.paged is None and arrays.ragged_qo_indptr is None


def test_plan_step_rejects_more_pages_than_int32_offsets_hold():
    # the offsets would wrap around in FlashInfer's int32 indptr
    with pytest.raises(ValueError, match="too many pages for FlashInfer's int32 page offsets"):
        plan_step(np.arange(4), np.full(3, 2**31 - 1), 1, 2**31)
    # a bound past int32 with a total within it is fine
    arrays = plan_step(np.arange(3), np.array([2**31 - 10, 1]), 1, 2**31)
    assert arrays.decode.paged_kv_indptr.tolist() == [0, 2**31 - 10, 2**31 - 9]


def test_plan_step_rejects_bad_batches():
    with pytest.raises(ValueError, match="decodes only"):
        plan_step(loc_of([1, 4]), np.array([5, 4]), 16, num_cols=2, cudagraph_num_reqs=4)
    with pytest.raises(ValueError, match="at least one query token"):
        plan_step(loc_of([1, 0]), np.array([5, 4]), 16, num_cols=2)
    with pytest.raises(ValueError, match="shorter than its query"):
        plan_step(loc_of([6]), np.array([5]), 16, num_cols=2)


@pytest.mark.parametrize("decode_arrays", [True, False])
@pytest.mark.parametrize("context", [120, 0], ids=["paged-prefill", "ragged-prefill"])
def test_plan_step_narrow_table_reports_the_longest_request(context, decode_arrays):
    # a decode of 13 pages, then a prefill of 19: the step needs 19 columns, not the 13 of the
    # decode part that is planned first
    query_lens, seq_lens = [1, 300 - context], [200, 300]
    with pytest.raises(ValueError) as raised:
        plan_step(loc_of(query_lens), np.array(seq_lens), 16, 12, decode_arrays=decode_arrays)
    assert str(raised.value).startswith(
        "plan_step: block_table too narrow for the longest sequence (got 12 columns, expected "
        ">= 19 for block_size 16)."
    )
    plan_step(loc_of(query_lens), np.array(seq_lens), 16, 19, decode_arrays=decode_arrays)


# --- random batches against a loop-by-loop reference -------------------------------------------


def reference_plan(query_lens, seq_lens, table, block_size, split_):
    """FlashInfer's CSR arrays for each part, one request at a time."""
    out = {}
    parts = {"decode": (0, split_.num_decodes), "paged": split_.paged_reqs}
    for name, (start, end) in parts.items():
        indptr, indices, last, qo = [0], [], [], [0]
        for r in range(start, end):
            pages = -(-seq_lens[r] // block_size)
            indices += [int(table[r, c]) for c in range(pages)]
            indptr.append(len(indices))
            last.append(seq_lens[r] - (pages - 1) * block_size)
            qo.append(qo[-1] + query_lens[r])
        out[name] = (indptr, indices, last, qo)
    return out


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([16, 32, 64]))
    n = draw(st.integers(1, 12))
    query_lens, seq_lens = [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "fresh", "chunk"]))
        if kind == "decode":
            q, context = 1, draw(st.integers(0, 300))
        elif kind == "fresh":
            q, context = draw(st.integers(1, 200)), 0
        else:
            q, context = draw(st.integers(2, 200)), draw(st.integers(1, 300))
        query_lens.append(q)
        seq_lens.append(q + context)
    if draw(st.booleans()):  # decodes first, as the builder asks
        order = sorted(range(n), key=lambda r: query_lens[r] != 1)
        query_lens = [query_lens[r] for r in order]
        seq_lens = [seq_lens[r] for r in order]
    return block_size, query_lens, seq_lens, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_random_batches_match_the_reference(batch):
    block_size, query_lens, seq_lens, allow_ragged, seed = batch
    n = len(query_lens)
    num_cols = max(-(-s // block_size) for s in seq_lens) + 1
    table = np.random.default_rng(seed).permutation(n * num_cols + 7)[: n * num_cols] + 1
    table = table.reshape(n, num_cols).astype(np.int32)
    loc = loc_of(query_lens)
    arrays = plan_step(loc, np.array(seq_lens), block_size, num_cols, allow_ragged=allow_ragged)
    s = arrays.split
    context = [seq - q for q, seq in zip(query_lens, seq_lens, strict=True)]

    # decodes lead; ragged and paged together are exactly the prefills, each contiguous
    assert all(q == 1 for q in query_lens[: s.num_decodes])
    assert s.num_decodes == n or query_lens[s.num_decodes] > 1
    ragged, paged = set(range(*s.ragged_reqs)), set(range(*s.paged_reqs))
    assert not ragged & paged and ragged | paged == set(range(s.num_decodes, n))
    assert all(context[r] == 0 for r in ragged)
    assert allow_ragged or not ragged
    if allow_ragged:
        # the ragged run is the larger of the leading and trailing runs of fresh prefills
        prefills = list(range(s.num_decodes, n))
        lead = trail = 0
        for r in prefills:
            if context[r]:
                break
            lead += query_lens[r]
        for r in reversed(prefills):
            if context[r]:
                break
            trail += query_lens[r]
        ragged_tokens = s.ragged_tokens[1] - s.ragged_tokens[0]
        if all(context[r] == 0 for r in prefills):
            assert not paged
        else:
            assert ragged_tokens == max(lead, trail)
    for reqs, tokens in ((s.ragged_reqs, s.ragged_tokens), (s.paged_reqs, s.paged_tokens)):
        assert tokens == (int(loc[reqs[0]]), int(loc[reqs[1]]))

    expected = reference_plan(query_lens, seq_lens, table, block_size, s)
    for name, part in (("decode", arrays.decode), ("paged", arrays.paged)):
        indptr, indices, last, qo = expected[name]
        if part is None:
            assert indptr == [0]
            continue
        assert part.paged_kv_indptr.tolist() == indptr
        assert table.reshape(-1)[part.gather_positions(num_cols)].tolist() == indices
        if part.rectangle is not None:  # a rectangle of the table, read row by row
            assert table[part.rectangle].reshape(-1).tolist() == indices
        assert part.paged_kv_last_page_len.tolist() == last
        assert part.indptr_and_last.tolist() == indptr + last
        assert all(1 <= x <= block_size for x in last)
        if name == "paged":
            assert part.qo_indptr.tolist() == qo
    if ragged:
        lens = [query_lens[r] for r in range(*s.ragged_reqs)]
        assert arrays.ragged_qo_indptr.tolist() == loc_of(lens).tolist()
        assert arrays.ragged_kv_indptr.tolist() == loc_of(lens).tolist()
    else:
        assert arrays.ragged_qo_indptr is None


# --- the gather index's fast layouts, against a loop-by-loop reference --------------------------


def reference_gather_index(seq_lens, block_size, first_row, num_cols):
    index = []
    for i, seq in enumerate(seq_lens):
        index += [(first_row + i) * num_cols + c for c in range(-(-seq // block_size))]
    return index


@pytest.mark.parametrize(
    ("seq_lens", "num_cols"),
    [
        ([2048] * 6, 128),  # whole rows: one run of the table
        ([2048] * 6, 130),  # the same pages per request, narrower than the table
        ([2033, 2048, 2040], 128),  # the same pages per request, ragged last pages
        ([1, 16, 17, 2048], 128),  # ragged
        ([0, 0, 0], 4),  # no pages
        ([0, 32, 0, 48], 3),  # requests without pages among others
        ([], 4),
        ([32], 2),
    ],
)
@pytest.mark.parametrize("first_row", [0, 3])
def test_paged_kv_gather_index_layouts(seq_lens, num_cols, first_row):
    index = paged_kv_gather_index(np.array(seq_lens, np.int32), 16, first_row, num_cols)
    assert index.dtype == np.int32
    assert index.tolist() == reference_gather_index(seq_lens, 16, first_row, num_cols)


def test_paged_kv_indptr_of_empty_lengths_keeps_last_page_len_1_and_refuses_negative_ones():
    indptr, last = paged_kv_indptr(np.array([0, 5, 0, 32], np.int32), 16)
    assert indptr.tolist() == [0, 0, 1, 1, 3]  # as ceil(seq / 16), cumulated
    assert last.tolist() == [1, 5, 1, 16]
    with pytest.raises(ValueError, match=r"seq_lens must not be negative \(got -20\)"):
        paged_kv_indptr(np.array([0, 5, -20, 32], np.int32), 16)


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.sampled_from([1, 16, 64]),
    pages=st.lists(st.integers(0, 9), max_size=10),
    uniform=st.booleans(),
    extra_cols=st.integers(0, 2),
    first_row=st.integers(0, 3),
    data=st.data(),
)
def test_random_gather_index_matches_the_reference(
    block_size, pages, uniform, extra_cols, first_row, data
):
    if uniform and pages:
        pages = [pages[0]] * len(pages)
    # a sequence of p pages holds (p - 1) * block_size + 1 ... p * block_size tokens
    seq_lens = [
        0 if p == 0 else (p - 1) * block_size + data.draw(st.integers(1, block_size)) for p in pages
    ]
    num_cols = max(pages, default=0) + extra_cols
    index = paged_kv_gather_index(np.array(seq_lens, np.int64), block_size, first_row, num_cols)
    assert index.dtype == np.int32
    assert index.tolist() == reference_gather_index(seq_lens, block_size, first_row, num_cols)
    indptr, last = paged_kv_indptr(np.array(seq_lens, np.int64), block_size)
    assert indptr.tolist() == np.concatenate([[0], np.cumsum(pages)]).tolist()
    assert last.tolist() == [
        1 if p == 0 else s - (p - 1) * block_size for p, s in zip(pages, seq_lens, strict=True)
    ]


@pytest.mark.parametrize("num_cols", [128, 129])
def test_plan_step_large_uniform_decode_batch(num_cols):
    # the 256 x 2048 decode batch of the build() host-time target, with and without whole rows
    seq_lens = np.full(256, 2048, np.int32)
    arrays = plan_step(loc_of([1] * 256), seq_lens, 16, num_cols)
    d = arrays.decode
    assert d.paged_kv_indptr.tolist() == list(range(0, 128 * 257, 128))
    assert d.paged_kv_last_page_len.tolist() == [16] * 256
    assert d.seq_lens.tolist() == [2048] * 256
    assert d.rectangle == (slice(0, 256), slice(0, 128))  # one copy of the table's rectangle
    assert d.gather_positions(num_cols).tolist() == reference_gather_index(
        [2048] * 256, 16, 0, num_cols
    )
    assert arrays.paged is None and arrays.ragged_qo_indptr is None


# --- the builder's device gather of these indices (flashinfer._gather_pages) --------------------


@settings(max_examples=100, deadline=None)
@given(
    query_lens=st.lists(st.sampled_from([1, 1, 1, 3]), min_size=1, max_size=8),
    context=st.lists(st.integers(0, 70), min_size=8, max_size=8),
    layout=st.sampled_from(["whole rows", "same pages", "any"]),
    allow_ragged=st.booleans(),
    wide_table=st.booleans(),
)
def test_gather_pages_matches_a_plain_index_select(
    query_lens, context, layout, allow_ragged, wide_table
):
    n = len(query_lens)
    seq_lens = [q + c for q, c in zip(query_lens, context, strict=False)]
    num_cols = max(-(-s // 16) for s in seq_lens)
    if layout == "whole rows":  # every request fills its row: a rectangle as wide as the table
        seq_lens = [16 * num_cols] * n
    else:
        if layout == "same pages":  # a rectangle of the table, narrower than it
            seq_lens = [max(s, 16 * (num_cols - 1) + 1) for s in seq_lens]
        num_cols += 1
    pool = torch.randperm((n + 2) * (num_cols + 3) + 5, dtype=torch.int32) + 1
    if wide_table:  # rows padded past num_reqs, a view of a wider buffer (not contiguous)
        table = pool[: (n + 2) * (num_cols + 3)].view(n + 2, num_cols + 3)[:, :num_cols]
    else:
        table = pool[: n * num_cols].view(n, num_cols)
    arrays = plan_step(loc_of(query_lens), np.array(seq_lens), 16, num_cols,
                       allow_ragged=allow_ragged)  # fmt: skip
    flat = table.reshape(-1)
    for part in (arrays.decode, arrays.paged):
        if part is None:
            continue
        pages = _gather_pages(table, part)
        assert pages.shape == (part.num_pages,)
        expected = flat[torch.from_numpy(part.gather_positions(num_cols)).long()]
        assert pages.dtype == torch.int32 and pages.is_contiguous()
        assert torch.equal(pages, expected)
        assert pages.untyped_storage().data_ptr() != table.untyped_storage().data_ptr()


def test_gather_pages_of_a_padded_cudagraph_plan_reads_only_the_real_rows():
    # unequal lengths (no rectangle), padded to 6 requests; the table has the 3 real rows only
    table = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]], dtype=torch.int32)
    arrays = plan_step(loc_of([1, 1, 1]), np.array([20, 5, 40]), 16, num_cols=3,
                       cudagraph_num_reqs=6)  # fmt: skip
    d = arrays.decode
    assert d.rectangle is None and d.num_reqs == 6 and d.num_real_reqs == 3
    pages = _gather_pages(table, d)
    assert pages.tolist() == [11, 12, 21, 31, 32, 33]


# --- the single-token decode fast path of plan_step, against the general path ------------------


def outcome(fn, *args, **kwargs):
    """The result, or the error's type and message."""
    try:
        return fn(*args, **kwargs)
    except ValueError as error:
        return type(error), str(error)


def assert_same_step(a, b):
    """Two `StepArrays` hold the same values, dtypes and layouts."""
    assert a.split == b.split
    for x, y in (
        (a.ragged_qo_indptr, b.ragged_qo_indptr),
        (a.ragged_kv_indptr, b.ragged_kv_indptr),
    ):
        assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y))
    for x, y in ((a.decode, b.decode), (a.paged, b.paged)):
        assert (x is None) == (y is None)
        if x is None:
            continue
        for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len", "seq_lens"):
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None and v is None) or (u.dtype == v.dtype and np.array_equal(u, v))
        for name in ("rectangle", "first_row", "num_real_reqs", "max_pages"):
            assert getattr(x, name) == getattr(y, name), name


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.sampled_from([1, 16, 64]),
    seq_lens=st.lists(st.integers(0, 300), max_size=12),
    same_pages=st.booleans(),
    extra_cols=st.integers(-1, 2),
    padding=st.sampled_from([None, 0, 1, 5, -1]),
    dtype=st.sampled_from([np.int32, np.int64]),
    first_token=st.integers(0, 3),
    decode_arrays=st.booleans(),
)
def test_decode_fast_path_equals_the_general_path(
    block_size, seq_lens, same_pages, extra_cols, padding, dtype, first_token, decode_arrays
):
    # seq_len 0 is shorter than the query (an error); a table one column short is one too
    n = len(seq_lens)
    if same_pages and n:
        seq_lens = [-(-seq_lens[0] // block_size) * block_size] * n
    num_cols = max(max((-(-s // block_size) for s in seq_lens), default=0) + extra_cols, 0)
    padded = None if padding is None else max(n + padding, 0)
    loc, seq = (loc_of([1] * n) + first_token).astype(dtype), np.array(seq_lens, dtype)
    fast = outcome(
        plan_step, loc, seq, block_size, num_cols, cudagraph_num_reqs=padded,
        decode_arrays=decode_arrays,
    )  # fmt: skip
    general = outcome(
        _plan_any,
        loc.astype(np.int64),
        seq.astype(np.int64),
        np.ones(n, np.int64),
        block_size,
        num_cols,
        1,
        True,
        padded,
        decode_arrays,
    )
    if isinstance(fast, tuple) or isinstance(general, tuple):
        assert fast == general
    else:
        assert_same_step(fast, general)


@settings(max_examples=100, deadline=None)
@given(
    query_lens=st.lists(st.integers(1, 5), min_size=1, max_size=8),
    context=st.lists(st.integers(0, 90), min_size=8, max_size=8),
    extra_cols=st.integers(-1, 1),
)
def test_a_step_without_decode_arrays_has_the_same_split_and_width_check(
    query_lens, context, extra_cols
):
    # decode_arrays=False (XQA decodes): no decode arrays, everything else as with them, and
    # a table too narrow for a decode is refused all the same
    seq = np.array([q + c for q, c in zip(query_lens, context, strict=False)])
    num_cols = max(-(-int(s) // 16) for s in seq) + extra_cols
    loc = loc_of(query_lens)
    with_arrays = outcome(plan_step, loc, seq, 16, num_cols)
    without = outcome(plan_step, loc, seq, 16, num_cols, decode_arrays=False)
    if isinstance(without, tuple):
        assert without[0] is ValueError and "block_table too narrow" in without[1]
        assert isinstance(with_arrays, tuple)
        return
    assert not isinstance(with_arrays, tuple), with_arrays  # refused with the arrays only
    assert without.decode is None
    assert_same_step(without, dataclasses.replace(with_arrays, decode=None))


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.sampled_from([1, 16, 64]),
    seq_lens=st.lists(st.integers(1, 300), max_size=12),
    extra_cols=st.integers(-1, 2),
    padding=st.sampled_from([None, 0, 1, 5, -1]),
)
def test_decode_step_arrays_is_plan_step_of_a_decode_batch(
    block_size, seq_lens, extra_cols, padding
):
    # (from the longest request alone: the same split, and the same refusals)
    n = len(seq_lens)
    num_cols = max(max((-(-s // block_size) for s in seq_lens), default=0) + extra_cols, 0)
    padded = None if padding is None else max(n + padding, 0)
    longest = max(seq_lens, default=0)
    lean = outcome(decode_step_arrays, n, longest, block_size, num_cols, padded)
    full = outcome(
        plan_step, loc_of([1] * n), np.array(seq_lens, np.int64), block_size, num_cols,
        cudagraph_num_reqs=padded, decode_arrays=False,
    )  # fmt: skip
    if isinstance(lean, tuple) or isinstance(full, tuple):
        assert lean == full
    else:
        assert_same_step(lean, full)


def test_decode_batches_take_the_fast_path(monkeypatch):
    def no_split(*args):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(flashinfer_plan, "_split", no_split)
    arrays = plan_step(loc_of([1] * 3), np.array([5, 40, 16]), 16, num_cols=3)
    assert arrays.split == BatchSplit(3, 3, (3, 3), (3, 3), (3, 3), (3, 3))
    with pytest.raises(AssertionError, match="general path"):
        plan_step(loc_of([1, 2]), np.array([5, 40]), 16, num_cols=3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        ([1, 1, 1, 1], [80, 80, 80, 80]),  # whole rows: a rectangle as wide as the table
        ([1, 1], [80, 20]),  # a whole row, then the next one's start: gathered by the kernel
        ([1, 1, 1, 1], [40, 48, 33, 47]),  # the same pages: a rectangle narrower than the table
        ([1, 1, 1, 1], [5, 64, 17, 1]),  # different pages: gathered through the indptr
        ([1, 1, 9, 3], [5, 64, 40, 70]),  # decodes and paged prefills (from row 2)
    ],
)
def test_gather_pages_on_the_gpu(query_lens, seq_lens):
    # rectangles are copied, other pages gathered through the indptr by the Triton kernel
    num_cols = 5
    # a view of a wider buffer, as an engine's persistent block table is
    table = (torch.randperm(40, dtype=torch.int32)[:24] + 1).view(4, 6)[:, :num_cols]
    arrays = plan_step(loc_of(query_lens), np.array(seq_lens), 16, num_cols, allow_ragged=False)
    flat = table.reshape(-1)
    for part in (arrays.decode, arrays.paged):
        if part is None:
            continue
        pages = _gather_pages(table.cuda(), part)
        assert pages.is_cuda and pages.dtype == torch.int32
        expected = flat[torch.from_numpy(part.gather_positions(num_cols)).long()]
        assert torch.equal(pages.cpu(), expected)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "padded"),
    [
        ([1, 1, 1], [40, 3, 150], None),  # decodes only
        ([1, 1, 5, 17], [40, 3, 70, 17], None),  # decodes, then prefills
        ([1, 1, 1], [40, 3, 33], 5),  # a CUDA-graph batch padded to 5
        ([5, 17], [70, 17], None),  # no decodes
        ([], [], 4),  # only padding
    ],
)
def test_decode_part_is_plan_steps_decode_part(query_lens, seq_lens, padded):
    """A step planned without the decode arrays gets them later from `decode_part`, equal to
    those `plan_step` makes in one go."""
    loc, seq = loc_of(query_lens), np.array(seq_lens, dtype=np.int64)
    whole = plan_step(loc, seq, 16, 12, cudagraph_num_reqs=padded)
    without = plan_step(loc, seq, 16, 12, cudagraph_num_reqs=padded, decode_arrays=False)
    assert without.decode is None
    if whole.decode is None:
        return
    part = decode_part(seq, 16, 12, without.split.num_decodes, padded)
    for name in ("paged_kv_indptr", "paged_kv_last_page_len", "seq_lens", "indptr_and_last"):
        assert getattr(part, name).tolist() == getattr(whole.decode, name).tolist(), name
    assert (part.num_real_reqs, part.max_pages, part.rectangle) == (
        whole.decode.num_real_reqs,
        whole.decode.max_pages,
        whole.decode.rectangle,
    )
