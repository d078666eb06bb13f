"""Checks shared by every impl constructor: arguments against the backend's declarations.

Nothing is silently ignored: a feature the backend does not declare raises here, at
construction, not on the first forward.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from anyattn.types import AttentionType, parse_cache_dtype

if TYPE_CHECKING:
    from anyattn.backend import AttentionBackend

__all__ = ["validate_impl_arguments"]


def validate_impl_arguments(
    backend: type[AttentionBackend],
    *,
    num_heads: int,
    head_size: int,
    scale: float,
    num_kv_heads: int | None,
    alibi_slopes: Sequence[float] | torch.Tensor | None,
    sliding_window: int | None,
    kv_cache_dtype: str,
    logits_soft_cap: float | None,
    attn_type: AttentionType | str,
    sinks: torch.Tensor | None,
) -> int:
    """Check an impl's constructor arguments against the backend's declarations.

    Nothing is silently ignored: a feature the backend does not declare raises here, at
    construction, not on the first forward. Returns the effective `num_kv_heads`.
    """
    api = f"{backend.get_name()} impl"
    for name, value in (("num_heads", num_heads), ("head_size", head_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{api}: {name} must be a positive int (got {value!r}).")
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ValueError(f"{api}: num_kv_heads must be a positive int (got {kv_heads!r}).")
    if num_heads % kv_heads:
        raise ValueError(
            f"{api}: num_heads must be a multiple of num_kv_heads (got num_heads={num_heads}, "
            f"num_kv_heads={kv_heads})."
        )
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{api}: scale must be a positive finite float (got {scale!r}).")
    if not backend.supports_head_size(head_size):
        raise ValueError(
            f"{api}: head_size not supported (got {head_size}, expected one of "
            f"{backend.get_supported_head_sizes()})."
        )
    parse_cache_dtype(kv_cache_dtype, argument=f"{api}: kv_cache_dtype")
    if not backend.supports_kv_cache_dtype(kv_cache_dtype):
        raise ValueError(
            f"{api}: kv_cache_dtype not supported (got {kv_cache_dtype!r}, expected one of "
            f"{', '.join(backend.supported_kv_cache_dtypes)})."
        )
    try:
        attn_type = AttentionType(attn_type)
    except ValueError:
        raise ValueError(
            f"{api}: unknown attn_type (got {attn_type!r}, expected one of "
            f"{', '.join(t.value for t in AttentionType)})."
        ) from None
    if not backend.supports_attn_type(attn_type):
        raise NotImplementedError(
            f"{api}: attn_type {attn_type.value} not supported (supported: "
            f"{', '.join(t.value for t in backend.supported_attn_types)})."
        )
    if alibi_slopes is not None:
        if not backend.supports_alibi():
            raise NotImplementedError(f"{api}: ALiBi not supported (got alibi_slopes).")
        if not isinstance(alibi_slopes, Sequence | torch.Tensor):
            raise TypeError(
                f"{api}: alibi_slopes must be a list of floats or a tensor (got "
                f"{type(alibi_slopes).__name__})."
            )
        if len(alibi_slopes) != num_heads:
            raise ValueError(
                f"{api}: alibi_slopes needs one slope per query head (got {len(alibi_slopes)}, "
                f"expected {num_heads})."
            )
    if sliding_window is not None:
        if not backend.supports_sliding_window():
            raise NotImplementedError(f"{api}: sliding window not supported.")
        if (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, int)
            or (sliding_window < 1)
        ):
            raise ValueError(
                f"{api}: sliding_window must be a positive int or None (got {sliding_window!r})."
            )
    if logits_soft_cap is not None and not isinstance(logits_soft_cap, numbers.Real):
        raise TypeError(
            f"{api}: logits_soft_cap must be a float or None (got "
            f"{type(logits_soft_cap).__name__})."
        )
    if logits_soft_cap is not None and logits_soft_cap != 0:
        if not backend.supports_logits_soft_cap():
            raise NotImplementedError(f"{api}: logits soft cap not supported.")
        if not math.isfinite(logits_soft_cap) or logits_soft_cap < 0:
            raise ValueError(
                f"{api}: logits_soft_cap must be a positive float (got {logits_soft_cap!r})."
            )
    if sinks is not None:
        if not backend.supports_sink():
            raise NotImplementedError(f"{api}: attention sinks not supported.")
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,):
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(
                f"{api}: sinks must be a tensor of shape [num_heads] (got {shape}, expected "
                f"({num_heads},))."
            )
    return kv_heads
