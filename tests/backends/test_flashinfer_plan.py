"""FLASHINFER's `plan()` arguments, exactly: the decode / prefill split and FlashInfer's CSR page
lists (offsets, page ids, last-page lengths, query offsets), CUDA-graph padding; hand-built cases
and random batches against a request-by-request reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anyattn.backends.flashinfer_plan import num_leading_decodes, paged_index
from anyattn.metadata import make_common_attn_metadata

TABLE = torch.arange(1, 41, dtype=torch.int32).view(8, 5)


def host(query_lens, seq_lens, table=TABLE, block_size=16):
    return make_common_attn_metadata(query_lens, seq_lens, table[: len(seq_lens)], block_size)


def test_leading_decodes():
    assert num_leading_decodes(host([1, 1, 5, 1], [40, 3, 70, 17]).host_batch) == 2
    assert num_leading_decodes(host([1, 1], [40, 3]).host_batch) == 2
    assert num_leading_decodes(host([4, 1], [40, 3]).host_batch) == 0
    assert num_leading_decodes(host([], [], TABLE[:0]).host_batch) == 0


def test_decode_and_prefill_parts():
    cm = host([1, 1, 5, 17], [40, 3, 70, 17])
    decode = paged_index(cm.host_batch, cm.block_table_tensor, 16, (0, 2))
    assert decode.kv_indptr.tolist() == [0, 3, 4]
    assert decode.kv_last_page_len.tolist() == [8, 3]
    assert decode.kv_indices.tolist() == [1, 2, 3, 6]
    assert decode.qo_indptr.tolist() == [0, 1, 2] and decode.num_pages == 4
    prefill = paged_index(cm.host_batch, cm.block_table_tensor, 16, (2, 4))
    assert prefill.qo_indptr.tolist() == [0, 5, 22]  # from the part's first row
    assert prefill.kv_indptr.tolist() == [0, 5, 7]
    assert prefill.kv_last_page_len.tolist() == [6, 1]
    assert prefill.kv_indices.tolist() == [11, 12, 13, 14, 15, 16, 17]
    for x in (prefill.qo_indptr, prefill.kv_indptr, prefill.kv_indices, prefill.kv_last_page_len):
        assert x.dtype == torch.int32


def test_cudagraph_padding_requests_have_no_pages_and_no_rows():
    cm = host([1] * 3, [9, 40, 2])
    part = paged_index(cm.host_batch, cm.block_table_tensor, 16, (0, 3), padded_reqs=5)
    assert part.kv_indptr.tolist() == [0, 1, 4, 5, 5, 5]
    assert part.kv_last_page_len.tolist() == [9, 8, 2, 1, 1]
    assert part.qo_indptr.tolist() == [0, 1, 2, 3, 3, 3]
    assert part.kv_indices.tolist() == [1, 6, 7, 8, 11]


def test_a_column_slice_of_a_wider_table():
    wide = torch.arange(100, 148, dtype=torch.int32).view(4, 12)
    cm = host([1, 2], [33, 17], wide[:, 2:9])
    part = paged_index(cm.host_batch, cm.block_table_tensor, 16, (0, 2))
    assert part.kv_indices.tolist() == [102, 103, 104, 114, 115]


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 70)), min_size=1, max_size=7),
    block_size=st.sampled_from([1, 4, 16]),
    pad=st.integers(0, 3),
    split=st.integers(0, 7),
)
def test_random_batches_against_a_reference(data, block_size, pad, split):
    query_lens = [q for q, _ in data]
    seq_lens = [q + c for q, c in data]
    width = max(-(-s // block_size) for s in seq_lens)
    table = torch.randperm(1000, dtype=torch.int32)[: len(data) * width].view(len(data), width)
    cm = make_common_attn_metadata(query_lens, seq_lens, table, block_size)
    first = min(split, len(data))
    part = paged_index(cm.host_batch, table, block_size, (first, len(data)),
                       padded_reqs=len(data) - first + pad)  # fmt: skip
    indptr, last, qo, pages = [0], [], [0], []
    for q, s, row in zip(query_lens[first:], seq_lens[first:], table[first:].tolist(), strict=True):
        n = -(-s // block_size)
        pages += row[:n]
        indptr.append(indptr[-1] + n)
        last.append(s - (n - 1) * block_size)
        qo.append(qo[-1] + q)
    indptr += [indptr[-1]] * pad
    qo += [qo[-1]] * pad
    last += [1] * pad
    assert part.kv_indptr.tolist() == indptr and part.kv_last_page_len.tolist() == last
    assert part.qo_indptr.tolist() == qo and part.kv_indices.tolist() == pages
    assert part.num_pages == len(pages)
