"""FLASHINFER: declarations and selection (CPU, the library present or absent), the builder's
step split and CUDA-graph bookkeeping (CPU, no layer planned), and on the GPU with FlashInfer
0.7.2.post1: the conformance kit in bf16 and fp16 (fp8 caches included), CUDA-graph capture and
replay of decode batches, `build` under `torch.cuda.set_sync_debug_mode("error")`, plans of
stale metadata, and base-2 LSEs against the oracle's."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from flashinfer_gpu import (
    HEAD_SIZE,
    HEADS,
    KV_HEADS,
    SCALE,
    assert_matches_oracle,
    forward,
    needs_flashinfer,
    written_batch,
)

import anyattn.backends.flashinfer as fi_backend
from anyattn import registry
from anyattn.backends.flashinfer import (
    PIP_COMMAND,
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadataBuilder,
)
from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.selector import NoBackendError, explain, select_backend
from anyattn.testing import (
    KitLayer,
    attention_oracle,
    build_batch,
    check_backend,
    error_bound,
    get_spec,
    max_abs_error,
    plan_cases,
    read_kv,
)
from anyattn.types import AttentionCGSupport, AttentionType, DeviceInfo, KVCacheLayout

SM80, SM90, SM100 = (DeviceInfo.parse(s) for s in ("sm80", "sm90", "sm100"))


def config(**changes) -> AttentionSelectorConfig:
    return AttentionSelectorConfig(**{"head_size": 128, "dtype": torch.bfloat16, **changes})


@pytest.fixture
def installed(monkeypatch):
    """`installed(importable, version)`: what the availability check sees on this machine."""

    def install(importable: bool = True, version: str | None = fi_backend.FLASHINFER_VERSION):
        monkeypatch.setattr(fi_backend, "_installed_flashinfer", lambda: (importable, version))

    return install


@pytest.fixture
def others_unavailable(make_backend, register):
    """Fake FLASH_ATTN, TRITON and FLEX_ATTENTION that fit but are not installed here."""
    for name in ("FLASH_ATTN", "TRITON", "FLEX_ATTENTION"):
        register(name, make_backend(name, devices=("cuda",), unavailable=f"pip install {name}"))


# --- declarations ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [SM80, SM90, SM100], ids=str)
def test_plain_decoder_configs_fit(device):
    for head_size in (64, 128, 256):
        for dtype in (torch.float16, torch.bfloat16):
            for cache in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
                cfg = config(head_size=head_size, dtype=dtype, kv_cache_dtype=cache)
                assert FlashInferBackend.validate_configuration(cfg, device) == []
    features = config(has_sliding_window=True, has_logits_soft_cap=True, needs_lse=True)
    assert FlashInferBackend.validate_configuration(features, device) == []
    assert FlashInferBackend.validate_configuration(config(use_non_causal=True), device) == []


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"head_size": 96}, "head_size 96 not supported (supported: 64, 128, 256)"),
        ({"head_size": 80}, "head_size 80 not supported (supported: 64, 128, 256)"),
        ({"dtype": torch.float32}, "dtype float32 not supported (supported: float16, bfloat16)"),
        ({"block_size": 8}, "block_size 8 not supported (kernel block sizes: 16, 32, 64)"),
        ({"block_size": 24}, "block_size 24 not supported (kernel block sizes: 16, 32, 64)"),
        ({"attn_type": "encoder"}, "attn_type encoder not supported (supported: decoder)"),
        ({"attn_type": "encoder_only"}, "attn_type encoder_only not supported"),
        ({"attn_type": "encoder_decoder"}, "attn_type encoder_decoder not supported"),
        ({"has_alibi": True}, "ALiBi (has_alibi) not supported"),
        ({"has_sink": True}, "attention sinks (has_sink) not supported"),
        ({"use_mla": True}, "MLA (use_mla) not supported"),
        ({"use_sparse": True}, "sparse attention (use_sparse) not supported"),
        ({"use_batch_invariant": True}, "batch invariance (use_batch_invariant) not supported"),
        (
            {"kv_cache_dtype": "fp8", "use_per_head_quant_scales": True},
            "per-head quant scales (use_per_head_quant_scales) not supported",
        ),
        (
            {"kv_cache_dtype": "float16"},
            "kv_cache_dtype float16 with dtype bfloat16 not supported (FlashInfer's 16-bit "
            "kernels need the cache in the model dtype)",
        ),
        (
            {"has_sliding_window": True, "use_non_causal": True},
            "sliding window with non-causal or encoder attention not supported",
        ),
    ],
)
def test_what_flashinfer_cannot_serve_is_a_reason(changes, reason):
    reasons = FlashInferBackend.validate_configuration(config(**changes), SM90)
    assert any(r.startswith(reason) for r in reasons), reasons


def test_devices_and_compute_capability():
    assert FlashInferBackend.validate_configuration(config(), DeviceInfo.parse("sm75")) == [
        "compute capability sm75 not supported (needs sm80 or newer)"
    ]
    assert FlashInferBackend.validate_configuration(config(), DeviceInfo.cpu()) == [
        "device cpu not supported (supported: cuda)"
    ]


def test_kv_cache_shape_layouts_and_block_sizes():
    assert FlashInferBackend.get_kv_cache_shape(10, 16, 2, 128) == (10, 2, 16, 2, 128)
    assert FlashInferBackend.get_kv_cache_stride_order("NHD") == (0, 1, 2, 3, 4)
    assert FlashInferBackend.get_kv_cache_stride_order("HND") == (0, 1, 3, 2, 4)
    assert FlashInferBackend.supported_kv_cache_layouts() == (KVCacheLayout.NHD, KVCacheLayout.HND)
    with pytest.raises(ValueError, match="block_size not supported"):
        FlashInferBackend.get_kv_cache_shape(10, 8, 2, 128)
    # larger engine blocks are split into the largest kernel block that divides them
    assert [FlashInferBackend.get_kernel_block_size(b) for b in (16, 32, 48, 64, 128)] == [
        16, 32, 16, 64, 64,
    ]  # fmt: skip


def test_impl_and_builder_declarations():
    assert FlashInferImpl.lse_base_on_e is False
    assert FlashInferBackend.get_cudagraph_support() == (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    assert FlashInferBackend.forward_includes_kv_cache_update is False
    assert not FlashInferBackend.supports_cascade()
    described = FlashInferBackend.describe()
    assert described["features"]["lse"] and not described["features"]["sink"]


def test_impl_rejects_what_is_not_declared():
    with pytest.raises(NotImplementedError, match="ALiBi"):
        FlashInferImpl(4, 64, 0.125, 2, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])
    with pytest.raises(NotImplementedError, match="sinks"):
        FlashInferImpl(4, 64, 0.125, 2, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match="head_size not supported"):
        FlashInferImpl(4, 96, 0.125, 2)
    with pytest.raises(NotImplementedError, match=r"attn_type not supported \(got encoder,"):
        FlashInferImpl(4, 64, 0.125, 2, attn_type=AttentionType.ENCODER)
    impl = FlashInferImpl(4, 64, 0.125, 2, sliding_window=33, logits_soft_cap=30.0)
    assert (impl.num_kv_heads, impl.sliding_window, impl.logits_soft_cap) == (2, 33, 30.0)


# --- availability and selection -----------------------------------------------------------------


def test_unavailable_reason_carries_the_pip_command(installed):
    installed(importable=False, version=None)
    reason = FlashInferBackend.get_unavailable_reason()
    assert reason == f"flashinfer is not installed; {PIP_COMMAND}"
    assert "pip install 'anyattn[flashinfer]'" in reason
    installed(version="0.6.0")
    assert FlashInferBackend.get_unavailable_reason() == (
        f"flashinfer-python 0.6.0 is installed, FLASHINFER is written for 0.7.2.post1; "
        f"{PIP_COMMAND}"
    )
    installed()
    assert FlashInferBackend.get_unavailable_reason() is None
    installed(version=None)  # importable without package metadata
    assert FlashInferBackend.get_unavailable_reason() is None


def test_registered_under_its_name():
    assert registry.get_backend_class("FLASHINFER") is FlashInferBackend
    assert registry.AttentionBackendEnum.FLASHINFER.value == (
        "anyattn.backends.flashinfer:FlashInferBackend"
    )


@pytest.mark.parametrize("device", ["sm80", "sm90", "sm100"])
def test_selected_when_installed(installed, others_unavailable, device):
    installed()
    assert select_backend(config(), DeviceInfo.parse(device)) is FlashInferBackend
    verdict = next(v for v in explain(config(), device).verdicts if v.name == "FLASHINFER")
    assert verdict.fits and verdict.reasons == () and verdict.unavailable is None


@pytest.mark.parametrize("device", ["sm80", "sm90", "sm100"])
def test_not_selected_when_missing_and_the_reason_says_how_to_install(
    installed, others_unavailable, device
):
    installed(importable=False, version=None)
    result = explain(config(), device)
    verdict = next(v for v in result.verdicts if v.name == "FLASHINFER")
    assert verdict.reasons == ()  # the capabilities fit; only the package is missing
    assert PIP_COMMAND in verdict.unavailable
    assert result.chosen == "TORCH"
    with pytest.raises(NoBackendError, match=r"pip install 'anyattn\[flashinfer\]'"):
        select_backend(config(), device, backend="FLASHINFER")


def test_blackwell_prefers_flashinfer_over_flash_attn(installed, make_backend, register):
    installed()
    flash_attn_priority = {"cuda": 0, "blackwell": 1}  # FLASH_ATTN's own
    register(
        "FLASH_ATTN", make_backend("FLASH_ATTN", devices=("cuda",), priority=flash_attn_priority)
    )
    assert explain(config(), SM100).chosen == "FLASHINFER"
    assert explain(config(), SM90).chosen == "FLASH_ATTN"
    # a capability FlashInfer lacks moves the choice on, with the reason recorded
    result = explain(config(has_alibi=True), SM100)
    assert result.chosen != "FLASHINFER"
    verdict = next(v for v in result.verdicts if v.name == "FLASHINFER")
    assert verdict.reasons == ("ALiBi (has_alibi) not supported",)


# --- the builder on the CPU (no layer planned, so FlashInfer is not needed) -------------------


def cpu_builder(kv_cache_dtype="auto", capture_sizes=(), sliding_window=None):
    spec = AttentionSpec(16, 2, 64, torch.bfloat16, kv_cache_dtype, sliding_window)
    limits = BatchLimits(8, 512, 256, cudagraph_capture_sizes=capture_sizes)
    return FlashInferMetadataBuilder(spec, {}, limits, "cpu")


TABLE = torch.arange(1, 41, dtype=torch.int32).view(8, 5)


def test_build_splits_decodes_fresh_and_context_prefills():
    builder = cpu_builder()
    assert builder.reorder_batch_threshold == 1
    md = builder.build(0, make_common_attn_metadata([1, 1, 5, 17], [40, 3, 70, 17], TABLE[:4], 16))
    assert (md.num_decodes, md.num_decode_tokens, md.decode_rows) == (2, 2, 2)
    assert (md.paged_tokens, md.ragged_tokens) == ((2, 7), (7, 24))
    assert (md.window_left, md.cudagraph_size, md.causal) == (-1, None, True)
    layout = md.step.decode_layout
    assert (layout.indptr.tolist(), layout.last_page_len.tolist()) == ([0, 3, 4], [8, 3])
    assert layout.indices[:4].tolist() == [1, 2, 3, 6] and layout.max_seq_len == 40
    # (the host arrays for the decode wrapper's C++ planner: made by a plan that needs them)
    assert md.step.arrays.decode is None
    assert builder._decode_arrays(md.step).paged_kv_indptr.tolist() == [0, 3, 4]
    assert md.step.paged_pages.tolist() == [11, 12, 13, 14, 15]
    assert md.step.planned == {}


def test_build_fp8_sends_fresh_prefills_to_the_paged_wrapper():
    md = cpu_builder("fp8").build(0, make_common_attn_metadata([1, 17], [40, 17], TABLE[:2], 16))
    assert (md.ragged_tokens, md.paged_tokens) == ((1, 1), (1, 18))
    assert md.cache_dtype == torch.float8_e4m3fn


def test_build_rejects_cascade_cross_attention_and_narrow_tables():
    builder = cpu_builder()
    cm = make_common_attn_metadata([1, 1], [40, 33], TABLE[:2], 16)
    with pytest.raises(ValueError, match="cascade attention not supported"):
        builder.build(32, cm)
    cross = make_common_attn_metadata([1], [3], TABLE[:1], 16, encoder_seq_lens=[7])
    with pytest.raises(ValueError) as raised:
        builder.build(0, cross)
    message = str(raised.value)
    assert "cross attention not supported (got encoder_seq_lens, expected None;" in message
    assert "`anyattn explain --head-size N --attn-type encoder_decoder`" in message
    lens = torch.tensor([100, 33], dtype=torch.int32)  # more keys than the table holds
    cm = dataclasses.replace(
        cm, seq_lens=lens, seq_lens_cpu=lens, num_computed_tokens_cpu=lens - 1, max_seq_len=100
    )
    with pytest.raises(ValueError, match="block_table too narrow"):
        builder.build(0, cm)
    int64 = make_common_attn_metadata([1], [3], TABLE[:1], 16)
    with pytest.raises(ValueError, match=r"block_table_tensor must be int32 \(got torch.int64\)"):
        dataclasses.replace(int64, block_table_tensor=int64.block_table_tensor.long())


def test_cudagraph_capture_and_padded_replay_steps():
    builder = cpu_builder(capture_sizes=(4, 8))
    with pytest.raises(ValueError, match="single-token decodes only"):
        builder.build_for_cudagraph_capture(
            make_common_attn_metadata([1, 3], [5, 9], TABLE[:2], 16)
        )
    md = builder.build_for_cudagraph_capture(
        make_common_attn_metadata([1] * 4, [1, 2, 3, 4], TABLE[:4], 16)
    )
    assert (md.cudagraph_size, md.decode_rows) == (4, 4)
    # three decodes padded to the captured size replay it; unpadded steps run eagerly
    padded = make_common_attn_metadata([1] * 3, [9, 40, 2], TABLE[:3], 16, num_padded_tokens=4)
    md = builder.build(0, padded)
    assert (md.cudagraph_size, md.decode_rows, md.num_actual_tokens) == (4, 4, 3)
    layout = md.step.decode_layout
    assert layout.indptr.tolist() == [0, 1, 4, 5, 5]
    assert layout.last_page_len.tolist() == [9, 8, 2, 1]
    assert layout.indices[:5].tolist() == [1, 6, 7, 8, 11]
    assert builder._decode_arrays(md.step).paged_kv_indptr.tolist() == [0, 1, 4, 5, 5]
    eager = make_common_attn_metadata([1] * 3, [9, 40, 2], TABLE[:3], 16)
    assert builder.build(0, eager).cudagraph_size is None
    mixed = make_common_attn_metadata([1, 2], [9, 40], TABLE[:2], 16, num_padded_tokens=4)
    assert builder.build(0, mixed).cudagraph_size is None


def test_validate_inputs_checks_the_step_against_the_layer():
    md = cpu_builder(sliding_window=33).build(
        0, make_common_attn_metadata([1, 4], [9, 4], TABLE[:2], 16)
    )
    query = torch.zeros(5, 4, 64, dtype=torch.bfloat16)
    cache = allocate_kv_cache(FlashInferBackend, 41, 16, 2, 64, torch.bfloat16)
    impl = FlashInferImpl(4, 64, 0.125, 2, sliding_window=33)
    impl.validate_inputs(query, None, None, cache, md, torch.empty_like(query))
    with pytest.raises(ValueError, match="sliding_window differs"):
        FlashInferImpl(4, 64, 0.125, 2).validate_inputs(
            query, None, None, cache, md, torch.empty_like(query)
        )
    with pytest.raises(ValueError, match="query dtype differs"):
        impl.validate_inputs(query.half(), None, None, cache, md, torch.empty_like(query.half()))
    with pytest.raises(ValueError, match="kv_cache dtype"):
        impl.validate_inputs(query, None, None, cache.half(), md, torch.empty_like(query))
    with pytest.raises(ValueError, match="output_lse must be"):
        impl.validate_inputs(
            query, None, None, cache, md, torch.empty_like(query), torch.empty(4, 5).double()
        )
    strided = torch.empty(5, 64, 4, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError) as raised:
        impl.validate_inputs(query, None, None, cache, md, strided)
    got = f"(got strides (256, 1, 4) and {cache.stride()}, expected (256, 64, 1) and (..., 1))"
    assert got in str(raised.value)
    # FlashInfer's window bounds only the keys before a query: a non-causal step has no window
    non_causal = cpu_builder(sliding_window=33).build(
        0, make_common_attn_metadata([1, 4], [9, 4], TABLE[:2], 16, causal=False)
    )
    with pytest.raises(NotImplementedError, match="sliding window with non-causal"):
        impl.validate_inputs(query, None, None, cache, non_causal, torch.empty_like(query))


def test_per_head_fp8_scales_are_refused_before_the_cache_is_written():
    impl = FlashInferImpl(4, 64, 0.125, 2, kv_cache_dtype="fp8")
    cache = allocate_kv_cache(FlashInferBackend, 8, 16, 2, 64, torch.float8_e4m3fn)
    key = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    per_head = torch.ones(2)
    layer = KitLayer("layer.0", per_head, per_head)
    with pytest.raises(ValueError, match=r"layer.k_scale must be .* shape \[\] \(got \(2,\)\)"):
        impl.do_kv_cache_update(layer, key, key, cache, torch.tensor([0, 1, 17]))
    assert not cache.view(torch.uint8).any()
    one = torch.ones(())
    impl.do_kv_cache_update(
        KitLayer("layer.0", one, one), key, key, cache, torch.tensor([0, 1, 17])
    )
    assert cache.view(torch.uint8).any()


# --- GPU ---------------------------------------------------------------------------------------


DTYPES = [torch.bfloat16, torch.float16]
# Every feature FLASHINFER declares; the kit runs one pytest test per feature and dtype.
KIT_FEATURES = (
    "decode", "prefill", "mixed", "chunked", "odd_lengths", "gqa", "mqa", "head_sizes",
    "block_sizes", "layouts", "padding", "kv_sharing", "non_causal", "sliding_window",
    "soft_cap", "fp8", "lse",
)  # fmt: skip
NOT_DECLARED = {
    "encoder", "encoder_only", "encoder_decoder", "alibi", "sinks", "per_head_scales", "cascade",
}  # fmt: skip


@needs_flashinfer
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", KIT_FEATURES)
def test_conformance_kit(feature, dtype):
    report = check_backend(FlashInferBackend, "cuda", dtype, features=[feature])
    report.assert_passed()
    assert report.not_declared == [], report.summary()


@needs_flashinfer
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kit_covers_every_declared_feature(dtype):
    cases, not_declared = plan_cases(FlashInferBackend, "cuda", dtype)
    assert {c.feature for c in cases} == set(KIT_FEATURES)
    assert {line.split(":")[0] for line in not_declared} == NOT_DECLARED


@needs_flashinfer
def test_lse_is_base_2():
    batch, impl = written_batch(get_spec("mixed"), seed=7)
    md = batch.attn_metadata
    # every wrapper runs: decodes, fresh prefills (ragged), a prefill with context (paged)
    assert md.num_decodes and md.ragged_tokens[1] > md.ragged_tokens[0]
    assert md.paged_tokens[1] > md.paged_tokens[0]
    output, lse = forward(impl, batch, md, with_lse=True)
    lse64 = assert_matches_oracle(batch, output)
    n = batch.num_actual_tokens
    assert torch.allclose(lse[:, :n].double(), lse64 / math.log(2.0), atol=2e-3, rtol=1e-4)
    assert not torch.allclose(lse[:, :n].double(), lse64, atol=0.1)


@needs_flashinfer
def test_build_never_synchronises_with_the_device():
    batch, impl = written_batch(get_spec("mixed"), seed=7)
    forward(impl, batch, batch.attn_metadata)  # compiles kernels, makes wrappers, learns the layer
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = batch.builder.build(0, batch.common_attn_metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert impl.plan_key in md.step.planned  # planned in build, not in forward
    output, _ = forward(impl, batch, md)
    assert_matches_oracle(batch, output)


@needs_flashinfer
def test_stale_metadata_is_planned_again():
    batch, impl = written_batch(get_spec("chunked_prefill"), seed=7)
    batch.builder._layer_keys.setdefault(impl.plan_key, None)
    md = batch.builder.build(0, batch.common_attn_metadata)
    # a later build plans the same wrappers for another batch: md's plans are stale
    table = batch.block_table[:1]
    other = make_common_attn_metadata([1], [50], table, batch.block_size, device="cuda")
    batch.builder.build(0, other)
    output, _ = forward(impl, batch, md)
    assert_matches_oracle(batch, output)


@needs_flashinfer
@pytest.mark.parametrize("decode_kernel", ["wrapper", "xqa", "wrapper-unsplit"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cudagraph_decode_replay_matches_eager_and_the_oracle(layout, decode_kernel):
    # "xqa": the graphs run FlashInfer's XQA decode (no plan: the build copies the table and
    # lengths into the graph's buffers), checked against the eager planned wrapper too.
    # "wrapper-unsplit": the builder takes the split limit to be 8 requests, so that the size-8
    # graph is planned without splits and its replays keep that schedule (no C++ planner),
    # while the size-4 graph is planned with splits every step
    if decode_kernel == "xqa" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("XQA needs SM90+")
    unsplit = decode_kernel == "wrapper-unsplit"
    decode_kernel = decode_kernel.removesuffix("-unsplit")
    torch.manual_seed(0)
    block_size, size, width = 16, 8, 32
    dtype = torch.bfloat16
    spec = AttentionSpec(block_size, KV_HEADS, HEAD_SIZE, dtype)
    limits = BatchLimits(size, 256, block_size * width, cudagraph_capture_sizes=(4, size))
    builder = FlashInferMetadataBuilder(spec, {}, limits, "cuda")
    builder.decode_kernel = decode_kernel
    if unsplit:
        builder._num_sms = size * KV_HEADS // 2  # split limit 2 * SMs // KV heads = size
    impl = FlashInferImpl(HEADS, HEAD_SIZE, SCALE, KV_HEADS)
    builder._layer_keys.setdefault(impl.plan_key, None)
    num_blocks = size * width + 1
    cache = allocate_kv_cache(
        FlashInferBackend, num_blocks, block_size, KV_HEADS, HEAD_SIZE, dtype, layout=layout,
        device="cuda",
    )  # fmt: skip
    cache.normal_()
    one = torch.tensor(1.0, device="cuda")
    layer = KitLayer("layer.0", one, one)

    def decodes(seq_lens, padded=None, dummies=0):
        """Decodes over random blocks; `padded` pads the slot mapping, `dummies` appends
        requests of one token in the null block (the engine's graph padding)."""
        ids = (torch.randperm(num_blocks - 1) + 1).int()[: len(seq_lens) * width]
        table = torch.cat([ids.view(len(seq_lens), width), torch.zeros(dummies, width).int()])
        query_lens, all_seq_lens = [1] * len(table), seq_lens + [1] * dummies
        cm = make_common_attn_metadata(
            query_lens, all_seq_lens, table, block_size, "cuda", num_padded_tokens=padded
        )
        return cm, table[: len(seq_lens)]

    def capture(seq_lens):
        """A graph of one decode forward at `len(seq_lens)` requests, with its fixed query and
        output buffers."""
        query = torch.randn(len(seq_lens), HEADS, HEAD_SIZE, device="cuda", dtype=dtype)
        output = torch.zeros_like(query)
        md = builder.build_for_cudagraph_capture(decodes(seq_lens)[0])
        assert md.step.planned[impl.plan_key].xqa == (decode_kernel == "xqa")
        impl.forward(layer, query, None, None, cache, md, output)  # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            impl.forward(layer, query, None, None, cache, md, output)
        return graph, query, output

    # Each captured size has wrappers and index buffers of its own.
    graphs = {8: capture([1, 17, 100, 3, 64, 500, 16, 33]), 4: capture([9, 250, 31, 2])}
    eager_limits = BatchLimits(size, 256, block_size * width)
    eager_builder = FlashInferMetadataBuilder(spec, {}, eager_limits, "cuda")
    eager_builder.decode_kernel = "wrapper"
    steps = [
        ([37, 200, 5, 129, 64], {"padded": size}),
        ([300] * size, {}),
        ([1, 2, 3], {"padded": 4}),
        ([1, 2, 3], {"padded": size}),
        ([44, 480, 7, 16], {}),
        ([77, 18, 250], {"dummies": size - 3}),  # the engine's padding: dummy requests
    ]
    for seq_lens, padding in steps:
        n = len(seq_lens)
        cm, table = decodes(seq_lens, **padding)
        torch.cuda.set_sync_debug_mode("error")  # a replay step's build never waits
        try:
            md = builder.build(0, cm)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        replay_size = md.cudagraph_size
        assert replay_size == cm.slot_mapping.shape[0]  # the captured size of the padding
        if decode_kernel == "xqa":
            assert md.step.planned[impl.plan_key].wrappers() == []  # nothing planned
        graph, query, output = graphs[replay_size]
        query.copy_(torch.randn_like(query))
        graph.replay()
        key, value = read_kv(cache, table, seq_lens)
        args = (query[:n], key.double(), value.double(), [1] * n, seq_lens)
        ref64, _ = attention_oracle(*args, scale=SCALE)
        ref_lowp, _ = attention_oracle(*args, scale=SCALE, compute_dtype=dtype)
        assert max_abs_error(output[:n], ref64) <= error_bound(ref64, ref_lowp, dtype)
        # the same step run eagerly, by a builder without graphs
        eager_md = eager_builder.build(
            0, make_common_attn_metadata([1] * n, seq_lens, table, block_size, "cuda")
        )
        eager_out = torch.zeros(n, HEADS, HEAD_SIZE, device="cuda", dtype=dtype)
        impl.forward(layer, query[:n].clone(), None, None, cache, eager_md, eager_out)
        torch.testing.assert_close(output[:n], eager_out, atol=2e-2, rtol=2e-2)
    if unsplit:  # size 8: FlashInfer's plan() at the capture, every replay keeps it
        assert builder.kept_decode_schedules == 4


@needs_flashinfer
def test_fast_decode_replan_matches_flashinfers_plan():
    """Decode wrappers set up once by FlashInfer's plan() are re-planned by `replan_decode` for
    later batches: same outputs, bit for bit, as plan() gives, and the oracle's."""
    batch, impl = written_batch(get_spec("many_decodes"), seed=7)
    kv_lens = batch.kv_lens
    gen = torch.Generator().manual_seed(3)

    def step(builder, num_reqs):
        cm = make_common_attn_metadata(
            [1] * num_reqs, kv_lens[:num_reqs], batch.block_table[:num_reqs], batch.block_size,
            device="cuda",
        )  # fmt: skip
        md = builder.build(0, cm)
        output = torch.full_like(batch.query, math.nan)
        layer = KitLayer("layer.0", batch.k_scale, batch.v_scale)
        impl.forward(layer, batch.query[:num_reqs], None, None, batch.kv_cache, md,
                     output[:num_reqs])  # fmt: skip
        return output[:num_reqs]

    spec = AttentionSpec(batch.block_size, KV_HEADS, HEAD_SIZE, torch.bfloat16)
    limits = BatchLimits(16, 256, 1024)
    fast = FlashInferMetadataBuilder(spec, {}, limits, "cuda")
    slow = FlashInferMetadataBuilder(spec, {}, limits, "cuda")
    slow.fast_decode_plan = False
    for builder in (fast, slow):
        builder._layer_keys.setdefault(impl.plan_key, None)
    sizes = [len(kv_lens)] + [
        int(n) for n in torch.randint(1, len(kv_lens) + 1, (4,), generator=gen)
    ]
    for num_reqs in sizes:
        got, want = step(fast, num_reqs), step(slow, num_reqs)
        assert torch.equal(got, want), num_reqs
        lengths = ([1] * num_reqs, list(kv_lens[:num_reqs]))
        keys = sum(kv_lens[:num_reqs])
        args = (batch.query[:num_reqs], batch.oracle_key[:keys], batch.oracle_value[:keys])
        ref64, _ = attention_oracle(*args, *lengths, scale=SCALE, causal=True)
        ref_lowp, _ = attention_oracle(
            *args, *lengths, scale=SCALE, causal=True, compute_dtype=torch.bfloat16
        )
        assert max_abs_error(got, ref64) <= error_bound(ref64, ref_lowp, torch.bfloat16)
    assert fast.fast_decode_plans == len(sizes) - 1 and slow.fast_decode_plans == 0


def test_fast_replan_only_for_the_wrappers_and_version_it_reproduces():
    from types import SimpleNamespace

    from anyattn.backends.flashinfer_replan import REPLAN_VERSION, can_replan

    planned = dict(use_tensor_cores=True, _backend="fa2", _uses_cudnn=False, _jit_module=None,
                   _cached_module=object(), _plan_info=[0], _q_len_per_req=1)  # fmt: skip
    assert REPLAN_VERSION == fi_backend.FLASHINFER_VERSION
    assert can_replan(SimpleNamespace(**planned), REPLAN_VERSION)
    assert not can_replan(SimpleNamespace(**planned), "0.7.3")
    for name, value in [("use_tensor_cores", False), ("_backend", "fa3"), ("_uses_cudnn", True),
                        ("_plan_info", None), ("_q_len_per_req", 2)]:  # fmt: skip
        assert not can_replan(SimpleNamespace(**{**planned, name: value}), REPLAN_VERSION), name
    assert not can_replan(SimpleNamespace(use_tensor_cores=True), REPLAN_VERSION)


@needs_flashinfer
def test_kept_decode_schedules_match_flashinfers_plan(monkeypatch):
    """Eager decode steps of one batch size at or past FlashInfer's split limit (2 * SMs / KV
    heads: 33 on the H200 with 8 KV heads) keep the schedule of the first plan, with no C++
    planner: the outputs equal those of a builder that has FlashInfer's `plan()` plan every
    step, bit for bit, and meet the oracle, also when the longest request grows past the
    lengths the schedule was made for."""
    from anyattn.testing.batch_spec import BatchSpec

    monkeypatch.setattr(FlashInferMetadataBuilder, "decode_kernel", "wrapper")
    heads, kv_heads = 16, 8
    limit = 2 * torch.cuda.get_device_properties(0).multi_processor_count // kv_heads
    num_reqs = max(40, limit)
    full = [64 + (61 * i) % 1500 for i in range(num_reqs)]  # keys the cache holds per request
    spec = BatchSpec("many_long_decodes", (1,) * num_reqs, tuple(full))
    batch = build_batch(
        FlashInferBackend, spec, num_heads=heads, num_kv_heads=kv_heads, head_size=HEAD_SIZE,
        dtype=torch.bfloat16, device="cuda", seed=5,
    )  # fmt: skip
    impl = FlashInferImpl(heads, HEAD_SIZE, SCALE, kv_heads)
    layer = KitLayer("layer.0", batch.k_scale, batch.v_scale)
    slots = batch.common_attn_metadata.slot_mapping
    impl.do_kv_cache_update(layer, batch.key, batch.value, batch.kv_cache, slots)
    full = list(batch.kv_lens)  # (decodes only: the kit kept the spec's order)
    offsets = np.concatenate([[0], np.cumsum(full)])
    limits = BatchLimits(num_reqs, 4096, 2048)
    spec = batch.builder.kv_cache_spec
    kept = FlashInferMetadataBuilder(spec, {}, limits, "cuda")
    planned = FlashInferMetadataBuilder(spec, {}, limits, "cuda")
    planned.fast_decode_plan = False
    steps = [
        [n // 2 for n in full],
        [n // 2 + 17 for n in full],  # every request a page or two longer
        [max(1, n // 3) for n in full[:-1]] + [full[-1]],  # the longest far past the others
        full,
    ]
    for seq_lens in steps:
        outputs = []
        for builder in (kept, planned):
            builder._layer_keys.setdefault(impl.plan_key, None)
            cm = make_common_attn_metadata([1] * num_reqs, seq_lens, batch.block_table,
                                           batch.block_size, device="cuda")  # fmt: skip
            output = torch.full_like(batch.query, math.nan)
            impl.forward(layer, batch.query, None, None, batch.kv_cache, builder.build(0, cm),
                         output)  # fmt: skip
            outputs.append(output)
        assert torch.equal(outputs[0], outputs[1]), seq_lens
        starts = offsets[: len(seq_lens)]
        rows = np.concatenate([np.arange(o, o + n) for o, n in zip(starts, seq_lens, strict=True)])
        args = (batch.query, batch.oracle_key[rows], batch.oracle_value[rows], [1] * num_reqs,
                seq_lens)  # fmt: skip
        ref64, _ = attention_oracle(*args, scale=SCALE)
        ref_lowp, _ = attention_oracle(*args, scale=SCALE, compute_dtype=torch.bfloat16)
        assert max_abs_error(outputs[0], ref64) <= error_bound(ref64, ref_lowp, torch.bfloat16)
    # plan() sets the wrapper up and makes the schedule, the other steps keep it
    assert kept.kept_decode_schedules == len(steps) - 1 and planned.kept_decode_schedules == 0


@needs_flashinfer
def test_eager_decode_batches_past_max_num_reqs_use_flashinfers_plan():
    """The re-plan's query offsets cover max_num_reqs requests; a larger eager decode batch is
    planned by FlashInfer's `plan()` every time, with the right result."""
    batch, impl = written_batch(get_spec("many_decodes"), seed=7)
    kv_lens, num_reqs = batch.kv_lens, len(batch.kv_lens)
    spec = AttentionSpec(batch.block_size, KV_HEADS, HEAD_SIZE, torch.bfloat16)
    builder = FlashInferMetadataBuilder(spec, {}, BatchLimits(4, 256, 1024), "cuda")
    builder._layer_keys.setdefault(impl.plan_key, None)
    cm = make_common_attn_metadata(
        [1] * num_reqs, kv_lens, batch.block_table[:num_reqs], batch.block_size, device="cuda"
    )
    for _ in range(2):
        md = builder.build(0, cm)
        output, _ = forward(impl, batch, md)
        assert_matches_oracle(batch, output)
    assert builder.fast_decode_plans == 0


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_replan_decode_sets_what_run_reads(cuda_graph):
    # (a CUDA-graph wrapper here also asks for no splits: the planner's disable_split_kv)
    """`replan_decode` on a stand-in wrapper (CPU): the index buffers `run()` reads and the C++
    planner's arguments, as FlashInfer 0.7.2.post1's `plan()` sets them for 3 decodes."""
    from types import SimpleNamespace

    from anyattn.backends.flashinfer_layouts import DecodeLayout
    from anyattn.backends.flashinfer_plan import plan_step
    from anyattn.backends.flashinfer_replan import replan_decode

    calls = []
    int32 = dict(dtype=torch.int32)
    wrapper = SimpleNamespace(
        device=torch.device("cpu"), is_cuda_graph_enabled=cuda_graph, _fixed_batch_size=3,
        _paged_kv_indptr_buf=torch.zeros(4, **int32),
        _paged_kv_last_page_len_buf=torch.zeros(3, **int32),
        _paged_kv_indices_buf=torch.zeros(16, **int32), _qo_indptr_buf=None,
        _float_workspace_buffer="float", _int_workspace_buffer="int",
        _pin_memory_int_workspace_buffer="pinned",
        _cached_module=SimpleNamespace(plan=lambda *args: calls.append(args) or "info"),
    )  # fmt: skip
    arrays = plan_step(np.array([0, 1, 2, 3]), np.array([5, 16, 17]), 16, 4).decode
    pages = torch.tensor([7, 8, 9, 10], **int32)
    arange = torch.arange(4, **int32)
    layer = dict(num_qo_heads=8, num_kv_heads=2, head_size=128, page_size=16, window_left=-1)
    layout = DecodeLayout(
        torch.tensor([0, 1, 2, 4], **int32), torch.tensor([5, 16, 1], **int32), pages, 17
    )
    replan_decode(wrapper, layout, arrays, **layer, qo_indptr_host=arange,
                  qo_indptr_device=arange, disable_split_kv=cuda_graph)  # fmt: skip
    assert wrapper._paged_kv_indptr_buf.tolist() == [0, 1, 2, 4]
    assert wrapper._paged_kv_last_page_len_buf.tolist() == [5, 16, 1]
    assert wrapper._paged_kv_indices_buf[:4].tolist() == [7, 8, 9, 10]
    if not cuda_graph:
        assert wrapper._qo_indptr_buf.tolist() == [0, 1, 2, 3]
    (args,) = calls
    assert args[:3] == ("float", "int", "pinned")
    assert [a.tolist() for a in args[3:6]] == [[0, 1, 2, 3], [0, 1, 2, 4], [5, 16, 17]]
    assert args[6:] == (3, 3, 8, 2, 16, cuda_graph, 128, 128, False, -1, -1, cuda_graph, 0, 0)
    assert (wrapper._plan_info, wrapper._batch_size, wrapper._max_kv_len) == ("info", 3, 17)


def test_replan_decode_can_keep_the_last_schedule():
    """`run_planner=False` (CPU stand-in wrapper): the index buffers change, FlashInfer's C++
    planner is not called, and only a wrapper planned for the same batch size may keep it."""
    from types import SimpleNamespace

    from anyattn.backends.flashinfer_layouts import DecodeLayout
    from anyattn.backends.flashinfer_plan import plan_step
    from anyattn.backends.flashinfer_replan import replan_decode

    calls = []
    wrapper = SimpleNamespace(
        device=torch.device("cpu"), is_cuda_graph_enabled=False, _qo_indptr_buf=None,
        _float_workspace_buffer="float", _int_workspace_buffer="int",
        _pin_memory_int_workspace_buffer=None,
        _cached_module=SimpleNamespace(plan=lambda *args: calls.append(args) or "info"),
    )  # fmt: skip
    int32 = dict(dtype=torch.int32)
    arange = torch.arange(4, **int32)
    layer = dict(num_qo_heads=8, num_kv_heads=2, head_size=128, page_size=16, window_left=-1)

    def replan(seq_lens, pages, run_planner=True):
        arrays = plan_step(np.array([0, 1, 2, 3]), np.array(seq_lens), 16, 4).decode
        indptr, last = (
            torch.from_numpy(a) for a in (arrays.paged_kv_indptr, arrays.paged_kv_last_page_len)
        )
        layout = DecodeLayout(indptr, last, torch.tensor(pages, **int32), max(seq_lens))
        replan_decode(wrapper, layout, arrays if run_planner else None, **layer,
                      qo_indptr_host=arange, qo_indptr_device=arange,
                      run_planner=run_planner)  # fmt: skip

    wrapper._pin_memory_int_workspace_buffer = "pinned"
    replan([5, 16, 17], [7, 8, 9, 10])
    wrapper._plan_info, wrapper._pin_memory_int_workspace_buffer = "kept", None
    replan([6, 17, 40], [7, 8, 11, 9, 10, 12], run_planner=False)
    assert len(calls) == 1 and wrapper._plan_info == "kept"
    assert wrapper._paged_kv_indptr_buf.tolist() == [0, 1, 3, 6]
    assert wrapper._paged_kv_last_page_len_buf.tolist() == [6, 1, 8]
    assert wrapper._paged_kv_indices_buf.tolist() == [7, 8, 11, 9, 10, 12]
    assert (wrapper._batch_size, wrapper._max_kv_len) == (3, 40)
    wrapper._batch_size = 2
    match = r"same batch size .*got 3 requests for a wrapper last planned for 2"
    with pytest.raises(ValueError, match=match):
        replan([6, 17, 40], [7, 8, 11, 9, 10, 12], run_planner=False)
    wrapper._batch_size = 3
    layout = DecodeLayout(arange, arange[:3], arange, 40)
    with pytest.raises(ValueError, match=r"the C\+\+ planner needs the batch's host arrays"):
        replan_decode(wrapper, layout, None, **layer, qo_indptr_host=arange,
                      qo_indptr_device=arange)  # fmt: skip


def _flashinfer_splits(page_counts, num_kv_heads, num_sms, page_size=16):
    """Reference: whether FlashInfer 0.7.2.post1's fa2 planner splits an eager batch of
    single-token decodes with these page counts (its `PrefillBinarySearchKVChunkSize`, as its
    `scheduler.cuh` has it: one query tile per request, no window)."""
    limit = 2 * num_sms // num_kv_heads
    longest = max(max(page_counts), 1)
    low, high = max(128 // page_size, 1), longest
    while low < high:
        mid = (low + high) // 2
        units = sum(-(-max(n, 1) // mid) for n in page_counts)
        low, high = (mid + 1, high) if units > limit else (low, mid)
    return low < longest


def test_fixed_schedule_is_exactly_where_flashinfers_planner_never_splits():
    from anyattn.backends.flashinfer_replan import schedule_is_fixed

    gen = np.random.default_rng(0)
    for num_sms, num_kv_heads in [(132, 8), (132, 2), (132, 1), (108, 4), (4, 2)]:
        limit = 2 * num_sms // num_kv_heads
        for num_reqs in sorted({1, limit - 1, limit, limit + 1, 2 * limit} - {0}):
            fixed = schedule_is_fixed(num_reqs, num_kv_heads, num_sms)
            assert fixed == (num_reqs >= limit), (num_sms, num_kv_heads, num_reqs)
            for _ in range(20):
                counts = gen.integers(0, 4000, num_reqs).tolist()
                if fixed:
                    assert not _flashinfer_splits(counts, num_kv_heads, num_sms)
            if not fixed:  # one long request among short ones: the planner splits it
                assert _flashinfer_splits([1] * (num_reqs - 1) + [4000], num_kv_heads, num_sms)
