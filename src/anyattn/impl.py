"""The impl side of the contract: one instance per layer, `forward` runs its attention.

`AttentionImpl.__init__` is shared: it checks every argument against the backend's
declarations once (`anyattn.impl_args`) and keeps them in one form; an impl that needs more
calls `super().__init__` first. `layer_params()` is the record its builder gets. `forward`
reads only what the builder built for the step: it never plans and never writes into the
metadata. `MLAAttentionImpl` (`anyattn.mla_impl`) is the MLA variant.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

import torch

from anyattn.impl_args import validate_impl_arguments
from anyattn.layer_params import LayerParams
from anyattn.types import AttentionType
from anyattn.validation import check_kv_write

if TYPE_CHECKING:
    from anyattn.declarations import AttentionBackend

__all__ = ["AttentionImpl", "AttentionImplBase", "AttentionLayer"]

M = TypeVar("M")


class AttentionLayer(Protocol):
    """What an impl may read from the layer that calls it."""

    layer_name: str
    k_scale: torch.Tensor  # float32, shape [] or [num_kv_heads]; fp8 caches only
    v_scale: torch.Tensor


class AttentionImplBase(ABC, Generic[M]):
    """What standard and MLA impls share: their backend and the LSE base they return."""

    # The backend whose declarations this impl is checked against (set in the backend's module
    # once both classes exist).
    backend: ClassVar[type[AttentionBackend]]
    # Base of returned LSEs: True = natural log, False = log2. Merging with the wrong base
    # silently corrupts the combined softmax denominator.
    lse_base_on_e: ClassVar[bool] = True
    # The per-layer record type builders receive (`layer_params()`).
    params_cls: ClassVar[type[LayerParams]] = LayerParams

    num_heads: int
    head_size: int
    scale: float

    @classmethod
    def _declared_backend(cls, kind: str = "AttentionBackend") -> type[AttentionBackend]:
        """`cls.backend`; a `TypeError` asking for a `kind` subclass when the class names none."""
        backend = getattr(cls, "backend", None)
        if backend is None:
            raise TypeError(
                f"{cls.__name__}: an impl class must name its backend (set "
                f"{cls.__name__}.backend = <{kind} subclass>)."
            )
        return backend


class AttentionImpl(AttentionImplBase[M], Generic[M]):
    """A standard (non-MLA) attention impl; one instance per layer."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | torch.Tensor | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: AttentionType | str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Check the arguments against `self.backend` and keep them.

        Kept: `num_heads, num_kv_heads, head_size, scale` (float), `kv_cache_dtype`,
        `attn_type` (`AttentionType`), `sliding_window` and `logits_soft_cap` (None for 0 or
        None), `alibi_slopes` (float32 CPU tensor `[num_heads]` or None), `sinks` (tensor
        `[num_heads]` or None), `kv_sharing_target_layer_name`.

        Raises:
            ValueError, TypeError: a malformed argument.
            NotImplementedError: a feature the backend does not declare, or a joint rule
                broken (a sliding window needs causal decoder attention).
        """
        sliding_window = sliding_window or None
        self.num_kv_heads = validate_impl_arguments(
            self._declared_backend(),
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
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, AttentionType(attn_type)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window, self.sinks = sliding_window, sinks
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.alibi_slopes = None
        if alibi_slopes is not None:
            slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32)
            self.alibi_slopes = slopes.detach().cpu().flatten()

    def layer_params(self) -> LayerParams:
        """This layer's record for its builder: `params_cls` of the kept attributes. An impl
        whose `params_cls` adds fields (given defaults) overrides it as
        `dataclasses.replace(super().layer_params(), extra=...)`."""
        return self.params_cls(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            scale=self.scale,
            attn_type=self.attn_type,
            kv_cache_dtype=self.kv_cache_dtype,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            has_alibi=self.alibi_slopes is not None,
            has_sinks=self.sinks is not None,
        )

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
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one layer for one step.

        Args:
            layer: the calling layer (`layer_name`; `k_scale`, `v_scale` for fp8 caches).
            query: `[num_tokens, num_heads, head_size]`, model dtype.
            key, value: `[num_tokens, num_kv_heads, head_size]` (cross-attention: the encoder
                tokens being written this step, or None when none are).
            kv_cache: the layer's cache in the backend's logical shape.
            attn_metadata: what this backend's builder built for the step (read only).
            output: `[num_tokens, num_heads, head_size]`; rows `[:num_actual_tokens]` are
                written, the rest untouched.
            output_lse: float32 `[num_heads, num_tokens]` to receive each row's log-sum-exp.

        Returns:
            `output`.

        Raises:
            ValueError: `layer` is not one of the builder's layers (`check_layer_planned`).
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
        """Raise a clear error for inputs `forward` would reject (host checks only), before
        anything is written (`anyattn.validation.check_layer_call`, `check_forward`). The
        default checks nothing; impls override it."""

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
        `anyattn.validation.check_kv_write`. With the step's `attn_metadata` the slots and
        block table are checked from its CPU mirrors; without it a device `slot_mapping` is
        read back. Layers that share another layer's KV cache write nothing."""
        if self.kv_sharing_target_layer_name is not None:
            return
        from anyattn.ops.reshape_and_cache import reshape_and_cache_unchecked

        args = check_kv_write(self, layer, key, value, kv_cache, slot_mapping, attn_metadata)
        reshape_and_cache_unchecked(key, value, kv_cache, slot_mapping, *args)
