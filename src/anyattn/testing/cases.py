"""Which cases the kit runs for a backend, from what the backend declares.

Every feature has a name (the keys of `FEATURES`); `plan_cases` turns the requested features
into concrete `Case`s and lists, with the reason, every feature or case the backend does not
declare. A backend is never excused silently: what it cannot run shows in the report.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig
from anyattn.testing.batch_spec import BatchSpec, get_spec
from anyattn.testing.declared import (
    FP8_CACHE_DTYPES,
    block_size_cases,
    declared_fp8,
    feature_names,
    global_reasons,
    plan_features,
)
from anyattn.testing.mla_cases import MLACase, plan_mla_cases
from anyattn.types import AttentionType, DeviceInfo, KVCacheLayout, is_fp8_cache

__all__ = ["FEATURES", "Case", "geometric_alibi_slopes", "plan_cases"]

FEATURES: Mapping[str, str] = MappingProxyType(
    {
        "decode": "one decode, and eight decodes of lengths 1 to 200",
        "prefill": "one fresh 1025-token prefill (2 query heads, 1 KV head)",
        "mixed": "decodes, fresh prefills and a chunk interleaved in one batch",
        "chunked": "prefill chunks on top of long contexts",
        "odd_lengths": "sequence lengths 1, 7, 97, 1025",
        "gqa": "query heads per KV head 1, 4 and 8",
        "mqa": "a single KV head for 8 query heads",
        "head_sizes": "head sizes 64 and 128 (and 80 when any size is declared); an undeclared "
        "head size must be rejected by the impl constructor",
        "block_sizes": "engine block sizes 16 and 32 (and 5 when declared)",
        "layouts": "every declared KV-cache layout (NHD, HND)",
        "padding": "5 padding rows past the real tokens: slot -1, output rows left untouched",
        "kv_sharing": "a second layer reading the first layer's cache, writing nothing",
        "non_causal": "bidirectional decoder attention over the paged cache",
        "encoder": "AttentionType.ENCODER, bidirectional, no cache",
        "encoder_only": "AttentionType.ENCODER_ONLY, bidirectional, no cache",
        "encoder_decoder": "cross attention over encoder K/V kept in the layer's cache; and 8 "
        "query heads on 1 KV head over encoders of 434-1100 tokens (head size 80 where declared)",
        "sliding_window": "windows of 33 and 7 keys",
        "alibi": "ALiBi with the standard geometric slopes",
        "soft_cap": "logits soft cap 2.0",
        "sinks": "per-head attention sinks (with LSE when declared)",
        "fp8": "every declared fp8 cache dtype, per-tensor scales",
        "per_head_scales": "fp8 cache with one scale per KV head",
        "lse": "output_lse (natural log) of a mixed batch",
        "cascade": "16 requests sharing 512 prefix tokens in the same blocks (common_prefix_len)",
    }
)
"""Feature names accepted by `check_backend(features=...)`, with what each runs."""

# Scales exactly representable in bf16/fp16, so that only the fp8 rounding is tested.
_K_SCALES = (0.375, 0.5, 0.3125, 0.25)
_V_SCALES = (0.15625, 0.1875, 0.125, 0.25)


def geometric_alibi_slopes(num_heads: int) -> list[float]:
    """The standard ALiBi slopes, `2 ** (-8 (h + 1) / num_heads)` for head h."""
    return [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]


@dataclass(frozen=True, slots=True)
class Case:
    """One configuration to run: a batch and the layer's settings.

    `scale` is `scale_factor / sqrt(head_size)`; the factor is not 1 so that an impl ignoring
    its `scale` argument fails. `expect_rejection` cases only check that constructing the impl
    raises (a head size the backend does not declare).
    """

    name: str
    feature: str
    spec: BatchSpec
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    layout: KVCacheLayout = KVCacheLayout.NHD
    kv_cache_dtype: str = "auto"
    per_head_scales: bool = False
    attn_type: AttentionType = AttentionType.DECODER
    causal: bool = True
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    use_alibi: bool = False
    use_sinks: bool = False
    check_lse: bool = False
    num_padding_tokens: int = 0
    kv_sharing: bool = False
    expect_rejection: bool = False
    scale_factor: float = 1.25

    @property
    def scale(self) -> float:
        return self.scale_factor / math.sqrt(self.head_size)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 `(k_scale, v_scale)`: `[]`, or `[num_kv_heads]` with per-head scales."""
        if not is_fp8_cache(self.kv_cache_dtype):
            return torch.tensor(1.0), torch.tensor(1.0)
        if not self.per_head_scales:
            return torch.tensor(_K_SCALES[0]), torch.tensor(_V_SCALES[0])
        heads = [h % 4 for h in range(self.num_kv_heads)]
        return torch.tensor([_K_SCALES[h] for h in heads]), torch.tensor(
            [_V_SCALES[h] for h in heads]
        )

    def alibi_slopes(self) -> list[float] | None:
        return geometric_alibi_slopes(self.num_heads) if self.use_alibi else None

    def selector_config(self, dtype: torch.dtype) -> AttentionSelectorConfig:
        """What a model layer with these settings would ask the selector."""
        return AttentionSelectorConfig(
            head_size=self.head_size, dtype=dtype,
            kv_cache_dtype=self.kv_cache_dtype,  # type: ignore[arg-type]
            block_size=self.block_size, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            has_sink=self.use_sinks, attn_type=self.attn_type,
            has_sliding_window=self.sliding_window is not None, has_alibi=self.use_alibi,
            has_logits_soft_cap=bool(self.logits_soft_cap),
            use_non_causal=self.attn_type is AttentionType.DECODER and not self.causal,
            use_per_head_quant_scales=self.per_head_scales, needs_lse=self.check_lse,
        )  # fmt: skip


_FLAG_FEATURES = {
    "non_causal": "supports_non_causal", "sliding_window": "supports_sliding_window",
    "alibi": "supports_alibi", "soft_cap": "supports_logits_soft_cap", "sinks": "supports_sink",
    "lse": "supports_lse", "cascade": "supports_cascade",
    "per_head_scales": "supports_per_head_quant_scales",
}  # fmt: skip
_ATTN_TYPE_FEATURES = {
    "encoder": AttentionType.ENCODER,
    "encoder_only": AttentionType.ENCODER_ONLY,
    "encoder_decoder": AttentionType.ENCODER_DECODER,
}
# Features whose cases do not depend on the backend: feature -> its cases, each (case name,
# catalogue batch, changes to the base case).
_FIXED_CASES: dict[str, tuple[tuple[str, str, dict[str, object]], ...]] = {
    "decode": (("single_decode", "single_decode", {}), ("many_decodes", "many_decodes", {})),
    "prefill": (("long_prefill", "long_prefill", {"num_heads": 2, "num_kv_heads": 1}),),
    "mixed": (("mixed", "mixed", {}),),
    "chunked": (("chunked_prefill", "chunked_prefill", {}),),
    "odd_lengths": (("odd_lengths", "odd_lengths", {}),),
    "gqa": tuple(
        (f"gqa/ratio{h // k}", "mixed", {"num_heads": h, "num_kv_heads": k})
        for h, k in ((4, 4), (8, 2), (16, 2))
    ),
    "mqa": (("mqa", "mixed", {"num_heads": 8, "num_kv_heads": 1}),),
    "padding": (("padding", "mixed", {"num_padding_tokens": 5}),),
    "kv_sharing": (("kv_sharing", "mixed", {"kv_sharing": True}),),
    "non_causal": (("non_causal", "mixed", {"causal": False}),),
    "encoder": (("encoder", "encoder", {"attn_type": AttentionType.ENCODER}),),
    "encoder_only": (("encoder_only", "encoder", {"attn_type": AttentionType.ENCODER_ONLY}),),
    "sliding_window": (
        ("window33", "chunked_prefill", {"sliding_window": 33}),
        ("window7", "odd_lengths", {"sliding_window": 7}),
    ),
    "alibi": (("alibi", "mixed", {"use_alibi": True}),),
    "soft_cap": (("soft_cap", "mixed", {"logits_soft_cap": 2.0}),),
    "lse": (("mixed_lse", "mixed", {"check_lse": True}),),
}


def _not_declared(backend: type[AttentionBackend], feature: str) -> str | None:
    """Why `backend` does not declare `feature` as a whole, or None when it does."""
    if feature in _ATTN_TYPE_FEATURES:
        attn_type = _ATTN_TYPE_FEATURES[feature]
        if backend.supports_attn_type(attn_type):
            return None
        return f"attn_type {attn_type.value} not in supported_attn_types"
    if not backend.supports_attn_type(AttentionType.DECODER):
        return "attn_type decoder not in supported_attn_types"
    method = _FLAG_FEATURES.get(feature)
    if method is not None and not getattr(backend, method)():
        return f"{method}() is False"
    if feature in ("fp8", "per_head_scales") and not declared_fp8(backend):
        return "no fp8 kv_cache_dtype in supported_kv_cache_dtypes"
    return None


def _base_case(backend: type[AttentionBackend]) -> Case:
    sizes = backend.get_supported_head_sizes()
    head_size = 64 if backend.supports_head_size(64) else sorted(sizes)[0]
    return Case(
        name="", feature="", spec=get_spec("mixed"), head_size=head_size,
        block_size=backend.get_preferred_block_size(16),
        layout=backend.supported_kv_cache_layouts()[0],
    )  # fmt: skip


def _feature_cases(
    backend: type[AttentionBackend], feature: str, base: Case, quick: bool
) -> tuple[list[Case], list[str]]:
    """The cases of one declared feature, and the parts of it the backend does not declare."""

    def case(name: str, spec_name: str = "mixed", **changes: object) -> Case:
        return replace(base, name=name, feature=feature, spec=get_spec(spec_name, quick), **changes)

    if feature in _FIXED_CASES:
        return [case(name, spec, **changes) for name, spec, changes in _FIXED_CASES[feature]], []
    if feature == "head_sizes":
        wanted = (64, 128, 80) if not backend.get_supported_head_sizes() else (64, 128)
        cases = [case(f"head_size{s}", head_size=s) for s in wanted if s != base.head_size]
        cases = [c for c in cases if backend.supports_head_size(c.head_size)]
        missing = [f"head_size {s}" for s in wanted if not backend.supports_head_size(s)]
        rejected = next((s for s in (72, 40, 24, 8) if not backend.supports_head_size(s)), None)
        if rejected is not None and backend.get_supported_head_sizes():
            name = f"rejects_head_size{rejected}"
            cases.append(case(name, head_size=rejected, expect_rejection=True))
        return cases, missing
    if feature == "block_sizes":
        return block_size_cases(
            backend, base.block_size, lambda b: case(f"block_size{b}", "odd_lengths", block_size=b)
        )
    if feature == "layouts":
        declared = backend.supported_kv_cache_layouts()
        others = [x for x in declared if x != base.layout]
        missing = [f"layout {x}" for x in KVCacheLayout if x not in declared]
        return [case(f"layout_{x}", "chunked_prefill", layout=x) for x in others], missing
    if feature == "encoder_decoder":
        cross = AttentionType.ENCODER_DECODER
        # Eight query heads on one KV head over long encoders, at head size 80 where declared.
        long_head_size = 80 if backend.supports_head_size(80) else base.head_size
        long = case(
            "encoder_decoder/long", "cross_attention_long", attn_type=cross, num_heads=8,
            num_kv_heads=1, head_size=long_head_size,
        )  # fmt: skip
        return [case(feature, "encoder_decoder", attn_type=cross), long], []
    if feature == "sinks":
        return [case("sinks", use_sinks=True, check_lse=backend.supports_lse())], []
    if feature == "fp8":
        declared = declared_fp8(backend)
        missing = [f"kv_cache_dtype {d}" for d in FP8_CACHE_DTYPES if d not in declared]
        return [case(f"fp8/{d}", kv_cache_dtype=d) for d in declared], missing
    if feature == "per_head_scales":
        fp8 = declared_fp8(backend)[0]
        return [case("per_head_scales", kv_cache_dtype=fp8, per_head_scales=True)], []
    if feature == "cascade":
        prefix = get_spec("cascade", quick).common_prefix_len
        if prefix % base.block_size:
            return [], [f"a {prefix}-token prefix in whole blocks of {base.block_size}"]
        return [case("cascade", "cascade", num_heads=2, num_kv_heads=1)], []
    raise AssertionError(f"feature {feature} has no cases")


def plan_cases(
    backend: type[AttentionBackend], device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32, features: Iterable[str] | None = None, quick: bool = False,
) -> tuple[list[Case] | list[MLACase], list[str]]:  # fmt: skip
    """The cases `check_backend` would run (arguments alike), and what the backend does not
    declare: `(cases, not_declared)`, each not-declared entry "<feature>: <reason>"; an unknown
    feature name is a ValueError. Useful to parametrise a pytest suite over cases (`run_case`
    runs one); for an MLA backend they are `MLACase`s (`plan_mla_cases`)."""
    if backend.is_mla():
        return plan_mla_cases(backend, device, dtype, features, quick)
    names = feature_names("plan_cases: unknown feature", FEATURES, features)
    info = DeviceInfo.current(device)
    reasons = global_reasons(backend, info, dtype)
    if reasons:
        return [], [f"backend: {r}" for r in reasons]
    base = _base_case(backend)
    return plan_features(
        backend, names, lambda feature: _not_declared(backend, feature),
        lambda feature: _feature_cases(backend, feature, base, quick), info, dtype,
    )  # fmt: skip
