"""The backend contract: KV-cache shape and layout, block sizes, capability reasons, impl args."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from anyattn.backend import (
    PLATFORMS,
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    LayerParams,
    check_layer_planned,
)
from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits
from anyattn.impl_args import validate_impl_arguments
from anyattn.kv_cache import allocate_kv_cache
from anyattn.registry import AttentionBackendEnum
from anyattn.types import AttentionCGSupport, AttentionType, DeviceInfo, KVCacheLayout, MultipleOf

CPU = DeviceInfo.cpu()
SM90 = DeviceInfo.cuda(9, 0)


def config(**changes) -> AttentionSelectorConfig:
    return AttentionSelectorConfig(**{"head_size": 64, "dtype": torch.float16, **changes})


# --- KV cache --------------------------------------------------------------------------------


def test_default_kv_cache_shape(make_backend):
    backend = make_backend()
    assert backend.get_kv_cache_shape(10, 16, 4, 64) == (10, 2, 16, 4, 64)
    assert backend.get_kv_cache_shape(1, 1, 1, 1, "fp8") == (1, 2, 1, 1, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 16, 4, 64), "num_blocks must be a positive int (got 0)"),
        ((10, 16, 4, 0), "head_size must be a positive int (got 0)"),
        ((10, True, 4, 64), "block_size must be a positive int (got True)"),
        ((10, 16, 4.0, 64), "num_kv_heads must be a positive int (got 4.0)"),
        ((10, 8, 4, 64), "block_size not supported (got 8, expected multiple of 16)"),
        ((10, 16, 4, 64, "int4"), "unknown KV-cache dtype (got 'int4'"),
    ],
)
def test_kv_cache_shape_errors(make_backend, args, message):
    backend = make_backend("SHAPE", block_sizes=[MultipleOf(16)])
    with pytest.raises(ValueError, match=r"^SHAPE\.get_kv_cache_shape: ") as raised:
        backend.get_kv_cache_shape(*args)
    assert message in str(raised.value)


def test_kv_cache_stride_orders(make_backend):
    backend = make_backend()
    assert backend.get_kv_cache_stride_order() == (0, 1, 2, 3, 4)
    assert backend.get_kv_cache_stride_order("NHD") == (0, 1, 2, 3, 4)
    assert backend.get_kv_cache_stride_order(KVCacheLayout.HND) == (0, 1, 3, 2, 4)
    nhd_only = make_backend(
        "NHD_ONLY", supported_kv_cache_layouts=classmethod(lambda cls: (KVCacheLayout.NHD,))
    )
    with pytest.raises(ValueError) as raised:
        nhd_only.get_kv_cache_stride_order("HND")
    assert str(raised.value) == (
        "NHD_ONLY.get_kv_cache_stride_order: layout not supported (got HND, expected one of NHD)."
    )


@pytest.mark.parametrize(
    ("layout", "strides"),
    [
        # blocks=3, K/V=2, block_size=4, kv_heads=2, head_size=8
        (KVCacheLayout.NHD, (2 * 4 * 2 * 8, 4 * 2 * 8, 2 * 8, 8, 1)),
        (KVCacheLayout.HND, (2 * 2 * 4 * 8, 2 * 4 * 8, 8, 4 * 8, 1)),
    ],
)
def test_allocate_kv_cache_layouts(make_backend, layout, strides):
    backend = make_backend()
    cache = allocate_kv_cache(backend, 3, 4, 2, 8, torch.float16, layout=layout)
    assert cache.shape == (3, 2, 4, 2, 8)
    assert cache.stride() == strides
    assert cache.dtype is torch.float16
    assert not cache.any()
    # Permuting by the stride order gives back the dense physical tensor.
    assert cache.permute(*backend.get_kv_cache_stride_order(layout)).is_contiguous()


def test_allocate_kv_cache_dtype(make_backend):
    backend = make_backend()
    cache = allocate_kv_cache(backend, 2, 16, 1, 64, torch.bfloat16, kv_cache_dtype="fp8_e4m3")
    assert cache.dtype is torch.float8_e4m3fn
    cache = allocate_kv_cache(backend, 2, 16, 1, 64, torch.bfloat16, kv_cache_dtype="auto")
    assert cache.dtype is torch.bfloat16


@pytest.mark.parametrize("order", list(itertools.permutations(range(5)))[::7])
def test_allocate_kv_cache_inverts_any_stride_order(make_backend, order):
    # NHD and HND orders are their own inverses; other orders catch a permutation applied the
    # wrong way round.
    backend = make_backend(
        "ORDER", get_kv_cache_stride_order=classmethod(lambda cls, layout="NHD": order)
    )
    cache = allocate_kv_cache(backend, 3, 5, 7, 11, torch.float32)
    shape = (3, 2, 5, 7, 11)
    assert cache.shape == shape
    physical_shape = [shape[i] for i in order]
    physical = cache.permute(*order)
    assert physical.is_contiguous()
    assert list(physical.shape) == physical_shape
    # Logical dim order[j] has the stride of physical dim j of a dense tensor.
    dense_strides = torch.empty(physical_shape).stride()
    assert tuple(cache.stride(d) for d in order) == dense_strides


# --- block sizes -----------------------------------------------------------------------------


def test_multiple_of_block_sizes(make_backend):
    backend = make_backend(block_sizes=[MultipleOf(16)])
    assert [b for b in range(1, 65) if backend.supports_block_size(b)] == [16, 32, 48, 64]
    assert backend.supports_block_size(None)
    assert backend.get_kernel_block_size(16) == 16
    assert backend.get_kernel_block_size(48) == 48  # any multiple is itself a kernel size
    assert backend.get_preferred_block_size() == 16
    assert backend.get_preferred_block_size(64) == 64
    assert backend.get_preferred_block_size(8) == 16
    with pytest.raises(ValueError) as raised:
        backend.get_kernel_block_size(24)
    assert str(raised.value) == "FAKE: block_size not supported (got 24, expected multiple of 16)."


def test_int_block_sizes(make_backend):
    backend = make_backend(block_sizes=[16, 32])
    assert [b for b in range(1, 100) if backend.supports_block_size(b)] == [16, 32, 48, 64, 80, 96]
    # The largest kernel size that divides the engine block; the runner splits the rest.
    assert backend.get_kernel_block_size(16) == 16
    assert backend.get_kernel_block_size(32) == 32
    assert backend.get_kernel_block_size(48) == 16
    assert backend.get_kernel_block_size(64) == 32
    assert backend.get_preferred_block_size(16) == 16
    assert backend.get_preferred_block_size(8) == 16
    with pytest.raises(ValueError, match=r"expected 16, 32\)"):
        backend.get_kernel_block_size(8)


def test_mixed_and_empty_block_sizes(make_backend):
    mixed = make_backend(block_sizes=[64, MultipleOf(32)])
    assert mixed.get_kernel_block_size(64) == 64
    assert mixed.get_kernel_block_size(96) == 96
    assert mixed.get_kernel_block_size(128) == 128
    assert mixed.get_preferred_block_size(16) == 32
    large = make_backend(block_sizes=[128, 64])
    assert large.get_preferred_block_size(16) == 64
    anything = make_backend(block_sizes=[])
    assert anything.supports_block_size(7)
    assert anything.get_preferred_block_size(7) == 7
    default = make_backend()
    assert default.get_supported_kernel_block_sizes() == [MultipleOf(1)]
    assert default.get_kernel_block_size(7) == 7


# --- CUDA-graph support ----------------------------------------------------------------------


def test_cudagraph_support_comes_from_the_builder(make_backend):
    levels = [
        AttentionCGSupport.UNIFORM_BATCH,
        AttentionCGSupport.NEVER,
        AttentionCGSupport.ALWAYS,
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
    ]
    backends = [make_backend(f"CG{i}", cudagraph=level) for i, level in enumerate(levels)]
    assert [b.get_cudagraph_support() for b in backends] == levels
    best = max(backends, key=lambda b: b.get_cudagraph_support())
    assert best.get_name() == "CG2"
    ranked = sorted(backends, key=lambda b: b.get_cudagraph_support(), reverse=True)
    assert [b.get_name() for b in ranked] == ["CG2", "CG0", "CG3", "CG1"]


# --- validate_configuration ------------------------------------------------------------------


def test_plain_backend_accepts_plain_config(make_backend):
    assert make_backend().validate_configuration(config(), CPU) == []
    assert make_backend().validate_configuration(config(), SM90) == []


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"has_sink": True}, "attention sinks (has_sink) not supported"),
        ({"has_sliding_window": True}, "sliding window (has_sliding_window) not supported"),
        ({"has_alibi": True}, "ALiBi (has_alibi) not supported"),
        ({"has_logits_soft_cap": True}, "logits soft cap (has_logits_soft_cap) not supported"),
        (
            {"use_non_causal": True},
            "non-causal decoder attention (use_non_causal) not supported",
        ),
        (
            {"use_batch_invariant": True},
            "batch invariance (use_batch_invariant) not supported",
        ),
        ({"needs_lse": True}, "returning LSE (needs_lse) not supported"),
        ({"use_mla": True}, "MLA (use_mla) not supported"),
        ({"use_sparse": True}, "sparse attention (use_sparse) not supported"),
        ({"head_size": 80}, "head_size 80 not supported (supported: 64, 128)"),
        ({"dtype": torch.float32}, "dtype float32 not supported (supported: float16, bfloat16)"),
        (
            {"kv_cache_dtype": "fp8"},
            "kv_cache_dtype fp8 not supported (supported: auto, float16, bfloat16)",
        ),
        ({"block_size": 8}, "block_size 8 not supported (kernel block sizes: multiple of 16)"),
        ({"attn_type": "encoder"}, "attn_type encoder not supported (supported: decoder)"),
    ],
)
def test_reason_for_each_unsupported_request(make_backend, changes, reason):
    backend = make_backend(
        dtypes=(torch.float16, torch.bfloat16),
        head_sizes=[64, 128],
        block_sizes=[MultipleOf(16)],
    )
    assert backend.validate_configuration(config(), CPU) == []
    assert backend.validate_configuration(config(**changes), CPU) == [reason]


@pytest.mark.parametrize(
    ("feature", "changes"),
    [
        ("sink", {"has_sink": True}),
        ("sliding_window", {"has_sliding_window": True}),
        ("alibi", {"has_alibi": True}),
        ("logits_soft_cap", {"has_logits_soft_cap": True}),
        ("non_causal", {"use_non_causal": True}),
        ("batch_invariance", {"use_batch_invariant": True}),
        ("lse", {"needs_lse": True}),
        ("per_head_quant_scales", {"use_per_head_quant_scales": True, "kv_cache_dtype": "fp8"}),
    ],
)
def test_declared_feature_gives_no_reason(make_backend, feature, changes):
    backend = make_backend(features=[feature], kv_cache_dtypes=("auto", "fp8"))
    assert backend.validate_configuration(config(**changes), CPU) == []


def test_declared_features_answer_the_supports_classmethods(make_backend):
    backend = make_backend(features=["sink", "cascade"])
    assert backend.supports_sink() and backend.supports_cascade()
    assert not (backend.supports_lse() or backend.supports_alibi())


def test_unknown_feature_name_is_refused_at_class_creation(make_backend):
    with pytest.raises(TypeError, match=r"supported_features: unknown feature names \(got sinks,"):
        make_backend(supported_features=("sinks",))


def test_per_head_quant_scales_reasons(make_backend):
    plain = make_backend(kv_cache_dtypes=("auto", "fp8"))
    assert plain.validate_configuration(
        config(use_per_head_quant_scales=True, kv_cache_dtype="fp8"), CPU
    ) == ["per-head quant scales (use_per_head_quant_scales) not supported"]
    capable = make_backend(features=["per_head_quant_scales"])
    assert capable.validate_configuration(config(use_per_head_quant_scales=True), CPU) == [
        "per-head quant scales need an fp8 kv_cache_dtype"
    ]


def test_mla_and_sparse_only_backends(make_backend):
    mla = make_backend(mla=True)
    assert mla.validate_configuration(config(), CPU) == ["MLA-only backend"]
    assert mla.validate_configuration(config(use_mla=True), CPU) == []
    sparse = make_backend(sparse=True)
    assert sparse.validate_configuration(config(), CPU) == ["sparse-only backend"]
    assert sparse.validate_configuration(config(use_sparse=True), CPU) == []


def test_device_and_capability_reasons(make_backend):
    cuda_only = make_backend(devices=("cuda",), min_compute_capability=(8, 0))
    assert cuda_only.validate_configuration(config(), CPU) == [
        "device cpu not supported (supported: cuda)"
    ]
    assert cuda_only.validate_configuration(config(), DeviceInfo.cuda(7, 5)) == [
        "compute capability sm75 not supported (needs sm80 or newer)"
    ]
    assert cuda_only.validate_configuration(config(), DeviceInfo.cuda(8, 0)) == []
    assert cuda_only.validate_configuration(config(), DeviceInfo.cuda(10, 0)) == []
    hopper_only = make_backend(
        devices=("cuda",),
        supports_compute_capability=classmethod(lambda cls, capability: capability[0] == 9),
    )
    assert hopper_only.validate_configuration(config(), DeviceInfo.cuda(10, 0)) == [
        "compute capability sm100 not supported"
    ]


def test_combination_reason_and_reason_order(make_backend):
    def no_big_heads_in_fp8(config, device):
        if config.head_size > 128 and config.kv_cache_dtype != "auto":
            return "head_size > 128 with an fp8 cache not supported"
        return None

    backend = make_backend(
        devices=("cuda",),
        kv_cache_dtypes=("auto", "fp8"),
        combination=no_big_heads_in_fp8,
    )
    assert backend.validate_configuration(config(head_size=256), SM90) == []
    assert backend.validate_configuration(config(head_size=256, kv_cache_dtype="fp8"), SM90) == [
        "head_size > 128 with an fp8 cache not supported"
    ]
    # Every reason is reported, device first and the joint constraint last.
    many = config(head_size=256, kv_cache_dtype="fp8", has_alibi=True, needs_lse=True)
    assert backend.validate_configuration(many, CPU) == [
        "device cpu not supported (supported: cuda)",
        "ALiBi (has_alibi) not supported",
        "returning LSE (needs_lse) not supported",
        "head_size > 128 with an fp8 cache not supported",
    ]


def test_availability_is_not_a_capability_reason(make_backend):
    backend = make_backend(unavailable="pip install fake-kernels")
    assert backend.validate_configuration(config(), CPU) == []
    assert backend.get_unavailable_reason() == "pip install fake-kernels"
    assert not backend.is_available()
    assert make_backend().is_available()


def test_describe(make_backend):
    backend = make_backend(
        "DESCRIBED",
        devices=("cuda",),
        dtypes=(torch.bfloat16,),
        head_sizes=[64, 128],
        block_sizes=[16, MultipleOf(32)],
        features=["alibi", "lse"],
        min_compute_capability=(9, 0),
        unavailable="pip install described",
        cudagraph=AttentionCGSupport.UNIFORM_BATCH,
    )
    described = backend.describe()
    assert described == {
        "name": "DESCRIBED",
        "class": f"{backend.__module__}.{backend.__qualname__}",
        "available": False,
        "unavailable_reason": "pip install described",
        "devices": ["cuda"],
        "min_compute_capability": "sm90",
        "dtypes": ["bfloat16"],
        "kv_cache_dtypes": ["auto", "float16", "bfloat16"],
        "head_sizes": [64, 128],
        "block_sizes": ["16", "multiple of 32"],
        "kv_cache_layouts": ["NHD", "HND"],
        "attn_types": ["decoder"],
        "features": {
            "sink": False,
            "sliding_window": False,
            "alibi": True,
            "logits_soft_cap": False,
            "non_causal": False,
            "per_head_quant_scales": False,
            "batch_invariance": False,
            "lse": True,
            "cascade": False,
            "mla": False,
            "sparse": False,
        },
        "mla_splits": None,
        "cudagraph_support": "UNIFORM_BATCH",
        "forward_includes_kv_cache_update": False,
        "priority": {"cpu": 100, "cuda": 100, "blackwell": 100},
    }
    assert make_backend().describe()["head_sizes"] == "any"


def test_attention_backend_is_abstract():
    with pytest.raises(TypeError):
        AttentionBackend()  # type: ignore[abstract]


# --- validate_impl_arguments -----------------------------------------------------------------

IMPL_ARGS = {
    "num_heads": 8,
    "head_size": 64,
    "scale": 0.125,
    "num_kv_heads": 2,
    "alibi_slopes": None,
    "sliding_window": None,
    "kv_cache_dtype": "auto",
    "logits_soft_cap": None,
    "attn_type": AttentionType.DECODER,
    "sinks": None,
}


def test_validate_impl_arguments_returns_kv_heads(make_backend):
    backend = make_backend(head_sizes=[64])
    assert validate_impl_arguments(backend, **IMPL_ARGS) == 2
    assert validate_impl_arguments(backend, **{**IMPL_ARGS, "num_kv_heads": None}) == 8
    # A soft cap of 0 means "off", as in the engines that pass 0 for no cap.
    assert validate_impl_arguments(backend, **{**IMPL_ARGS, "logits_soft_cap": 0}) == 2
    assert validate_impl_arguments(backend, **{**IMPL_ARGS, "attn_type": "decoder"}) == 2


def test_validate_impl_arguments_accepts_declared_features(make_backend):
    backend = make_backend(features=["alibi", "sliding_window", "logits_soft_cap", "sink"])
    args = {
        **IMPL_ARGS,
        "alibi_slopes": [0.5] * 8,
        "sliding_window": 128,
        "logits_soft_cap": 30.0,
        "sinks": torch.zeros(8),
    }
    assert validate_impl_arguments(backend, **args) == 2
    assert validate_impl_arguments(backend, **{**args, "alibi_slopes": torch.ones(8)}) == 2
    with pytest.raises(ValueError, match=r"one slope per query head \(got 1, expected 8\)"):
        validate_impl_arguments(backend, **{**args, "alibi_slopes": torch.tensor(0.5)})


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"num_heads": 0}, ValueError, "num_heads must be a positive int (got 0)"),
        ({"head_size": False}, ValueError, "head_size must be a positive int (got False)"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be a positive int (got 0)"),
        (
            {"num_kv_heads": 3},
            ValueError,
            "num_heads must be a multiple of num_kv_heads (got num_heads=8, num_kv_heads=3)",
        ),
        ({"scale": 0.0}, ValueError, "scale must be a positive finite float (got 0.0)"),
        ({"scale": float("nan")}, ValueError, "scale must be a positive finite float"),
        ({"scale": None}, ValueError, "scale must be a positive finite float (got None)"),
        ({"head_size": 80}, ValueError, "head_size not supported (got 80, expected one of [64])"),
        ({"kv_cache_dtype": "int8"}, ValueError, "unknown KV-cache dtype (got 'int8'"),
        (
            {"kv_cache_dtype": "fp8"},
            ValueError,
            "kv_cache_dtype not supported (got 'fp8', expected one of auto, float16, bfloat16)",
        ),
        ({"attn_type": "cross"}, ValueError, "unknown attn_type (got 'cross'"),
        (
            {"attn_type": "encoder_only"},
            NotImplementedError,
            "attn_type not supported (got encoder_only, expected one of decoder). Pick another "
            "backend (`anyattn explain --head-size N --attn-type encoder_only` lists",
        ),
        (
            {"alibi_slopes": [1.0] * 8},
            NotImplementedError,
            "ALiBi not supported (got 8 alibi_slopes, expected None; the backend declares no "
            "ALiBi support). Pick another backend (`anyattn explain --head-size N --has-alibi`",
        ),
        (
            {"alibi_slopes": torch.tensor(0.5)},  # a 0-d tensor: no len()
            NotImplementedError,
            "ALiBi not supported (got 1 alibi_slopes, expected None;",
        ),
        (
            {"sliding_window": 64},
            NotImplementedError,
            "sliding window not supported (got sliding_window=64, expected None;",
        ),
        (
            {"logits_soft_cap": 30.0},
            NotImplementedError,
            "logits soft cap not supported (got logits_soft_cap=30.0, expected None or 0;",
        ),
        (
            {"sinks": torch.zeros(8)},
            NotImplementedError,
            "attention sinks not supported (got sinks of shape (8,), expected None;",
        ),
        (
            {"sinks": [0.0] * 8},
            NotImplementedError,
            "attention sinks not supported (got sinks of type list, expected None;",
        ),
    ],
)
def test_validate_impl_arguments_errors(make_backend, changes, error, message):
    backend = make_backend("IMPL", head_sizes=[64])
    with pytest.raises(error) as raised:
        validate_impl_arguments(backend, **{**IMPL_ARGS, **changes})
    assert str(raised.value).startswith("IMPL impl: ")
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"alibi_slopes": [1.0] * 4},
            "alibi_slopes needs one slope per query head (got 4, expected 8)",
        ),
        ({"sliding_window": 0}, "sliding_window must be a positive int or None (got 0)"),
        ({"sliding_window": True}, "sliding_window must be a positive int or None (got True)"),
        ({"logits_soft_cap": -1.0}, "logits_soft_cap must be a positive float (got -1.0)"),
        ({"logits_soft_cap": float("inf")}, "logits_soft_cap must be a positive float"),
        ({"sinks": torch.zeros(2)}, "sinks must be a tensor of shape [num_heads] (got (2,)"),
        ({"sinks": [0.0] * 8}, "sinks must be a tensor of shape [num_heads] (got list"),
    ],
)
def test_validate_impl_arguments_bad_feature_values(make_backend, changes, message):
    backend = make_backend(features=["alibi", "sliding_window", "logits_soft_cap", "sink"])
    with pytest.raises(ValueError) as raised:
        validate_impl_arguments(backend, **{**IMPL_ARGS, **changes})
    assert message in str(raised.value)


def test_validate_impl_arguments_refuses_a_window_outside_decoder_attention(make_backend):
    backend = make_backend(
        features=["sliding_window"],
        supported_attn_types=(AttentionType.DECODER, AttentionType.ENCODER),
    )
    with pytest.raises(NotImplementedError) as raised:
        validate_impl_arguments(
            backend, **{**IMPL_ARGS, "sliding_window": 8, "attn_type": "encoder"}
        )
    assert str(raised.value) == (
        "FAKE impl: sliding window with encoder attention not supported (got sliding_window=8, "
        "expected None; the window is defined causally). Pass sliding_window=None for encoder "
        "layers."
    )


# --- the joint rules, once, in the base classes -----------------------------------------------


def test_window_needs_causal_attention_one_reason_from_the_base(make_backend):
    backend = make_backend(
        features=["sliding_window", "non_causal"],
        supported_attn_types=(AttentionType.DECODER, AttentionType.ENCODER),
    )
    reason = "sliding window with non-causal or encoder attention not supported"
    assert backend.validate_configuration(config(has_sliding_window=True), CPU) == []
    for changes in ({"use_non_causal": True}, {"attn_type": AttentionType.ENCODER}):
        reasons = backend.validate_configuration(config(has_sliding_window=True, **changes), CPU)
        assert reasons == [reason]


class _Impl(AttentionImpl[None]):
    """The smallest impl: the base constructor and nothing else."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_lse=None):
        return output


def _impl_class(backend):
    return type("FakeImpl", (_Impl,), {"backend": backend})


def test_base_impl_constructor_checks_and_keeps_the_arguments(make_backend):
    backend = make_backend(
        features=["alibi", "sliding_window", "logits_soft_cap", "sink"], head_sizes=[64]
    )
    impl_cls = _impl_class(backend)
    impl = impl_cls(8, 64, 0.125, 2, alibi_slopes=[0.5] * 8, sliding_window=0,
                    logits_soft_cap=0, attn_type="decoder", sinks=torch.zeros(8))  # fmt: skip
    assert (impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale) == (8, 2, 64, 0.125)
    assert impl.attn_type is AttentionType.DECODER and impl.kv_cache_dtype == "auto"
    assert impl.sliding_window is None and impl.logits_soft_cap is None  # 0 means off
    assert impl.alibi_slopes.dtype == torch.float32 and impl.alibi_slopes.device.type == "cpu"
    assert impl.alibi_slopes.tolist() == [0.5] * 8
    assert impl.sinks is not None and impl.kv_sharing_target_layer_name is None
    assert impl.layer_params() == LayerParams(
        8, 2, 64, 0.125, AttentionType.DECODER, "auto", None, None, True, True
    )
    windowed = impl_cls(8, 64, 0.125, sliding_window=32, logits_soft_cap=30)
    assert windowed.layer_params().sliding_window == 32
    assert windowed.layer_params().logits_soft_cap == 30.0
    assert hash(windowed.layer_params()) == hash(windowed.layer_params())
    with pytest.raises(ValueError, match="head_size not supported"):
        impl_cls(8, 80, 0.125)


@dataclasses.dataclass(frozen=True)
class _WideParams(LayerParams):
    latent_size: int = 0


def test_an_impl_may_extend_its_record(make_backend):
    backend = make_backend()

    class WideImpl(_impl_class(backend)):
        params_cls = _WideParams

        def layer_params(self):
            return dataclasses.replace(super().layer_params(), latent_size=512)

    params = WideImpl(8, 64, 0.125, 2).layer_params()
    assert isinstance(params, _WideParams) and params.latent_size == 512
    assert (params.num_heads, params.num_kv_heads, params.scale) == (8, 2, 0.125)
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    limits = BatchLimits(max_num_reqs=4, max_num_tokens=64, max_model_len=256)
    builder = backend.get_builder_cls()(spec, {"layer.0": params}, limits, "cpu")
    assert builder.layers["layer.0"] is params


def test_base_impl_constructor_applies_the_joint_rules(make_backend):
    backend = make_backend(
        features=["sliding_window"],
        supported_attn_types=(AttentionType.DECODER, AttentionType.ENCODER),
    )
    with pytest.raises(NotImplementedError, match="sliding window with encoder attention"):
        _impl_class(backend)(8, 64, 0.125, sliding_window=8, attn_type="encoder")


def test_an_impl_must_name_its_backend():
    with pytest.raises(TypeError, match=r"must name its backend \(set _Impl.backend"):
        _Impl(8, 64, 0.125)


def test_check_layer_planned_names_the_layer_and_the_builders_layers():
    planned = frozenset({"layer.0", "layer.1"})
    check_layer_planned(planned, SimpleNamespace(layer_name="layer.1"), "api")
    with pytest.raises(ValueError) as raised:
        check_layer_planned(planned, SimpleNamespace(layer_name="layer.7"), "X forward")
    message = str(raised.value)
    assert message.startswith("X forward: layer 'layer.7' is not one of the layers")
    assert "expected one of ['layer.0', 'layer.1']" in message


# --- builder defaults ------------------------------------------------------------------------


def test_builder_defaults(make_backend):
    backend = make_backend(cudagraph=AttentionCGSupport.ALWAYS)
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    limits = BatchLimits(
        max_num_reqs=4, max_num_tokens=64, max_model_len=256, num_speculative_tokens=3
    )
    params = LayerParams(8, 2, 64, 0.125)
    layers = {"layer.0": params, "layer.1": replace(params, logits_soft_cap=30.0)}
    builder = backend.get_builder_cls()(spec, layers, limits, "cpu")
    assert builder.device == torch.device("cpu")
    assert builder.layers == layers and builder.layers is not layers
    assert builder.layer_names == ["layer.0", "layer.1"]
    assert builder.reorder_batch_threshold is None
    assert backend.get_cudagraph_support(spec, limits) is AttentionCGSupport.ALWAYS
    builder._init_reorder_batch_threshold(1)
    assert builder.reorder_batch_threshold == 1
    builder._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
    assert builder.reorder_batch_threshold == 4  # 1 + 3 draft tokens count as a decode
    builder._init_reorder_batch_threshold(None, supports_spec_as_decode=True)
    assert builder.reorder_batch_threshold is None


def test_builder_refuses_layers_it_cannot_serve(make_backend):
    builder_cls = make_backend().get_builder_cls()
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    limits = BatchLimits(max_num_reqs=4, max_num_tokens=64, max_model_len=256)
    with pytest.raises(TypeError, match=r"layers must map layer names to LayerParams \(got list"):
        builder_cls(spec, ["layer.0"], limits, "cpu")
    with pytest.raises(TypeError, match=r"got 'layer\.0': int"):
        builder_cls(spec, {"layer.0": 3}, limits, "cpu")
    with pytest.raises(ValueError, match=r"layer 'layer\.0' has head_size=128, but the KV-cache"):
        builder_cls(spec, {"layer.0": LayerParams(8, 2, 128, 0.125)}, limits, "cpu")


def test_removed_surface_is_gone():
    for name in ("register_layer", "build_for_drafting", "update_block_table"):
        assert not hasattr(AttentionMetadataBuilder, name)
    for name in ("process_weights_after_loading", "dcp_world_size", "supports_quant_query_input"):
        assert not hasattr(AttentionImpl, name)
    assert "output_scale" not in inspect.signature(AttentionImpl.forward).parameters
    assert "fast_build" not in inspect.signature(AttentionMetadataBuilder.build).parameters
    cascade = inspect.signature(AttentionMetadataBuilder.use_cascade_attention).parameters
    assert "dcp_world_size" not in cascade and "use_local_attention" not in cascade


@pytest.mark.parametrize("name", [member.name for member in AttentionBackendEnum])
def test_builtin_backends_rank_themselves_and_their_impls_name_them(name):
    backend = AttentionBackendEnum[name].get_class()
    assert backend.priority and set(backend.priority) <= set(PLATFORMS)
    assert backend.get_impl_cls().backend is backend
