"""FLASHINFER's plan-free XQA decode: which layers it serves, its CUDA-graph buffers and the call
it makes (CPU), and on the GPU: the conformance kit with XQA forced for every decode it can
serve, and a build of XQA decodes that plans nothing and never waits on the device (the
builder's XQA routing over a CPU stand-in: tests/backends/test_flashinfer_builder.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from flashinfer_gpu import forward, needs_flashinfer_sm90, oracle, written_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from anyattn.backends.flashinfer import FlashInferBackend, FlashInferMetadataBuilder
from anyattn.backends.flashinfer_xqa import (
    AUTO_MIN_BLOCK_SIZE,
    XqaGraphBuffers,
    contiguous_rows,
    run_xqa_decode,
    xqa_decode_reason,
)
from anyattn.testing import check_backend, get_spec, max_abs_error

BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
H100, A100 = (9, 0), (8, 0)


def reason(
    kernel="auto", capability=H100, block=64, head=128, cache=BF16, cap=0.0, group=4, dtype=BF16
):
    return xqa_decode_reason(kernel, capability, block, head, dtype, cache, cap, group)


def test_xqa_serves_what_its_interface_takes_and_auto_only_at_large_blocks():
    assert reason() is None
    assert reason(block=128) is None and reason("xqa", cache=E4M3) is None
    # the persistent query tile: 16 KiB of 16-bit heads, the group rounded up to 16
    assert reason(group=64) is None and reason(head=64, group=128) is None
    assert reason(head=256, group=32) is None and reason(group=None) is None
    assert reason("xqa", block=16) is None and reason("xqa", (10, 0)) is None
    assert reason("xqa", (12, 1), block=32, head=64) is None
    assert AUTO_MIN_BLOCK_SIZE == 64
    refusals = {
        "decode_kernel is 'wrapper'": reason("wrapper"),
        "XQA needs SM90, SM100 or SM12x (got (8, 0))": reason(capability=A100),
        "XQA needs SM90, SM100 or SM12x (got None)": reason(capability=None),
        "XQA has no soft cap": reason(cap=30.0),
        "XQA reads caches of the model dtype or fp8 e4m3 (got torch.float8_e5m2)": reason(
            cache=E5M2
        ),
        "XQA reads caches of the model dtype or fp8 e4m3 (got torch.float16)": reason(
            cache=torch.float16
        ),
        "XQA pages are (16, 32, 64, 128) tokens (got 48)": reason("xqa", block=48),
        "XQA head sizes are multiples of 16 up to 512 (got 72)": reason(head=72),
        "XQA head sizes are multiples of 16 up to 512 (got 528)": reason(head=528),
        "XQA takes <= 64 query heads per KV head at head size 128 (got 65)": reason(group=65),
        "XQA takes <= 32 query heads per KV head at head size 256 (got 33)": reason(
            head=256, group=33
        ),
        "fp8 caches: XQA's fp8 kernel rounds queries to e4m3 (decode_kernel 'xqa' uses it "
        "anyway)": reason(cache=E4M3),
        # measured on the H200: the kit's fp8 cases at 4.5x fp16's bound (bf16's held)
        "fp16 queries over an fp8 cache: XQA's fp8 kernel rounds them to e4m3, past fp16's "
        "error bound": reason("xqa", cache=E4M3, dtype=torch.float16),
    }
    for expected, got in refusals.items():
        assert got == expected
    assert reason(block=32).startswith("blocks under 64 tokens: the planned decode is faster")


def test_a_bad_decode_kernel_is_refused():
    with pytest.raises(ValueError, match=r"decode_kernel not supported \(got 'fast'"):
        reason("fast")


def test_graph_buffers_take_the_steps_rows_and_pad_the_rest_with_one_key():
    buffers = XqaGraphBuffers(4, 5, torch.device("cpu"))
    table = torch.arange(1, 13, dtype=torch.int32).view(4, 3)
    buffers.fill(table, torch.tensor([20, 7, 3, 99], dtype=torch.int32), 2, 2)
    assert buffers.page_table.tolist() == [[1, 2, 0, 0, 0], [4, 5, 0, 0, 0]] + [[0] * 5] * 2
    assert buffers.seq_lens.tolist() == [20, 7, 1, 1]
    # a later, smaller step: earlier rows past it keep valid ids, their lengths become 1
    buffers.fill(table[2:], torch.tensor([33, 5], dtype=torch.int32), 1, 3)
    assert buffers.page_table[0].tolist() == [7, 8, 9, 0, 0]
    assert buffers.seq_lens.tolist() == [33, 1, 1, 1]


def test_graph_buffers_refuse_steps_past_them_before_writing():
    buffers = XqaGraphBuffers(2, 3, torch.device("cpu"))
    table = torch.arange(1, 16, dtype=torch.int32).view(3, 5)
    lens = torch.tensor([9, 8, 7], dtype=torch.int32)
    for num_reqs, num_pages in ((3, 2), (2, 4), (-1, 2)):
        with pytest.raises(ValueError, match="larger than its graph's buffers"):
            buffers.fill(table, lens, num_reqs, num_pages)
    assert buffers.page_table.tolist() == [[0] * 3] * 2 and buffers.seq_lens.tolist() == [1, 1]


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 5), st.integers(1, 10**4)),
        min_size=1,
        max_size=8,
    )
)
def test_graph_buffers_after_any_sequence_of_fills(steps):
    # each fill: (requests, table columns, a seed for its ids and lengths)
    size, max_pages = 6, 5
    buffers = XqaGraphBuffers(size, max_pages, torch.device("cpu"))
    every_id = {0}
    for num_reqs, cols, seed in steps:
        g = torch.Generator().manual_seed(seed)
        table = torch.randint(1, 1000, (size, cols), generator=g, dtype=torch.int32)
        lens = torch.randint(1, 10**5, (size,), generator=g, dtype=torch.int32)
        buffers.fill(table, lens, num_reqs, cols)
        every_id |= set(table[:num_reqs].flatten().tolist())
        assert buffers.page_table[:num_reqs, :cols].tolist() == table[:num_reqs].tolist()
        assert buffers.seq_lens[:num_reqs].tolist() == lens[:num_reqs].tolist()
        assert buffers.seq_lens[num_reqs:].tolist() == [1] * (size - num_reqs)  # padding
        # padding rows read one key, at a page id some step gave (or zero)
        assert set(buffers.page_table[num_reqs:, 0].tolist()) <= every_id


def test_contiguous_rows_copies_only_a_column_slice():
    table = torch.arange(24, dtype=torch.int32).view(4, 6)
    rows = contiguous_rows(table, 3)
    assert rows.data_ptr() == table.data_ptr() and rows.shape == (3, 6)
    narrow = contiguous_rows(table[:, :4], 2)
    assert narrow.is_contiguous() and narrow.tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]


def test_run_xqa_decode_passes_flashinfer_the_scales_bounds_and_a_contiguous_query(monkeypatch):
    calls = []
    decode = types.ModuleType("flashinfer.decode")
    decode.xqa_batch_decode_with_kv_cache = lambda *args, **kwargs: calls.append((args, kwargs))
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    fused = torch.randn(3, 6, 16)  # a fused QKV: the query is its first 4 heads
    query, out = fused[:, :4], torch.empty(3, 4, 16)
    cache, table = torch.zeros(9, 2, 32, 2, 16), torch.zeros(3, 5, dtype=torch.int32)
    lens, workspace = torch.tensor([1, 2, 3], dtype=torch.int32), torch.zeros(8)
    run_xqa_decode(query, cache, table, lens, scale=0.25, k_scale=2.0, v_scale=0.5,
                   window_left=99, workspace=workspace, out=out)  # fmt: skip
    ((args, kwargs),) = calls
    assert args[0].is_contiguous() and torch.equal(args[0], query)
    assert args[1:5] == (cache, workspace, table, lens) and args[5] == 5 * 32
    assert kwargs == dict(bmm1_scale=0.5, bmm2_scale=0.5, window_left=99, out=out, kv_layout="NHD")
    run_xqa_decode(query.contiguous(), cache, table, lens, scale=0.25, k_scale=None, v_scale=None,
                   window_left=-1, workspace=workspace, out=out)  # fmt: skip
    assert calls[1][1]["bmm1_scale"] == 0.25 and calls[1][1]["bmm2_scale"] == 1.0


# --- GPU ---------------------------------------------------------------------------------------


class XqaBuilder(FlashInferMetadataBuilder):
    decode_kernel = "xqa"


class XqaBackend(FlashInferBackend):
    """FLASHINFER with XQA forced for every decode it can serve (16-token blocks too)."""

    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return XqaBuilder


# Every decode-bearing feature FLASHINFER declares (soft cap: the wrapper runs its decodes;
# not "lse": XQA returns none, and a forward asking for one on XQA decodes is refused).
XQA_FEATURES = (
    "decode", "mixed", "chunked", "odd_lengths", "gqa", "mqa", "head_sizes", "block_sizes",
    "layouts", "padding", "kv_sharing", "non_causal", "sliding_window", "soft_cap", "fp8",
)  # fmt: skip


@needs_flashinfer_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("feature", XQA_FEATURES)
def test_conformance_kit_with_xqa_decodes(feature, dtype):
    report = check_backend(XqaBackend, "cuda", dtype, features=[feature])
    report.assert_passed()


@needs_flashinfer_sm90
def test_auto_build_of_large_block_decodes_plans_nothing_and_never_waits():
    batch, impl = written_batch(get_spec("many_decodes"), seed=3, block_size=64)
    builder = batch.builder
    forward(impl, batch, builder.build(0, batch.common_attn_metadata))  # JIT, buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = builder.build(0, batch.common_attn_metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    plan = md.plans["layer.0"]
    assert plan.xqa is not None and (plan.decode, plan.ragged, plan.paged) == (None, None, None)
    output, _ = forward(impl, batch, md)
    ref64, _, bound = oracle(batch)
    assert max_abs_error(output[: batch.num_actual_tokens], ref64) <= bound
    with pytest.raises(ValueError, match="returns no LSE"):
        forward(impl, batch, md, with_lse=True)
