"""`AttentionBackend`: what one attention backend declares (no instances, no device access):
its impl and builder classes, KV-cache shape and stride orders, every capability the selector
checks, and its rank per platform (`priority`). `validate_configuration` turns them, and the
contract's joint rules, into reasons.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from anyattn.mla_declarations import format_mla_splits, mla_reasons
from anyattn.types import (
    AttentionCGSupport,
    AttentionType,
    DeviceInfo,
    KVCacheLayout,
    MultipleOf,
    check_positive_int,
    is_fp8_cache,
    parse_cache_dtype,
)

if TYPE_CHECKING:
    from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits

__all__ = ["PLATFORMS", "AttentionBackend", "format_mla_splits", "platform_key", "rank_on"]

# Platform keys of `AttentionBackend.priority`. "hopper" (sm90) falls back to a backend's "cuda"
# rank when it declares none of its own.
PLATFORMS = ("cpu", "cuda", "hopper", "blackwell")


def platform_key(device: DeviceInfo) -> str:
    """The `priority` key of `device`: "cpu", "blackwell" (sm100+), "hopper" (sm90) or "cuda"
    (the rest, and CUDA of unknown capability)."""
    if device.type == "cpu":
        return "cpu"
    if device.capability is not None and device.capability >= (10, 0):
        return "blackwell"
    if device.capability is not None and device.capability[0] == 9:
        return "hopper"
    return "cuda"


def rank_on(priority: Mapping[str, int], key: str) -> int | None:
    """A backend's rank on platform `key` (lower tried first), None when it declares none there
    (then it is chosen there only on explicit request)."""
    if key == "hopper" and key not in priority:
        return priority.get("cuda")
    return priority.get(key)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Features a config may ask for: (feature, the config's flag, label); `supports_<feature>`
# answers whether the backend has it.
CONFIG_FEATURES = (
    ("sink", "has_sink", "attention sinks"),
    ("sliding_window", "has_sliding_window", "sliding window"),
    ("alibi", "has_alibi", "ALiBi"),
    ("logits_soft_cap", "has_logits_soft_cap", "logits soft cap"),
    ("non_causal", "use_non_causal", "non-causal decoder attention"),
    ("per_head_quant_scales", "use_per_head_quant_scales", "per-head quant scales"),
    ("batch_invariance", "use_batch_invariant", "batch invariance"),
    ("lse", "needs_lse", "returning LSE"),
)
# Every name `AttentionBackend.supported_features` may hold: those above, and "cascade" (a
# builder's choice, not a config flag).
_FEATURE_NAMES = (*(feature for feature, _, _ in CONFIG_FEATURES), "cascade")


def _format_block_sizes(sizes: Sequence[int | MultipleOf]) -> str:
    return ", ".join(str(s) for s in sizes) if sizes else "any"


def _base(size: int | MultipleOf) -> int:
    return size.base if isinstance(size, MultipleOf) else size


def _sm(capability: tuple[int, int]) -> str:
    return f"sm{capability[0]}{capability[1]}"


def _feature_check(feature: str, meaning: str) -> classmethod:
    """`AttentionBackend.supports_<feature>`: whether `supported_features` names `feature`."""

    def supports(cls: type[AttentionBackend]) -> bool:
        return feature in cls.supported_features

    supports.__name__ = f"supports_{feature}"
    supports.__qualname__ = f"AttentionBackend.supports_{feature}"
    supports.__doc__ = f"Whether the backend supports {meaning} (named in `supported_features`)."
    return classmethod(supports)


class AttentionBackend(ABC):
    """Declarations of one attention backend; subclasses override attributes and methods.
    Every constraint the impl enforces is declared here, so that the selector rejects a
    configuration up front instead of the impl failing on the first forward."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "float16", "bfloat16")
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    supported_attn_types: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)
    # The optional features the kernels have, by the names of the `supports_<feature>`
    # classmethods below, which read it.
    supported_features: ClassVar[tuple[str, ...]] = ()
    # Lowest CUDA compute capability the kernels run on; None: no lower bound.
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    # When False, the layer calls impl.do_kv_cache_update before impl.forward.
    forward_includes_kv_cache_update: ClassVar[bool] = False
    # Rank per platform key (`PLATFORMS`), lower tried first; a platform absent here: never
    # chosen automatically there, only on explicit request.
    priority: ClassVar[Mapping[str, int]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        # A `supported_features` name no `supports_<feature>` reads would declare nothing.
        super().__init_subclass__(**kwargs)
        unknown = set(cls.__dict__.get("supported_features", ())) - set(_FEATURE_NAMES)
        if unknown:
            raise TypeError(
                f"{cls.__name__}.supported_features: unknown feature names (got "
                f"{', '.join(sorted(unknown))}, expected names from {', '.join(_FEATURE_NAMES)})."
            )

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """The registry name, e.g. "TORCH"."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type:
        """The impl class (an `anyattn.impl.AttentionImpl` or `MLAAttentionImpl` subclass)."""

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type:
        """The metadata builder class (an `anyattn.builder.AttentionMetadataBuilder` subclass)."""

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """Logical shape of one layer's KV cache, by default `(num_blocks, 2, block_size,
        num_kv_heads, head_size)` (index 1: K, V); a `ValueError` for a bad dimension or a
        block size the kernels cannot take."""
        api = f"{cls.get_name()}.get_kv_cache_shape"
        dims = {"num_blocks": num_blocks, "block_size": block_size}
        dims.update(num_kv_heads=num_kv_heads, head_size=head_size)
        for name, value in dims.items():
            check_positive_int(api, name, value)
        parse_cache_dtype(cache_dtype, argument=f"{api}: cache_dtype")
        if not cls.supports_block_size(block_size):
            raise ValueError(
                f"{api}: block_size not supported (got {block_size}, "
                f"expected {_format_block_sizes(cls.get_supported_kernel_block_sizes())})."
            )
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @classmethod
    def get_kv_cache_stride_order(
        cls, layout: KVCacheLayout | str = KVCacheLayout.NHD
    ) -> tuple[int, ...]:
        """Order in which to allocate the logical dims so that memory follows `layout`:
        `torch.empty([shape[i] for i in order])` permuted by the inverse order."""
        try:
            layout = KVCacheLayout(layout)
        except ValueError:
            raise ValueError(
                f"{cls.get_name()}.get_kv_cache_stride_order: unknown layout (got {layout!r}, "
                f"expected one of {', '.join(x.value for x in KVCacheLayout)})."
            ) from None
        if layout not in cls.supported_kv_cache_layouts():
            raise ValueError(
                f"{cls.get_name()}.get_kv_cache_stride_order: layout not supported (got {layout}, "
                f"expected one of {', '.join(str(x) for x in cls.supported_kv_cache_layouts())})."
            )
        return (0, 1, 2, 3, 4) if layout is KVCacheLayout.NHD else (0, 1, 3, 2, 4)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        """Layouts the kernels consume, most preferred first."""
        return (KVCacheLayout.NHD, KVCacheLayout.HND)

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        """Kernel block sizes: exact ints and/or `MultipleOf(n)`."""
        return [MultipleOf(1)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """Whether an engine block size is a multiple of some kernel block size (the runner
        splits engine blocks into kernel blocks: `anyattn.slots.expand_block_table`)."""
        sizes = cls.get_supported_kernel_block_sizes()
        return block_size is None or not sizes or any(block_size % _base(s) == 0 for s in sizes)

    @classmethod
    def get_kernel_block_size(cls, block_size: int) -> int:
        """The kernel block size used for engine blocks of `block_size` (the largest that fits)."""
        fitting = [
            block_size if isinstance(s, MultipleOf) else s
            for s in cls.get_supported_kernel_block_sizes()
            if block_size % _base(s) == 0
        ]
        if not fitting:
            raise ValueError(
                f"{cls.get_name()}: block_size not supported (got {block_size}, expected "
                f"{_format_block_sizes(cls.get_supported_kernel_block_sizes())})."
            )
        return max(fitting)

    @classmethod
    def check_kv_cache_spec(cls, spec: AttentionSpec, api: str) -> None:
        """Refuse, at the builder's construction, a spec the kernels do not take (its
        `block_size` must be a kernel block size exactly); the `ValueError` names the field,
        its value and what the backend declares."""
        block_ok = cls.supports_block_size(spec.block_size) and (
            cls.get_kernel_block_size(spec.block_size) == spec.block_size
        )
        checks = (
            ("block_size", spec.block_size, block_ok,
             _format_block_sizes(cls.get_supported_kernel_block_sizes())),
            ("head_size", spec.head_size, cls.supports_head_size(spec.head_size),
             ", ".join(str(s) for s in cls.get_supported_head_sizes()) or "any"),
            ("dtype", _dtype_name(spec.dtype), cls.supports_dtype(spec.dtype),
             ", ".join(_dtype_name(d) for d in cls.supported_dtypes)),
            ("kv_cache_dtype", spec.kv_cache_dtype,
             cls.supports_kv_cache_dtype(spec.kv_cache_dtype),
             ", ".join(cls.supported_kv_cache_dtypes)),
        )  # fmt: skip
        name = cls.get_name()
        for field_name, value, ok, accepted in checks:
            if not ok:
                raise ValueError(
                    f"{api}: kv_cache_spec.{field_name} not supported by {name} (got {value}, "
                    f"expected {accepted}). Build the spec the selector chose {name} for."
                )

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int = 16) -> int:
        """`default_block_size` when supported, else the smallest supported kernel size."""
        sizes = cls.get_supported_kernel_block_sizes()
        if not sizes or cls.supports_block_size(default_block_size):
            return default_block_size
        return min(_base(s) for s in sizes)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """Head sizes the kernels take; empty means any."""
        return []

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        sizes = cls.get_supported_head_sizes()
        return not sizes or head_size in sizes

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str | None) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def supports_attn_type(cls, attn_type: AttentionType | str) -> bool:
        return AttentionType(attn_type) in cls.supported_attn_types

    @classmethod
    def supports_device(cls, device: DeviceInfo) -> bool:
        return device.type in cls.supported_device_types

    @classmethod
    def supports_compute_capability(cls, capability: tuple[int, int]) -> bool:
        return cls.min_compute_capability is None or capability >= cls.min_compute_capability

    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def get_supported_mla_splits(cls) -> list[tuple[int, int]]:
        """MLA backends: the `(kv_lora_rank, qk_rope_head_dim)` latent splits the kernels take;
        empty means any."""
        return []

    @classmethod
    def supports_mla_split(cls, kv_lora_rank: int, qk_rope_head_dim: int) -> bool:
        splits = cls.get_supported_mla_splits()
        return not splits or (kv_lora_rank, qk_rope_head_dim) in splits

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    # A backend whose answer depends on more (the installed package) overrides the classmethod.
    supports_sink = _feature_check("sink", "per-head attention sinks")
    supports_sliding_window = _feature_check("sliding_window", "a sliding window")
    supports_alibi = _feature_check("alibi", "ALiBi position biases")
    supports_logits_soft_cap = _feature_check("logits_soft_cap", "a soft cap on the logits")
    supports_non_causal = _feature_check(
        "non_causal", "bidirectional attention in the paged-KV decoder path"
    )
    supports_per_head_quant_scales = _feature_check(
        "per_head_quant_scales", "per-head fp8 K/V scales"
    )
    supports_batch_invariance = _feature_check("batch_invariance", "batch-invariant results")
    supports_lse = _feature_check("lse", "filling `output_lse` in `forward` when it is given")
    supports_cascade = _feature_check(
        "cascade", "running a shared prefix once (`use_cascade_attention`)"
    )

    @classmethod
    def supports_combination(
        cls, config: AttentionSelectorConfig, device: DeviceInfo
    ) -> str | None:
        """A reason for a joint constraint the single checks above cannot express, or None."""
        return None

    @classmethod
    def get_cudagraph_support(
        cls, kv_cache_spec: AttentionSpec | None = None, limits: BatchLimits | None = None
    ) -> AttentionCGSupport:
        return cls.get_builder_cls().get_cudagraph_support(kv_cache_spec, limits)

    @classmethod
    def chosen_automatically(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> bool:
        """Whether the selector may pick this backend for `config` on `device` without an
        explicit request (where `priority` ranks it); explicit requests ignore this."""
        return True

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine (e.g. a missing package and the pip
        command that installs it), or None when it can."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        return cls.get_unavailable_reason() is None

    @classmethod
    def validate_configuration(
        cls, config: AttentionSelectorConfig, device: DeviceInfo
    ) -> list[str]:
        """Every reason this backend cannot serve `config` on `device`; empty means usable.

        Judges declared capabilities only; availability on this machine is separate
        (`get_unavailable_reason`), so one can ask about hardware one does not have.
        """
        reasons: list[str] = []
        if not cls.supports_device(device):
            reasons.append(
                f"device {device.type} not supported (supported: "
                f"{', '.join(cls.supported_device_types)})"
            )
        elif device.capability and not cls.supports_compute_capability(device.capability):
            need = cls.min_compute_capability
            need = f" (needs {_sm(need)} or newer)" if need else ""
            reasons.append(f"compute capability {_sm(device.capability)} not supported{need}")
        if not cls.supports_head_size(config.head_size):
            sizes = ", ".join(str(s) for s in cls.get_supported_head_sizes())
            reasons.append(f"head_size {config.head_size} not supported (supported: {sizes})")
        if not cls.supports_dtype(config.dtype):
            names = ", ".join(_dtype_name(d) for d in cls.supported_dtypes)
            reasons.append(f"dtype {_dtype_name(config.dtype)} not supported (supported: {names})")
        if not cls.supports_kv_cache_dtype(config.kv_cache_dtype):
            names = ", ".join(cls.supported_kv_cache_dtypes)
            reasons.append(
                f"kv_cache_dtype {config.kv_cache_dtype} not supported (supported: {names})"
            )
        if not cls.supports_block_size(config.block_size):
            sizes = _format_block_sizes(cls.get_supported_kernel_block_sizes())
            reasons.append(
                f"block_size {config.block_size} not supported (kernel block sizes: {sizes})"
            )
        if not cls.supports_attn_type(config.attn_type):
            names = ", ".join(t.value for t in cls.supported_attn_types)
            reasons.append(f"attn_type {config.attn_type.value} not supported (supported: {names})")
        if config.use_mla != cls.is_mla():
            reasons.append("MLA (use_mla) not supported" if config.use_mla else "MLA-only backend")
        elif config.use_mla:
            reasons.extend(mla_reasons(cls, config))
        if config.use_sparse and not cls.is_sparse():
            reasons.append("sparse attention (use_sparse) not supported")
        elif cls.is_sparse() and not config.use_sparse:
            reasons.append("sparse-only backend")
        for feature, flag, label in CONFIG_FEATURES:
            if getattr(config, flag) and not getattr(cls, f"supports_{feature}")():
                reasons.append(f"{label} ({flag}) not supported")
        if config.use_per_head_quant_scales and not is_fp8_cache(config.kv_cache_dtype):
            reasons.append("per-head quant scales need an fp8 kv_cache_dtype")
        # The window is defined causally (keys p - W < j <= p): no bidirectional window.
        if config.has_sliding_window and (
            config.use_non_causal or config.attn_type != AttentionType.DECODER
        ):
            reasons.append("sliding window with non-causal or encoder attention not supported")
        combination = cls.supports_combination(config, device)
        return reasons if combination is None else [*reasons, combination]

    @classmethod
    def describe(cls) -> dict[str, object]:
        """Everything this backend declares, as plain data (for `anyattn backends --json`)."""
        features = {f: getattr(cls, f"supports_{f}")() for f in _FEATURE_NAMES}
        features.update(mla=cls.is_mla(), sparse=cls.is_sparse())
        splits = cls.get_supported_mla_splits()
        capability = cls.min_compute_capability
        return {
            "name": cls.get_name(),
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "available": cls.is_available(),
            "unavailable_reason": cls.get_unavailable_reason(),
            "devices": list(cls.supported_device_types),
            "min_compute_capability": _sm(capability) if capability else None,
            "dtypes": [_dtype_name(d) for d in cls.supported_dtypes],
            "kv_cache_dtypes": list(cls.supported_kv_cache_dtypes),
            "head_sizes": cls.get_supported_head_sizes() or "any",
            "block_sizes": [str(s) for s in cls.get_supported_kernel_block_sizes()],
            "kv_cache_layouts": [str(x) for x in cls.supported_kv_cache_layouts()],
            "attn_types": [t.value for t in cls.supported_attn_types],
            "features": features,
            "mla_splits": (format_mla_splits(splits) or "any") if cls.is_mla() else None,
            "cudagraph_support": cls.get_cudagraph_support().name,
            "forward_includes_kv_cache_update": cls.forward_includes_kv_cache_update,
            "priority": dict(cls.priority),
        }
