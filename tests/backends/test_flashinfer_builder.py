"""FLASHINFER's builder and forward on the CPU, over a stand-in for FlashInfer's public API that
computes what FlashInfer documents (`flashinfer_fake`): the conformance kit against the float64
oracle (so every `plan()` argument means what FlashInfer says it means), one plan per distinct
layer record, nothing planned in `forward`, frozen metadata, refused layers and stale metadata,
CUDA-graph capture and padded replay, and which decodes XQA serves."""

from __future__ import annotations

import dataclasses
import math

import flashinfer_fake as fake
import pytest
import torch

from anyattn.backends import flashinfer_builder, flashinfer_version
from anyattn.backends.flashinfer import FlashInferBackend, FlashInferImpl
from anyattn.backends.flashinfer_builder import FlashInferMetadataBuilder
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing import KitLayer, attention_oracle, check_backend, read_kv, run_case
from anyattn.testing.sweep import declaration_cases
from anyattn.types import AttentionType

HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 64
TABLE = torch.arange(1, 41, dtype=torch.int32).view(8, 5)


class CpuFlashInfer(FlashInferBackend):
    """FLASHINFER's declarations, runnable on the CPU over the stand-in."""

    supported_device_types = ("cuda", "cpu")


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    fake.install(monkeypatch)
    yield
    flashinfer_version.import_flashinfer.cache_clear()


def impl(**changes) -> FlashInferImpl:
    return FlashInferImpl(**{"num_heads": HEADS, "head_size": HEAD_SIZE, "scale": 0.125,
                             "num_kv_heads": KV_HEADS, **changes})  # fmt: skip


def make_builder(layers=None, capture_sizes=(), block_size=16, kv_cache_dtype="auto"):
    layers = layers or {"layer.0": impl().layer_params()}
    spec = AttentionSpec(block_size, KV_HEADS, HEAD_SIZE, torch.bfloat16, kv_cache_dtype)
    limits = BatchLimits(8, 512, 256, cudagraph_capture_sizes=capture_sizes)
    return FlashInferMetadataBuilder(spec, layers, limits, "cpu")


def cache(block_size=16, dtype=torch.bfloat16):
    kv = allocate_kv_cache(FlashInferBackend, 41, block_size, KV_HEADS, HEAD_SIZE, dtype)
    return kv.copy_(torch.randn(kv.shape).to(dtype))


def run(the_impl, md, kv, name="layer.0", with_lse=False, rows=None):
    rows = rows or max(md.num_actual_tokens, md.decode_rows)
    query = torch.randn(rows, HEADS, HEAD_SIZE).bfloat16()
    output = torch.full_like(query, math.nan)
    lse = torch.full((HEADS, rows), math.nan) if with_lse else None
    one = torch.ones(())
    the_impl.forward(KitLayer(name, one, one), query, None, None, kv, md, output, lse)
    return query, output, lse


def oracle_of(query, kv, table, query_lens, seq_lens, scale=0.125, **kwargs):
    key, value = read_kv(kv, table, seq_lens)
    return attention_oracle(query.double(), key.double(), value.double(), query_lens, seq_lens,
                            scale=scale, **kwargs)  # fmt: skip


FEATURES = ("decode", "prefill", "mixed", "chunked", "odd_lengths", "gqa", "mqa", "head_sizes",
            "block_sizes", "layouts", "padding", "kv_sharing", "non_causal", "sliding_window",
            "soft_cap", "fp8", "lse")  # fmt: skip


@pytest.mark.parametrize("feature", FEATURES)
def test_conformance_kit_over_the_stand_in(feature):
    report = check_backend(CpuFlashInfer, "cpu", torch.float16, features=[feature], quick=True)
    report.assert_passed()


def test_every_declared_value_over_the_stand_in():
    cases, _ = declaration_cases(CpuFlashInfer, "cpu")
    assert len(cases) > 10
    failures = []
    for sweep_case in cases:
        results = run_case(CpuFlashInfer, sweep_case.case, "cpu", sweep_case.dtype)
        failures += [f"{sweep_case.id}: {r.detail}" for r in results if not r.passed]
    assert failures == []


def test_one_plan_per_distinct_record_and_forward_never_plans():
    plain, capped = impl(), impl(logits_soft_cap=30.0, sliding_window=9)
    layers = {"a": plain.layer_params(), "b": plain.layer_params(), "c": capped.layer_params()}
    builder = make_builder(layers)
    cm = make_common_attn_metadata([1, 1, 5, 4], [40, 3, 20, 4], TABLE[:4], 16)
    md = builder.build(0, cm)
    assert [kind for kind, _ in fake.plans] == ["decode", "paged", "ragged"] * 2
    assert (md.paged_tokens, md.ragged_tokens) == ((2, 7), (7, 11))
    assert md.plans["a"] is md.plans["b"] and md.plans["c"] is not md.plans["a"]
    assert md.layer_names == frozenset("abc")
    (_, decode), (_, prefill), (_, ragged) = fake.plans[3:]
    assert (decode["soft_cap"], decode["window_left"], decode["scale"]) == (30.0, 8, 0.125)
    assert decode["heads"] == (HEADS, KV_HEADS, HEAD_SIZE) and prefill["causal"] is True
    assert ragged["qo_indptr"].tolist() == ragged["kv_indptr"].tolist() == [0, 4]
    assert decode["dtypes"] == (torch.bfloat16,) * 3
    kv = cache()
    plans_made = len(fake.plans)
    for name, the_impl in (("a", plain), ("b", plain), ("c", capped)):
        query, output, _ = run(the_impl, md, kv, name)
        cap = the_impl.logits_soft_cap
        window = the_impl.sliding_window
        ref, _ = oracle_of(query, kv, TABLE[:4], [1, 1, 5, 4], [40, 3, 20, 4],
                           logits_soft_cap=cap, sliding_window=window)  # fmt: skip
        torch.testing.assert_close(output.double(), ref, atol=1e-2, rtol=1e-2)
    assert len(fake.plans) == plans_made  # forward only runs
    assert fake.runs == ["decode", "paged", "ragged"] * 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.num_decodes = 0


def test_a_layer_the_builder_was_not_given_is_refused():
    md = make_builder().build(0, make_common_attn_metadata([1], [9], TABLE[:1], 16))
    with pytest.raises(ValueError, match=r"layer\.7") as raised:
        run(impl(), md, cache(), name="layer.7")
    assert "layer.0" in str(raised.value)
    with pytest.raises(ValueError, match="differs from the record"):
        run(impl(scale=0.5), md, cache())


def test_stale_metadata_is_refused_not_run_on_another_plan():
    builder = make_builder()
    old = builder.build(0, make_common_attn_metadata([1, 3], [9, 20], TABLE[:2], 16))
    new = builder.build(0, make_common_attn_metadata([1], [30], TABLE[:1], 16))
    with pytest.raises(RuntimeError, match="stale"):
        run(impl(), old, cache())
    run(impl(), new, cache())


def test_build_refuses_cascade_and_cross_attention():
    builder = make_builder()
    cm = make_common_attn_metadata([1, 1], [40, 33], TABLE[:2], 16)
    with pytest.raises(ValueError, match="cascade attention not supported"):
        builder.build(32, cm)
    cross = make_common_attn_metadata([1], [3], TABLE[:1], 16, encoder_seq_lens=[7])
    with pytest.raises(ValueError) as raised:
        builder.build(0, cross)
    message = str(raised.value)
    assert "cross attention not supported (got encoder_seq_lens, expected None;" in message
    assert "`anyattn explain --head-size N --attn-type encoder_decoder`" in message
    narrow = make_common_attn_metadata([1, 1], [100, 33], TABLE[:2, :7].repeat(1, 2), 16)
    narrow = dataclasses.replace(narrow, block_table_tensor=TABLE[:2], block_table_cpu=TABLE[:2])
    with pytest.raises(ValueError, match=r"block_table too narrow .* \(got 5 columns, expected"):
        builder.build(0, narrow)
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        make_builder({"x": impl(num_kv_heads=4).layer_params()})
    encoder = dataclasses.replace(impl().layer_params(), attn_type=AttentionType.ENCODER)
    with pytest.raises(ValueError, match="layer 'x' is encoder attention; FLASHINFER serves"):
        make_builder({"x": encoder})


def test_validate_inputs_checks_the_step_against_the_layer():
    md = make_builder().build(0, make_common_attn_metadata([1, 4], [9, 4], TABLE[:2], 16))
    query = torch.zeros(5, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    kv = allocate_kv_cache(FlashInferBackend, 41, 16, KV_HEADS, HEAD_SIZE, torch.bfloat16)
    the_impl = impl()
    the_impl.validate_inputs(query, None, None, kv, md, torch.empty_like(query))
    with pytest.raises(ValueError, match="query dtype differs"):
        the_impl.validate_inputs(query.half(), None, None, kv, md, torch.empty_like(query.half()))
    with pytest.raises(ValueError, match="kv_cache dtype"):
        the_impl.validate_inputs(query, None, None, kv.half(), md, torch.empty_like(query))
    with pytest.raises(ValueError, match="output_lse must be"):
        the_impl.validate_inputs(
            query, None, None, kv, md, torch.empty_like(query), torch.empty(4, 5).double()
        )
    with pytest.raises(ValueError, match="another KV-cache spec"):
        impl(num_kv_heads=4).validate_inputs(query, None, None, kv, md, torch.empty_like(query))
    strided = torch.empty(5, HEAD_SIZE, HEADS, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError) as raised:
        the_impl.validate_inputs(query, None, None, kv, md, strided)
    got = f"(got strides (256, 1, 4) and {kv.stride()}, expected (256, 64, 1) and (..., 1))"
    assert got in str(raised.value)
    # FlashInfer's window bounds only the keys before a query: a non-causal step has no window
    windowed = impl(sliding_window=33)
    non_causal = make_builder({"layer.0": windowed.layer_params()}).build(
        0, make_common_attn_metadata([1, 4], [9, 4], TABLE[:2], 16, causal=False)
    )
    with pytest.raises(NotImplementedError, match="sliding window with non-causal"):
        windowed.validate_inputs(query, None, None, kv, non_causal, torch.empty_like(query))


def test_cudagraph_capture_and_padded_replay_steps():
    builder = make_builder(capture_sizes=(4, 8))
    with pytest.raises(ValueError, match="single-token decodes only"):
        builder.build_for_cudagraph_capture(
            make_common_attn_metadata([1, 3], [5, 9], TABLE[:2], 16)
        )
    md = builder.build_for_cudagraph_capture(
        make_common_attn_metadata([1] * 4, [1, 2, 3, 4], TABLE[:4], 16)
    )
    assert (md.cudagraph_size, md.decode_rows) == (4, 4)
    graph_wrapper = md.plans["layer.0"].decode
    assert graph_wrapper.use_cuda_graph and graph_wrapper.fixed == (4, 4 * 16)
    # three decodes padded to the captured size replay it, in the same wrapper
    padded = make_common_attn_metadata([1] * 3, [9, 40, 2], TABLE[:3], 16, num_padded_tokens=4)
    md = builder.build(0, padded)
    assert (md.cudagraph_size, md.decode_rows, md.num_actual_tokens) == (4, 4, 3)
    assert md.plans["layer.0"].decode is graph_wrapper
    assert fake.plans[-1][1]["indptr"].tolist() == [0, 1, 4, 5, 5]
    kv = cache()
    query, output, _ = run(impl(), md, kv)
    ref, _ = oracle_of(query[:3], kv, TABLE[:3], [1] * 3, [9, 40, 2])
    torch.testing.assert_close(output[:3].double(), ref, atol=1e-2, rtol=1e-2)
    assert not output[3].isnan().any()  # the padding row is run (and written) too
    eager = make_common_attn_metadata([1] * 3, [9, 40, 2], TABLE[:3], 16)
    assert builder.build(0, eager).cudagraph_size is None
    mixed = make_common_attn_metadata([1, 2], [9, 40], TABLE[:2], 16, num_padded_tokens=4)
    assert builder.build(0, mixed).cudagraph_size is None


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(flashinfer_builder, "device_capability", lambda device: (9, 0))


def test_xqa_runs_large_block_decodes_with_no_plan(hopper):
    capped = impl(logits_soft_cap=30.0)
    layers = {"plain": impl().layer_params(), "capped": capped.layer_params()}
    builder = make_builder(layers, block_size=64)
    assert builder.xqa_reason(layers["plain"]) is None
    assert builder.xqa_reason(layers["capped"]) == "XQA has no soft cap"
    table = TABLE[:3, :2]
    md = builder.build(0, make_common_attn_metadata([1] * 3, [9, 100, 64], table, 64))
    assert [kind for kind, _ in fake.plans] == ["decode"]  # the soft-capped layer's only
    assert md.plans["plain"].xqa is not None and md.plans["plain"].decode is None
    kv = cache(64)
    query, output, _ = run(impl(), md, kv, "plain")
    ref, _ = oracle_of(query, kv, table, [1] * 3, [9, 100, 64])
    torch.testing.assert_close(output.double(), ref, atol=1e-2, rtol=1e-2)
    assert fake.runs == ["xqa"]
    with pytest.raises(ValueError, match="XQA runs this step's decodes and returns no LSE"):
        run(impl(), md, kv, "plain", with_lse=True)
    run(capped, md, kv, "capped", with_lse=True)  # the wrapper gives LSEs


def test_xqa_cudagraph_steps_copy_into_the_sizes_buffers(hopper):
    builder = make_builder(capture_sizes=(4,), block_size=64)
    table = TABLE[:4, :2]
    md = builder.build_for_cudagraph_capture(
        make_common_attn_metadata([1] * 4, [1, 2, 3, 4], table, 64)
    )
    page_table, seq_lens, _ = md.plans["layer.0"].xqa
    padded = make_common_attn_metadata([1] * 2, [70, 5], table[:2], 64, num_padded_tokens=4)
    md = builder.build(0, padded)
    assert md.plans["layer.0"].xqa[0] is page_table  # the captured addresses
    assert seq_lens.tolist() == [70, 5, 1, 1]  # padding rows read one key
    assert page_table[:2, :2].tolist() == table[:2].tolist()
    kv = cache(64)
    query, output, _ = run(impl(), md, kv)
    ref, _ = oracle_of(query[:2], kv, table[:2], [1] * 2, [70, 5])
    torch.testing.assert_close(output[:2].double(), ref, atol=1e-2, rtol=1e-2)


def test_decode_kernel_wrapper_never_uses_xqa(hopper, monkeypatch):
    monkeypatch.setattr(FlashInferMetadataBuilder, "decode_kernel", "wrapper")
    builder = make_builder(block_size=64)
    assert builder.xqa_reason(impl().layer_params()) == "decode_kernel is 'wrapper'"
    monkeypatch.setattr(FlashInferMetadataBuilder, "decode_kernel", "fast")
    with pytest.raises(ValueError, match="decode_kernel not supported"):
        make_builder(block_size=64)
