"""FLASHINFER: declarations and selection (CPU, the library present or absent), and on the GPU
with a supported FlashInfer: the conformance kit in bf16 and fp16 (fp8 caches included), base-2
LSEs against the oracle's, `build` under `torch.cuda.set_sync_debug_mode("error")`, CUDA-graph
capture and replay of decode batches against eager runs and the oracle, and a build made ahead
of the device leaving the running step's schedule alone. (The builder over a CPU stand-in for
FlashInfer: test_flashinfer_builder.py; the version policy: test_flashinfer_version.py.)"""

from __future__ import annotations

import math

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
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadataBuilder,
)
from anyattn.backends.flashinfer_version import PIP_COMMAND
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
from anyattn.testing.batch_spec import BatchSpec
from anyattn.types import AttentionCGSupport, AttentionType, DeviceInfo, KVCacheLayout

SM80, SM90, SM100 = (DeviceInfo.parse(s) for s in ("sm80", "sm90", "sm100"))


def config(**changes) -> AttentionSelectorConfig:
    return AttentionSelectorConfig(**{"head_size": 128, "dtype": torch.bfloat16, **changes})


@pytest.fixture
def installed(monkeypatch):
    """`installed(importable, version)`: what the availability check sees on this machine."""

    def install(importable: bool = True, version: str | None = "0.7.2.post1"):
        monkeypatch.setattr(fi_backend, "installed_flashinfer", lambda: (importable, version))

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


def test_lse_is_refused_where_xqa_would_run_the_decodes():
    # XQA (SM90+, 16-bit or fp8 e4m3 caches, blocks of 64) returns no LSE: the selector hears
    # it from the declarations rather than a forward failing later.
    (reason,) = FlashInferBackend.validate_configuration(
        config(block_size=64, needs_lse=True), SM90
    )
    assert reason.startswith("LSE with block_size 64 not supported here (its decodes run ")
    for fits in (
        config(block_size=16, needs_lse=True),
        config(block_size=64, needs_lse=True, has_logits_soft_cap=True),  # no XQA: wrapper
        config(block_size=64),
    ):
        assert FlashInferBackend.validate_configuration(fits, SM90) == []
    assert (
        FlashInferBackend.validate_configuration(config(block_size=64, needs_lse=True), SM80) == []
    )


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


def test_unavailable_only_when_missing_and_the_reason_carries_the_pip_command(installed):
    installed(importable=False, version=None)
    reason = FlashInferBackend.get_unavailable_reason()
    assert reason == f"flashinfer is not installed; {PIP_COMMAND}"
    assert "pip install 'anyattn[flashinfer]'" in reason
    for version in ("0.7.2.post1", "0.7.4", "0.6.0", "0.9.1", None):  # others warn at import
        installed(version=version)
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


def test_hopper_and_blackwell_prefer_flashinfer_over_flash_attn(installed, make_backend, register):
    installed()
    flash_attn_priority = {"cuda": 0, "hopper": 1, "blackwell": 1}  # FLASH_ATTN's own
    register(
        "FLASH_ATTN", make_backend("FLASH_ATTN", devices=("cuda",), priority=flash_attn_priority)
    )
    assert explain(config(), SM100).chosen == "FLASHINFER"
    assert explain(config(), SM90).chosen == "FLASHINFER"
    assert explain(config(), DeviceInfo.parse("sm80")).chosen == "FLASH_ATTN"
    # a capability FlashInfer lacks moves the choice on, with the reason recorded
    result = explain(config(has_alibi=True), SM100)
    assert result.chosen != "FLASHINFER"
    verdict = next(v for v in result.verdicts if v.name == "FLASHINFER")
    assert verdict.reasons == ("ALiBi (has_alibi) not supported",)


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
    forward(impl, batch, batch.attn_metadata)  # compiles kernels, makes wrappers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = batch.builder.build(0, batch.common_attn_metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    output, _ = forward(impl, batch, md)
    assert_matches_oracle(batch, output)


@needs_flashinfer
@pytest.mark.parametrize("decode_kernel", ["wrapper", "xqa"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cudagraph_decode_replay_matches_eager_and_the_oracle(layout, decode_kernel):
    # "xqa": the graphs run FlashInfer's XQA decode (no plan: the build copies the table and
    # lengths into the graph's buffers), checked against the eager planned wrapper too
    if decode_kernel == "xqa" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("XQA needs SM90+")
    torch.manual_seed(0)
    block_size, size, width = 16, 8, 32
    dtype = torch.bfloat16
    spec = AttentionSpec(block_size, KV_HEADS, HEAD_SIZE, dtype)
    limits = BatchLimits(size, 256, block_size * width, cudagraph_capture_sizes=(4, size))
    impl = FlashInferImpl(HEADS, HEAD_SIZE, SCALE, KV_HEADS)
    layers = {"layer.0": impl.layer_params()}

    class Builder(FlashInferMetadataBuilder):
        pass

    Builder.decode_kernel = decode_kernel
    builder = Builder(spec, layers, limits, "cuda")
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
        real = make_common_attn_metadata(
            [1] * len(seq_lens), seq_lens, table[: len(seq_lens)], block_size
        )
        # (the dummies write nothing: slot -1; padding past the requests too)
        slots = torch.full((max(padded or 0, len(table)),), -1, dtype=torch.int64)
        slots[: len(seq_lens)] = real.slot_mapping_cpu
        cm = make_common_attn_metadata(
            query_lens, all_seq_lens, table, block_size, "cuda", slot_mapping=slots
        )
        return cm, table[: len(seq_lens)]

    def capture(seq_lens):
        """A graph of one decode forward at `len(seq_lens)` requests, with its fixed query and
        output buffers."""
        query = torch.randn(len(seq_lens), HEADS, HEAD_SIZE, device="cuda", dtype=dtype)
        output = torch.zeros_like(query)
        md = builder.build_for_cudagraph_capture(decodes(seq_lens)[0])
        assert (md.plans["layer.0"].xqa is not None) == (decode_kernel == "xqa")
        impl.forward(layer, query, None, None, cache, md, output)  # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            impl.forward(layer, query, None, None, cache, md, output)
        return graph, query, output

    # Each captured size has wrappers and index buffers of its own.
    graphs = {8: capture([1, 17, 100, 3, 64, 500, 16, 33]), 4: capture([9, 250, 31, 2])}
    eager_limits = BatchLimits(size, 256, block_size * width)
    eager_builder = FlashInferMetadataBuilder(spec, layers, eager_limits, "cuda")
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


# few long decodes: FlashInfer's planner splits their keys into chunks, so a schedule made for
# other lengths is a different one
LONG_DECODES = BatchSpec("long_decodes", (1,) * 4, (3000, 1500, 4000, 700))


class WrapperBuilder(FlashInferMetadataBuilder):
    decode_kernel = "wrapper"


class WrapperBackend(FlashInferBackend):
    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return WrapperBuilder


@needs_flashinfer
def test_a_build_ahead_of_the_device_leaves_the_running_steps_schedule():
    # The planned decode wrapper (XQA plans nothing): its plan copies the schedule from a
    # page-locked buffer to the device when the stream gets there; the next build must not
    # rewrite that buffer before, although it is made while the device is still behind.
    scale = HEAD_SIZE**-0.5
    impl = FlashInferImpl(HEADS, HEAD_SIZE, scale, KV_HEADS)
    batch = build_batch(
        WrapperBackend, LONG_DECODES, num_heads=HEADS, num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE, dtype=torch.bfloat16, device="cuda", seed=3,
        layers={"layer.0": impl.layer_params()},
    )  # fmt: skip
    layer = KitLayer("layer.0", batch.k_scale, batch.v_scale)
    cm, builder = batch.common_attn_metadata, batch.builder
    impl.do_kv_cache_update(layer, batch.key, batch.value, batch.kv_cache, cm.slot_mapping)

    def run(md):
        output = torch.full_like(batch.query, math.nan)
        impl.forward(layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output)
        return output

    run(builder.build(0, cm))  # compiles, makes the wrapper
    n = cm.num_reqs
    halves = ((cm.seq_lens_cpu[:n] + 1) // 2).tolist()
    later = make_common_attn_metadata([1] * n, halves, batch.block_table[:n], batch.block_size,
                                      device="cuda")  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # the device falls behind: this step's copy waits
    output = run(builder.build(0, cm))
    builder.build(0, later)  # the next step's plan, made before the device ran that copy
    torch.cuda.synchronize()
    n = batch.num_actual_tokens
    args = (batch.query[:n], batch.oracle_key, batch.oracle_value, batch.spec.query_lens,
            batch.kv_lens)  # fmt: skip
    ref64, _ = attention_oracle(*args, scale=scale)
    ref_lowp, _ = attention_oracle(*args, scale=scale, compute_dtype=torch.bfloat16)
    assert max_abs_error(output[:n], ref64) <= error_bound(ref64, ref_lowp, torch.bfloat16)
