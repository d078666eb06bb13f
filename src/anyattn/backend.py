"""The backend contract: what a backend declares, how its metadata is built, how it runs.

Three roles, as in vLLM v1's attention layer:

- `AttentionBackend`: a class of declarations (no instances, no device access). It names its
  impl and builder classes, the KV-cache shape and stride orders, and every capability the
  selector checks. `validate_configuration` turns those declarations into reasons.
- `AttentionMetadataBuilder`: constructed once per KV-cache group and told its layers
  (`register_layer`) at set-up; `build` turns the step's `CommonAttentionMetadata` into the
  backend's own metadata without synchronising the host with the device (it reads the CPU
  mirrors).
- `AttentionImpl`: constructed once per layer; `forward` runs the layer's attention.
  `MLAAttentionImpl` is the MLA variant (`forward_mqa` / `forward_mha`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

import numpy as np
import torch

from anyattn.impl_args import validate_impl_arguments
from anyattn.types import (
    AttentionCGSupport,
    AttentionType,
    DeviceInfo,
    KVCacheLayout,
    MultipleOf,
    is_fp8_cache,
    parse_cache_dtype,
)
from anyattn.validation import check_kv_write

if TYPE_CHECKING:
    from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits
    from anyattn.metadata import CommonAttentionMetadata

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionImplBase",
    "AttentionLayer",
    "AttentionMetadataBuilder",
    "MLAAttentionImpl",
]

M = TypeVar("M")

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _format_block_sizes(sizes: Sequence[int | MultipleOf]) -> str:
    return ", ".join(str(s) for s in sizes) if sizes else "any"


class AttentionLayer(Protocol):
    """What an impl may read from the layer that calls it."""

    layer_name: str
    k_scale: torch.Tensor  # float32, shape [] or [num_kv_heads]; fp8 caches only
    v_scale: torch.Tensor


class AttentionBackend(ABC):
    """Declarations of one attention backend. Subclasses override class attributes and methods.

    Every constraint the impl enforces must be declared here, so that the selector rejects a
    configuration up front instead of the impl failing on the first forward.
    """

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "float16", "bfloat16")
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    supported_attn_types: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)
    # Lowest CUDA compute capability the kernels run on; None: no lower bound.
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    # When False, the layer calls impl.do_kv_cache_update before impl.forward.
    forward_includes_kv_cache_update: ClassVar[bool] = False

    # --- identity and components -------------------------------------------------------------

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """The registry name, e.g. "TORCH"."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImplBase]:
        """The impl class (`AttentionImpl` or `MLAAttentionImpl` subclass)."""

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        """The metadata builder class."""

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)

    # --- KV cache ----------------------------------------------------------------------------

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """Logical shape of one layer's KV cache.

        Default: `(num_blocks, 2, block_size, num_kv_heads, head_size)`, index 1 is K (0) / V (1).

        Raises:
            ValueError: a block size this backend's kernels cannot take, or a bad dimension.
        """
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_size", head_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{cls.get_name()}.get_kv_cache_shape: {name} must be a positive int "
                    f"(got {value!r})."
                )
        parse_cache_dtype(cache_dtype, argument=f"{cls.get_name()}.get_kv_cache_shape: cache_dtype")
        if not cls.supports_block_size(block_size):
            raise ValueError(
                f"{cls.get_name()}.get_kv_cache_shape: block_size not supported (got {block_size}, "
                f"expected {_format_block_sizes(cls.get_supported_kernel_block_sizes())})."
            )
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @classmethod
    def get_kv_cache_stride_order(
        cls, layout: KVCacheLayout | str = KVCacheLayout.NHD
    ) -> tuple[int, ...]:
        """Order in which to allocate the logical dims so that memory follows `layout`.

        Allocating `torch.empty([shape[i] for i in order])` and permuting by the inverse order
        gives a tensor of the logical shape with the strides of the layout.
        """
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
        if layout is KVCacheLayout.NHD:
            return (0, 1, 2, 3, 4)
        return (0, 1, 3, 2, 4)

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
        """An engine block size is accepted when a multiple of some kernel block size.

        When it is larger than the kernel size, the runner splits each engine block into
        `block_size // kernel_block_size` kernel blocks (see `metadata.expand_block_table`).
        """
        if block_size is None:
            return True
        sizes = cls.get_supported_kernel_block_sizes()
        if not sizes:
            return True
        return any(block_size % (s.base if isinstance(s, MultipleOf) else s) == 0 for s in sizes)

    @classmethod
    def get_kernel_block_size(cls, block_size: int) -> int:
        """The kernel block size used for engine blocks of `block_size` (the largest that fits)."""
        fitting = [
            block_size if isinstance(s, MultipleOf) else s
            for s in cls.get_supported_kernel_block_sizes()
            if block_size % (s.base if isinstance(s, MultipleOf) else s) == 0
        ]
        if not fitting:
            raise ValueError(
                f"{cls.get_name()}: block_size not supported (got {block_size}, expected "
                f"{_format_block_sizes(cls.get_supported_kernel_block_sizes())})."
            )
        return max(fitting)

    @classmethod
    def check_kv_cache_spec(cls, spec: AttentionSpec, api: str) -> None:
        """Refuse a builder's spec the kernels do not take, at the builder's construction
        rather than at its first plan or forward: `spec.block_size` is a kernel block size
        (engine blocks are split before a builder sees them), so it must be one exactly.

        Raises:
            ValueError: naming the field, its value and what the backend declares.
        """
        name = cls.get_name()
        checks = (
            (
                "block_size",
                spec.block_size,
                cls.supports_block_size(spec.block_size)
                and cls.get_kernel_block_size(spec.block_size) == spec.block_size,
                _format_block_sizes(cls.get_supported_kernel_block_sizes()),
            ),
            (
                "head_size",
                spec.head_size,
                cls.supports_head_size(spec.head_size),
                ", ".join(str(s) for s in cls.get_supported_head_sizes()) or "any",
            ),
            (
                "dtype",
                _dtype_name(spec.dtype),
                cls.supports_dtype(spec.dtype),
                ", ".join(_dtype_name(d) for d in cls.supported_dtypes),
            ),
            (
                "kv_cache_dtype",
                spec.kv_cache_dtype,
                cls.supports_kv_cache_dtype(spec.kv_cache_dtype),
                ", ".join(cls.supported_kv_cache_dtypes),
            ),
        )
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
        return min(s.base if isinstance(s, MultipleOf) else s for s in sizes)

    # --- capabilities ------------------------------------------------------------------------

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
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_alibi(cls) -> bool:
        return False

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        """Bidirectional attention in the paged-KV decoder path (not the encoder types)."""
        return False

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_lse(cls) -> bool:
        """`forward` fills `output_lse` when it is given."""
        return False

    @classmethod
    def supports_cascade(cls) -> bool:
        """The builder can run a shared prefix once (`use_cascade_attention`)."""
        return False

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

    # --- availability ------------------------------------------------------------------------

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine (e.g. a missing package and the pip
        command that installs it), or None when it can."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        return cls.get_unavailable_reason() is None

    # --- the verdict -------------------------------------------------------------------------

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
        elif device.capability is not None and not cls.supports_compute_capability(
            device.capability
        ):
            major, minor = device.capability
            need = ""
            if cls.min_compute_capability is not None:
                need_major, need_minor = cls.min_compute_capability
                need = f" (needs sm{need_major}{need_minor} or newer)"
            reasons.append(f"compute capability sm{major}{minor} not supported{need}")
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
        if config.use_sparse != cls.is_sparse():
            reasons.append(
                "sparse attention (use_sparse) not supported"
                if config.use_sparse
                else "sparse-only backend"
            )
        features = (
            (config.has_sink, cls.supports_sink, "attention sinks (has_sink)"),
            (config.has_sliding_window, cls.supports_sliding_window,
             "sliding window (has_sliding_window)"),
            (config.has_alibi, cls.supports_alibi, "ALiBi (has_alibi)"),
            (config.has_logits_soft_cap, cls.supports_logits_soft_cap,
             "logits soft cap (has_logits_soft_cap)"),
            (config.use_non_causal, cls.supports_non_causal,
             "non-causal decoder attention (use_non_causal)"),
            (config.use_per_head_quant_scales, cls.supports_per_head_quant_scales,
             "per-head quant scales (use_per_head_quant_scales)"),
            (config.use_batch_invariant, cls.supports_batch_invariance,
             "batch invariance (use_batch_invariant)"),
            (config.needs_lse, cls.supports_lse, "returning LSE (needs_lse)"),
        )  # fmt: skip
        for wanted, supported, label in features:
            if wanted and not supported():
                reasons.append(f"{label} not supported")
        if config.use_per_head_quant_scales and not is_fp8_cache(config.kv_cache_dtype):
            reasons.append("per-head quant scales need an fp8 kv_cache_dtype")
        combination = cls.supports_combination(config, device)
        if combination is not None:
            reasons.append(combination)
        return reasons

    @classmethod
    def describe(cls) -> dict[str, object]:
        """Everything this backend declares, as plain data (for `anyattn backends --json`)."""
        features = {
            "sink": cls.supports_sink(),
            "sliding_window": cls.supports_sliding_window(),
            "alibi": cls.supports_alibi(),
            "logits_soft_cap": cls.supports_logits_soft_cap(),
            "non_causal": cls.supports_non_causal(),
            "per_head_quant_scales": cls.supports_per_head_quant_scales(),
            "batch_invariance": cls.supports_batch_invariance(),
            "lse": cls.supports_lse(),
            "cascade": cls.supports_cascade(),
            "mla": cls.is_mla(),
            "sparse": cls.is_sparse(),
        }
        capability = cls.min_compute_capability
        return {
            "name": cls.get_name(),
            "class": ".".join(cls.full_cls_name()),
            "available": cls.is_available(),
            "unavailable_reason": cls.get_unavailable_reason(),
            "devices": list(cls.supported_device_types),
            "min_compute_capability": (
                f"sm{capability[0]}{capability[1]}" if capability is not None else None
            ),
            "dtypes": [_dtype_name(d) for d in cls.supported_dtypes],
            "kv_cache_dtypes": list(cls.supported_kv_cache_dtypes),
            "head_sizes": cls.get_supported_head_sizes() or "any",
            "block_sizes": [str(s) for s in cls.get_supported_kernel_block_sizes()],
            "kv_cache_layouts": [str(x) for x in cls.supported_kv_cache_layouts()],
            "attn_types": [t.value for t in cls.supported_attn_types],
            "features": features,
            "cudagraph_support": cls.get_cudagraph_support().name,
            "forward_includes_kv_cache_update": cls.forward_includes_kv_cache_update,
        }


class AttentionImplBase(ABC, Generic[M]):
    """Attributes shared by standard and MLA impls.

    Context-parallel placement (`dcp_world_size`, ...) is set by the engine after construction
    when it uses context parallelism; an impl never looks it up from global state.
    """

    # The impl can return the softmax LSE of decode rows (needed by decode context parallel).
    can_return_lse_for_decode: ClassVar[bool] = False
    # Base of returned LSEs: True = natural log, False = log2. Merging with the wrong base
    # silently corrupts the combined softmax denominator.
    lse_base_on_e: ClassVar[bool] = True
    supports_pcp: ClassVar[bool] = False
    supports_dcp: ClassVar[bool] = False
    # The layer may hand `forward` an already-quantised query.
    supports_quant_query_input: ClassVar[bool] = False

    dcp_world_size: int = 1
    dcp_rank: int = 0
    pcp_world_size: int = 1
    pcp_rank: int = 0

    num_heads: int
    head_size: int
    scale: float

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Hook run once after the model's weights are loaded."""


class AttentionImpl(AttentionImplBase[M], Generic[M]):
    """A standard (non-MLA) attention impl; one instance per layer."""

    kv_cache_dtype: str
    kv_sharing_target_layer_name: str | None

    @abstractmethod
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: AttentionType | str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None: ...

    def init_common_arguments(
        self,
        backend: type[AttentionBackend],
        *,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: AttentionType | str,
        kv_sharing_target_layer_name: str | None,
        sinks: torch.Tensor | None,
    ) -> None:
        """The first step of every impl's `__init__`: check the constructor arguments against
        `backend`'s declarations (`validate_impl_arguments`) and keep the ones every impl uses:
        `num_heads, num_kv_heads, head_size, scale, kv_cache_dtype, attn_type,
        kv_sharing_target_layer_name, sliding_window, logits_soft_cap` (None when 0 or None).
        ALiBi slopes and sinks are the impl's to keep, in the form its kernel wants.
        """
        self.num_kv_heads = validate_impl_arguments(
            backend,
            num_heads=num_heads,
            head_size=head_size,
            scale=scale,
            num_kv_heads=num_kv_heads,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=logits_soft_cap,
            attn_type=attn_type,
            sinks=sinks,
        )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = AttentionType(attn_type)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = sliding_window
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: M,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer for one step.

        Args:
            layer: the calling layer (`k_scale`, `v_scale` for fp8 caches).
            query: `[num_tokens, num_heads, head_size]`, model dtype.
            key, value: `[num_tokens, num_kv_heads, head_size]` (cross-attention: the encoder
                tokens being written this step, or None when none are).
            kv_cache: the layer's cache in the backend's logical shape.
            attn_metadata: what this backend's builder built for the step.
            output: `[num_tokens, num_heads, head_size]`; rows `[:num_actual_tokens]` are
                written, the rest untouched.
            output_scale, output_block_scale: fused output quantisation (unsupported unless
                the impl says otherwise).
            output_lse: float32 `[num_heads, num_tokens]` to receive each row's log-sum-exp.

        Returns:
            `output`.
        """

    def validate_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: M,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """Raise a clear error for inputs `forward` would reject (host checks only).

        `anyattn.validation.check_layer_call` calls it before `do_kv_cache_update`, so that a
        rejected call writes nothing; `forward` through `anyattn.validation.check_forward`.
        The default checks nothing; impls override it.
        """

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        attn_metadata: object = None,
    ) -> None:
        """Write new K/V into the paged cache (`slot_mapping` -1 entries are skipped), after
        `anyattn.validation.check_kv_write`. Pass the step's `attn_metadata` (what `forward`
        gets): the slots and block table are then checked from its CPU mirrors before the
        write; without it a device `slot_mapping` is read back to be checked.

        Layers that share another layer's KV cache write nothing.
        """
        if self.kv_sharing_target_layer_name is not None:
            return
        from anyattn.ops.reshape_and_cache import reshape_and_cache_unchecked

        args = check_kv_write(self, layer, key, value, kv_cache, slot_mapping, attn_metadata)
        reshape_and_cache_unchecked(key, value, kv_cache, slot_mapping, *args)


class MLAAttentionImpl(AttentionImplBase[M], Generic[M]):
    """Multi-head latent attention: the cache holds one compressed latent per token."""

    @abstractmethod
    def forward_mqa(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: M,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode path: queries absorbed into latent space attend to the latent cache.

        Returns `(output, lse)`; lse may be None when not requested.
        """

    @abstractmethod
    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: M,
        k_scale: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """Prefill path: latents are up-projected to full K/V and attended densely."""


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns the step's `CommonAttentionMetadata` into one backend's metadata.

    Constructed once per KV-cache group as `Builder(kv_cache_spec, layer_names, limits, device)`;
    the engine then hands it each of those layers' impls (`register_layer`), once, before the
    first `build`. `build` must not synchronise with the device: read `*_cpu` mirrors, never
    `.item()`. The metadata it builds carries the step's `slot_mapping` (the layer writes K/V
    with it).
    """

    # Use get_cudagraph_support(), which may refine this per spec.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Query length at or below which a request counts as a decode and is moved to the front
    # of the batch; None: this builder does not ask for reordering.
    reorder_batch_threshold: int | None = None
    supports_update_block_table: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        limits: BatchLimits,
        device: torch.device,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = list(layer_names)
        self.limits = limits
        self.device = torch.device(device)

    @classmethod
    def get_cudagraph_support(
        cls, kv_cache_spec: AttentionSpec | None = None, limits: BatchLimits | None = None
    ) -> AttentionCGSupport:
        """How much of a step this builder's metadata lets the engine capture in a graph."""
        return cls._cudagraph_support

    def _init_reorder_batch_threshold(
        self, reorder_batch_threshold: int | None = 1, supports_spec_as_decode: bool = False
    ) -> None:
        """Set the decode threshold; with speculative decoding and kernels that treat a
        request's 1 + k verification tokens as a decode, widen it to 1 + k."""
        self.reorder_batch_threshold = reorder_batch_threshold
        if reorder_batch_threshold is not None and supports_spec_as_decode:
            spec_len = 1 + self.limits.num_speculative_tokens
            self.reorder_batch_threshold = max(reorder_batch_threshold, spec_len)

    def register_layer(self, impl: AttentionImplBase) -> None:
        """Learn one of the layers this builder serves, before the first `build`.

        The engine calls it once at set-up for the impl of every layer in the builder's
        KV-cache group (`layer_names`), before any `build` or CUDA-graph capture. A builder
        whose plans depend on what the KV-cache spec does not say (query heads, scale, soft
        cap: FLASHINFER plans per layer signature) uses it to plan for every layer in `build`,
        so that no forward has to plan. Default: nothing to learn.

        Args:
            impl: the layer's impl, of this builder's backend.
        """

    @abstractmethod
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> M:
        """Build this backend's metadata for one step.

        Args:
            common_prefix_len: tokens at the start of every request that share the same
                KV blocks (0: no cascade); only non-zero when `use_cascade_attention` said yes.
            common_attn_metadata: the step's batch description.
            fast_build: prefer a quick build over a fast kernel (drafting).
        """

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Metadata for capturing a CUDA graph; defaults to `build` without a common prefix."""
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)

    def build_for_drafting(
        self, common_attn_metadata: CommonAttentionMetadata, draft_index: int
    ) -> M:
        """Metadata for the `draft_index`-th step of a draft model; defaults to a fast build."""
        return self.build(
            common_prefix_len=0, common_attn_metadata=common_attn_metadata, fast_build=True
        )

    def update_block_table(
        self, metadata: M, block_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> M:
        """Reuse `metadata` built for another group, swapping in this group's block table."""
        raise NotImplementedError(
            f"{type(self).__name__}.update_block_table: not supported by this builder "
            "(supports_update_block_table is False). Call build() for each KV-cache group."
        )

    def use_cascade_attention(
        self,
        common_prefix_len: int,
        query_lens: np.ndarray,
        num_query_heads: int,
        num_kv_heads: int,
        use_alibi: bool,
        use_sliding_window: bool,
        use_local_attention: bool,
        num_sms: int,
        dcp_world_size: int,
    ) -> bool:
        """Whether running the shared prefix once (cascade) pays off for this step."""
        return False
