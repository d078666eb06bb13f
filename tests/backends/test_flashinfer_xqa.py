"""FLASHINFER's plan-free XQA decode: which layers it serves and its CUDA-graph buffers (CPU),
and on the GPU with FlashInfer 0.7.2.post1: the conformance kit with XQA forced for every
decode, `build` planning nothing for XQA decodes and never waiting on the device, the LSE
fallback to the decode wrapper, layers with a soft cap next to XQA layers, and a stale
CUDA-graph step (CUDA-graph replay with XQA: tests/backends/test_flashinfer.py)."""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch
from flashinfer_gpu import (
    HEAD_SIZE,
    HEADS,
    KV_HEADS,
    SCALE,
    forward,
    needs_flashinfer_sm90,
    oracle,
    written_batch,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import anyattn.backends.flashinfer as fi_backend
from anyattn.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadataBuilder,
)
from anyattn.backends.flashinfer_xqa import (
    AUTO_MIN_BLOCK_SIZE,
    XqaGraphBuffers,
    contiguous_rows,
    run_xqa_decode,
    xqa_decode_reason,
)
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.ops.graph_decode_inputs import GraphDecodeInputsLaunch
from anyattn.testing import (
    KitLayer,
    check_backend,
    get_spec,
    max_abs_error,
)

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


def test_a_bad_decode_kernel_is_refused_when_the_builder_is_made():
    with pytest.raises(ValueError, match=r"decode_kernel not supported \(got 'fast'"):
        reason("fast")

    class Fast(FlashInferMetadataBuilder):
        decode_kernel = "fast"

    spec = AttentionSpec(64, 2, 64, BF16)
    with pytest.raises(ValueError, match="expected one of auto, xqa, wrapper"):
        Fast(spec, {}, BatchLimits(4, 64, 256), "cpu")


def cpu_copy() -> GraphDecodeInputsLaunch:
    return GraphDecodeInputsLaunch(torch.device("cpu"), "FlashInferMetadataBuilder.build")


def test_graph_buffers_take_the_steps_rows_and_pad_the_rest_with_one_key():
    buffers = XqaGraphBuffers(4, 5, torch.device("cpu"), cpu_copy())
    table = torch.arange(1, 13, dtype=torch.int32).view(4, 3)
    buffers.fill(table, torch.tensor([20, 7, 3, 99], dtype=torch.int32), 2, 2)
    assert buffers.page_table.tolist() == [[1, 2, 0, 0, 0], [4, 5, 0, 0, 0]] + [[0] * 5] * 2
    assert buffers.seq_lens.tolist() == [20, 7, 1, 1]
    # a later, smaller step: earlier rows past it keep valid ids, their lengths become 1
    buffers.fill(table[2:], torch.tensor([33, 5], dtype=torch.int32), 1, 3)
    assert buffers.page_table[0].tolist() == [7, 8, 9, 0, 0]
    assert buffers.seq_lens.tolist() == [33, 1, 1, 1]
    lens = torch.tensor([4, 5, 6, 8], dtype=torch.int32)
    buffers.fill(table, lens, 3, 3)
    buffers.fill(table, lens, 3, 3)  # the same size again
    assert buffers.seq_lens.tolist() == [4, 5, 6, 1]
    buffers.fill(table, lens + 10, 2, 3)
    assert buffers.seq_lens.tolist() == [14, 15, 1, 1]


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
    buffers = XqaGraphBuffers(size, max_pages, torch.device("cpu"), cpu_copy())
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


def test_cpu_builders_make_the_decode_wrapper_layout():
    # off CUDA no layer's decodes can run XQA: the build keeps the wrapper's arrays
    spec = AttentionSpec(64, 2, 64, BF16)
    builder = FlashInferMetadataBuilder(spec, {}, BatchLimits(4, 64, 256), "cpu")
    builder.decode_kernel = "xqa"
    table = torch.arange(1, 9, dtype=torch.int32).view(2, 4)
    md = builder.build(0, make_common_attn_metadata([1, 1], [70, 3], table, 64))
    assert md.step.xqa is None and md.step.decode_layout is not None


def xqa_cpu_builder(capture_sizes=(), kernel="xqa", register=True, persistent=False):
    """A CPU builder that takes the XQA path (its capability set to an H100's): everything
    the build does for XQA decodes is host bookkeeping and device copies, CPU tensors here."""
    spec = AttentionSpec(16, 2, 64, BF16)
    limits = BatchLimits(8, 512, 256, cudagraph_capture_sizes=capture_sizes,
                         has_persistent_graph_inputs=persistent)  # fmt: skip
    builder = FlashInferMetadataBuilder(spec, {}, limits, "cpu")
    builder._capability, builder.decode_kernel = H100, kernel
    builder._xqa_reasons.clear()
    if register:
        builder._layer_keys.setdefault(FlashInferImpl(4, 64, 0.125, 2).plan_key, None)
    return builder


TABLE = torch.arange(1, 81, dtype=torch.int32).view(8, 10)


def test_decode_routing_follows_new_layers_and_decode_kernel():
    """The builder keeps its XQA-or-wrapper decision between builds: a layer registered later
    (soft-capped, which XQA does not serve) or another `decode_kernel` changes it."""
    builder = xqa_cpu_builder()
    cm = make_common_attn_metadata([1, 1], [70, 3], TABLE[:2], 16)
    step = builder.build(0, cm).step
    assert step.xqa is not None and step.arrays.decode is None
    # (the decode wrapper needs FlashInfer: the decision itself, which the build follows)
    assert builder._decode_routing() == (True, False)  # XQA for some layer, no plan arrays
    builder._layer_keys.setdefault(
        FlashInferImpl(4, 64, 0.125, 2, logits_soft_cap=30.0).plan_key, None
    )
    assert builder._decode_routing() == (True, True)  # both kinds of layer
    builder.decode_kernel = "wrapper"
    assert builder._decode_routing() == (False, True)


def test_an_xqa_build_hands_the_steps_rows_over_and_plans_nothing():
    builder = xqa_cpu_builder()
    cm = make_common_attn_metadata([1, 1, 1], [40, 3, 150], TABLE[:3, :10], 16)
    md = builder.build(0, cm)
    key = next(iter(builder._layer_keys))
    assert md.step.planned[key].xqa and md.step.planned[key].wrappers() == []
    assert md.step.arrays.decode is None and md.step.decode_layout is None
    page_table, seq_lens = md.step.xqa
    assert page_table.data_ptr() == cm.block_table_tensor.data_ptr()  # the step's own rows
    assert page_table.tolist() == TABLE[:3].tolist() and seq_lens.tolist() == [40, 3, 150]
    # too narrow a table is refused as the wrapper's page gather refuses it
    with pytest.raises(ValueError, match="block_table too narrow"):
        builder.build(0, make_common_attn_metadata([1], [200], TABLE[:1, :10], 16))


def test_the_decode_wrapper_arrays_made_on_demand_equal_a_wrapper_build():
    cm = make_common_attn_metadata([1, 1, 1], [40, 3, 150], TABLE[:3], 16)
    step = xqa_cpu_builder().build(0, cm).step
    wrapper = (
        FlashInferMetadataBuilder(
            AttentionSpec(16, 2, 64, BF16), {}, BatchLimits(8, 512, 256), "cpu"
        )
        .build(0, cm)
        .step
    )
    made, built = step.builder._step_decode_layout(step), wrapper.decode_layout
    assert made.indptr.tolist() == built.indptr.tolist() == [0, 3, 4, 14]
    assert made.last_page_len.tolist() == built.last_page_len.tolist() == [8, 3, 6]
    assert made.indices[:14].tolist() == built.indices[:14].tolist()
    arrays = step.builder._decode_arrays(step)
    assert arrays.paged_kv_indptr.tolist() == [0, 3, 4, 14]
    assert arrays.paged_kv_last_page_len.tolist() == [8, 3, 6]


def test_cudagraph_buffers_are_filled_by_each_build_and_refilled_for_stale_metadata():
    builder = xqa_cpu_builder(capture_sizes=(4,))
    capture = make_common_attn_metadata([1] * 4, [1, 2, 3, 4], TABLE[:4, :10], 16)
    builder.build_for_cudagraph_capture(capture)
    table, lens = builder._xqa_graph[4].page_table, builder._xqa_graph[4].seq_lens
    assert table.shape == (4, 16) and table[:, :1].flatten().tolist() == [1, 11, 21, 31]
    step = make_common_attn_metadata(
        [1] * 3, [40, 3, 150], TABLE[4:7, :10], 16, num_padded_tokens=4
    )
    md = builder.build(0, step)
    assert md.step.xqa == (table, lens)  # the graph's buffers, filled with this step
    assert lens.tolist() == [40, 3, 150, 1]  # the padding row: one key
    assert table[:3, :10].tolist() == TABLE[4:7].tolist()
    assert builder._xqa_filled_by[4] == md.step.generation
    later = make_common_attn_metadata([1] * 4, [5, 6, 7, 8], TABLE[:4, :10], 16)
    builder.build(0, later)
    assert lens.tolist() == [5, 6, 7, 8] and table[:, :1].flatten().tolist() == [1, 11, 21, 31]
    key = next(iter(builder._layer_keys))
    builder.planned(md, key)  # the older step again: its batch goes back into the buffers
    assert lens.tolist() == [40, 3, 150, 1] and builder._xqa_filled_by[4] == md.step.generation
    assert table[:3, :10].tolist() == TABLE[4:7].tolist()
    wide = torch.arange(1, 81, dtype=torch.int32).view(4, 20)
    too_long = make_common_attn_metadata([1] * 4, [300] * 4, wide, 16)  # 19 pages, 16 fit
    with pytest.raises(ValueError, match="needs more pages per request than max_model_len"):
        builder.build(0, too_long)


def test_graph_buffers_refuse_steps_past_them_before_writing():
    buffers = XqaGraphBuffers(2, 3, torch.device("cpu"), cpu_copy())
    table = torch.arange(1, 16, dtype=torch.int32).view(3, 5)
    lens = torch.tensor([9, 8, 7], dtype=torch.int32)
    for num_reqs, num_pages in ((3, 2), (2, 4), (-1, 2)):
        with pytest.raises(ValueError, match="larger than its graph's buffers"):
            buffers.fill(table, lens, num_reqs, num_pages)
    with pytest.raises(ValueError, match="seq_lens must be an int32 tensor"):
        buffers.fill(table, lens.long(), 2, 2)
    assert buffers.page_table.tolist() == [[0] * 3] * 2 and buffers.seq_lens.tolist() == [1, 1]


def test_a_replay_step_the_copy_cannot_read_is_refused_and_the_buffers_keep_the_last():
    builder = xqa_cpu_builder(capture_sizes=(4,))
    builder.build_for_cudagraph_capture(
        make_common_attn_metadata([1] * 4, [1, 2, 3, 4], TABLE[:4], 16)
    )
    buffers = builder._xqa_graph[4]
    before = (buffers.page_table.clone(), buffers.seq_lens.clone())
    step = make_common_attn_metadata([1] * 3, [40, 3, 150], TABLE[4:7], 16, num_padded_tokens=4)
    # the right lengths, strided: XQA reads them by raw pointer
    strided = torch.tensor([40, 0, 3, 0, 150, 0], dtype=torch.int32)[::2]
    step = dataclasses.replace(step, seq_lens=strided)
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        builder.build(0, step)
    assert torch.equal(buffers.page_table, before[0]) and torch.equal(buffers.seq_lens, before[1])


def test_persistent_graph_inputs_hand_xqa_the_steps_own_rows():
    """Under `has_persistent_graph_inputs` a graph step's XQA reads the step's table and lengths
    (the runner's fixed buffers) and nothing is copied; a step not padded to its captured
    size, or a table whose rows are a column slice, is refused with the reason."""
    builder = xqa_cpu_builder(capture_sizes=(4,), persistent=True)
    engine_table = TABLE[:4].clone()  # whole rows of a persistent table buffer
    for lens in ([1, 2, 3, 4], [40, 3, 150, 1], [5, 6, 7, 8]):
        cm = make_common_attn_metadata([1] * 4, lens, engine_table, 16)
        md = builder.build_for_cudagraph_capture(cm) if lens[0] == 1 else builder.build(0, cm)
        table, seq_lens = md.step.xqa
        assert table.data_ptr() == cm.block_table_tensor.data_ptr() and table.shape == (4, 10)
        assert seq_lens.data_ptr() == cm.seq_lens.data_ptr() and seq_lens.tolist() == lens
        key = next(iter(builder._layer_keys))
        assert md.step.planned[key].xqa and builder.planned(md, key).xqa
    assert not builder._xqa_graph  # no graph buffers made, no copy into them
    # an older step's metadata after a newer build: still its own tensors, nothing refilled
    older = builder.build(0, make_common_attn_metadata([1] * 4, [9, 9, 9, 9], engine_table, 16))
    builder.build(0, make_common_attn_metadata([1] * 4, [3, 3, 3, 3], engine_table, 16))
    assert builder.planned(older, key).xqa and older.step.xqa[1].tolist() == [9, 9, 9, 9]
    assert not builder._xqa_graph
    short = make_common_attn_metadata([1] * 3, [4, 5, 6], engine_table[:3], 16,
                                      num_padded_tokens=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"padded to its captured size \(got 3 requests"):
        builder.build(0, short)
    sliced = make_common_attn_metadata([1] * 4, [4, 5, 6, 7], engine_table[:, :5], 16)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        builder.build(0, sliced)


class RecordingWrapper:
    """Stands in for FlashInfer's CUDA-graph decode wrapper: records its plans."""

    is_cuda_graph_enabled = True

    def __init__(self):
        self.plans = []

    def plan(self, indptr, pages, last_page_len, *args, **kwargs):
        # (the kernels read the pages up to indptr[-1]; past it the list is scratch)
        num_pages = int(indptr[-1])
        self.plans.append((indptr.tolist(), pages[:num_pages].tolist(), last_page_len.tolist()))


def test_a_graph_captured_with_an_lse_keeps_planning_its_decode_wrapper(monkeypatch):
    # the LSE warm-up plans the graph's decode wrapper, so the captured graph runs it: every
    # later step of that size must plan it again, not only refill XQA's buffers
    builder = xqa_cpu_builder(capture_sizes=(4,))
    wrapper = RecordingWrapper()
    monkeypatch.setattr(builder, "_graph_decode", lambda key, size: wrapper)
    key = next(iter(builder._layer_keys))
    capture = make_common_attn_metadata([1] * 4, [1, 2, 3, 17], TABLE[:4, :10], 16)
    md = builder.build_for_cudagraph_capture(capture)
    assert md.step.planned[key].xqa and wrapper.plans == []
    assert builder.planned(md, key, decode_wrapper=True).decode is wrapper
    assert wrapper.plans == [([0, 1, 2, 3, 5], [1, 11, 21, 31, 32], [1, 2, 3, 1])]
    later = make_common_attn_metadata([1] * 4, [5, 6, 7, 40], TABLE[:4, :10], 16)
    md = builder.build(0, later)
    assert md.step.planned[key].decode is wrapper and len(wrapper.plans) == 2
    assert wrapper.plans[1] == ([0, 1, 2, 3, 6], [1, 11, 21, 31, 32, 33], [5, 6, 7, 8])


def test_forward_hands_xqa_the_decode_rows_and_the_steps_table(monkeypatch):
    calls = []
    monkeypatch.setattr(fi_backend, "run_xqa_decode", lambda *a, **k: calls.append((a, k)))
    builder = xqa_cpu_builder()
    cm = make_common_attn_metadata([1, 1, 1], [40, 3, 150], TABLE[:3, :10], 16)
    md = builder.build(0, cm)
    cache = allocate_kv_cache(FlashInferBackend, 81, 16, 2, 64, BF16)
    query = torch.randn(5, 4, 64, dtype=BF16)  # two padding rows past the step's tokens
    output = torch.zeros_like(query)
    one = torch.tensor(1.0)
    impl = FlashInferImpl(4, 64, 0.125, 2)
    impl.forward(KitLayer("layer.0", one, one), query, None, None, cache, md, output)
    ((args, kwargs),) = calls
    q, kv, table, lens = args
    assert q.shape == (3, 4, 64) and q.data_ptr() == query.data_ptr()
    assert kv is cache and (table, lens) == md.step.xqa
    assert kwargs["out"].shape == (3, 4, 64) and kwargs["out"].data_ptr() == output.data_ptr()
    assert (kwargs["scale"], kwargs["k_scale"], kwargs["v_scale"]) == (0.125, None, None)
    assert kwargs["window_left"] == -1 and kwargs["workspace"] is builder.xqa_workspace()


def test_auto_uses_xqa_only_where_some_layer_can():
    # 16-token blocks: the planned wrapper's arrays (no layer registered: FlashInfer would plan)
    builder = xqa_cpu_builder(kernel="auto", register=False)
    cm = make_common_attn_metadata([1, 1], [40, 3], TABLE[:2], 16)
    md = builder.build(0, cm)
    assert md.step.xqa is None and md.step.decode_layout is not None


def test_xqa_inputs_must_be_int32():
    builder = xqa_cpu_builder()
    cm = make_common_attn_metadata([1, 1], [40, 3], TABLE[:2], 16)
    # (the metadata refuses a table that is not int32 when it is made)
    cm = dataclasses.replace(cm, seq_lens=cm.seq_lens.long())
    with pytest.raises(ValueError, match="block_table_tensor and seq_lens must be int32"):
        builder.build(0, cm)


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


# Every decode-bearing feature FLASHINFER declares (soft cap: the wrapper runs its decodes).
XQA_FEATURES = (
    "decode", "mixed", "chunked", "odd_lengths", "gqa", "mqa", "head_sizes", "block_sizes",
    "layouts", "padding", "kv_sharing", "non_causal", "sliding_window", "soft_cap", "fp8", "lse",
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
    builder._layer_keys.setdefault(impl.plan_key, None)
    forward(impl, batch, builder.build(0, batch.common_attn_metadata))  # JIT, buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = builder.build(0, batch.common_attn_metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    planned = md.step.planned[impl.plan_key]
    assert planned.xqa and planned.wrappers() == [] and md.step.arrays.decode is None
    assert builder.fast_decode_plans == 0
    output, _ = forward(impl, batch, md)
    ref64, lse64, bound = oracle(batch)
    assert max_abs_error(output[: batch.num_actual_tokens], ref64) <= bound
    # an LSE request plans the decode wrapper for this step, in the forward
    output, lse = forward(impl, batch, md, with_lse=True)
    assert planned.decode is not None
    n = batch.num_actual_tokens
    assert max_abs_error(output[:n], ref64) <= bound
    assert torch.allclose(lse[:, :n].double(), lse64 / math.log(2.0), atol=2e-3, rtol=1e-4)


@needs_flashinfer_sm90
def test_soft_capped_layers_keep_the_wrapper_next_to_xqa_layers():
    batch, impl = written_batch(get_spec("many_decodes"), seed=3, block_size=64)
    capped = FlashInferImpl(HEADS, HEAD_SIZE, SCALE, KV_HEADS, logits_soft_cap=30.0)
    batch.builder._layer_keys.setdefault(impl.plan_key, None)
    batch.builder._layer_keys.setdefault(capped.plan_key, None)
    md = batch.builder.build(0, batch.common_attn_metadata)
    assert md.step.planned[impl.plan_key].xqa
    assert md.step.planned[capped.plan_key].decode is not None
    assert not md.step.planned[capped.plan_key].xqa
    output, _ = forward(impl, batch, md)
    ref64, _, bound = oracle(batch)
    assert max_abs_error(output[: batch.num_actual_tokens], ref64) <= bound


@needs_flashinfer_sm90
def test_stale_cudagraph_metadata_refills_the_graph_buffers():
    batch, impl = written_batch(get_spec("many_decodes"), seed=3, block_size=16)
    cm = batch.common_attn_metadata
    n = cm.num_reqs
    spec = batch.builder.kv_cache_spec
    limits = BatchLimits(n, 256, 2048, cudagraph_capture_sizes=(n,))
    builder = XqaBuilder(spec, {}, limits, "cuda")
    builder._layer_keys.setdefault(impl.plan_key, None)
    md = builder.build_for_cudagraph_capture(cm)
    other_table = torch.zeros_like(cm.block_table_tensor)
    other = make_common_attn_metadata([1] * n, [1] * n, other_table, spec.block_size, "cuda")
    builder.build(0, other)  # refills the buffers of size n with another batch
    output, _ = forward(impl, batch, md)
    ref64, _, bound = oracle(batch)
    assert max_abs_error(output[: batch.num_actual_tokens], ref64) <= bound
