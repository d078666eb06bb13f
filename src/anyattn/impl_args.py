"""The checks of an impl's constructor: arguments against the backend's declarations and the
contract's joint rules. A feature the backend does not declare raises here, at construction,
never on the first forward (a call's inputs: `anyattn.validation`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from anyattn.declarations import format_mla_splits
from anyattn.types import AttentionType, check_positive_int, parse_cache_dtype

if TYPE_CHECKING:
    from anyattn.declarations import AttentionBackend

__all__ = ["validate_impl_arguments", "validate_mla_impl_arguments"]


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
    """Check an impl's constructor arguments against `backend`'s declarations and the joint
    rules (a sliding window needs decoder attention). Returns the effective `num_kv_heads`."""
    api = f"{backend.get_name()} impl"
    check_positive_int(api, "num_heads", num_heads)
    check_positive_int(api, "head_size", head_size)
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_positive_int(api, "num_kv_heads", kv_heads)
    if num_heads % kv_heads:
        raise ValueError(
            f"{api}: num_heads must be a multiple of num_kv_heads (got num_heads={num_heads}, "
            f"num_kv_heads={kv_heads})."
        )
    _check_scale(api, scale)
    if not backend.supports_head_size(head_size):
        raise ValueError(
            f"{api}: head_size not supported (got {head_size}, expected one of "
            f"{backend.get_supported_head_sizes()})."
        )
    _check_kv_cache_dtype(api, backend, kv_cache_dtype)
    try:
        attn_type = AttentionType(attn_type)
    except ValueError:
        raise ValueError(
            f"{api}: unknown attn_type (got {attn_type!r}, expected one of "
            f"{', '.join(t.value for t in AttentionType)})."
        ) from None
    if not backend.supports_attn_type(attn_type):
        raise NotImplementedError(
            f"{api}: attn_type not supported (got {attn_type.value}, expected one of "
            f"{', '.join(t.value for t in backend.supported_attn_types)}). "
            + _pick_another(f"--attn-type {attn_type.value}")
        )
    if alibi_slopes is not None:
        is_slopes = isinstance(alibi_slopes, Sequence | torch.Tensor)
        if not backend.supports_alibi():
            count = f"{_num_slopes(alibi_slopes)} alibi_slopes" if is_slopes else None
            count = count or f"alibi_slopes of type {type(alibi_slopes).__name__}"
            raise _undeclared(api, "ALiBi", count, "None", "--has-alibi")
        if not is_slopes:
            raise TypeError(
                f"{api}: alibi_slopes must be a list of floats or a tensor (got "
                f"{type(alibi_slopes).__name__})."
            )
        if _num_slopes(alibi_slopes) != num_heads:
            raise ValueError(
                f"{api}: alibi_slopes needs one slope per query head (got "
                f"{_num_slopes(alibi_slopes)}, expected {num_heads})."
            )
    if sliding_window is not None:
        if not backend.supports_sliding_window():
            got = f"sliding_window={sliding_window!r}"
            raise _undeclared(api, "sliding window", got, "None", "--has-sliding-window")
        if attn_type != AttentionType.DECODER:
            # The window is defined causally (keys p - W < j <= p).
            raise NotImplementedError(
                f"{api}: sliding window with {attn_type.value} attention not supported (got "
                f"sliding_window={sliding_window!r}, expected None; the window is defined "
                f"causally). Pass sliding_window=None for {attn_type.value} layers."
            )
        check_positive_int(api, "sliding_window", sliding_window, allow_none=True)
    if logits_soft_cap is not None and not isinstance(logits_soft_cap, numbers.Real):
        raise TypeError(
            f"{api}: logits_soft_cap must be a float or None (got "
            f"{type(logits_soft_cap).__name__})."
        )
    if logits_soft_cap is not None and logits_soft_cap != 0:
        if not backend.supports_logits_soft_cap():
            got = f"logits_soft_cap={logits_soft_cap!r}"
            raise _undeclared(api, "logits soft cap", got, "None or 0", "--has-logits-soft-cap")
        if not math.isfinite(logits_soft_cap) or logits_soft_cap < 0:
            raise ValueError(
                f"{api}: logits_soft_cap must be a positive float (got {logits_soft_cap!r})."
            )
    if sinks is not None:
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        if not backend.supports_sink():
            got = f"sinks of {'shape' if isinstance(sinks, torch.Tensor) else 'type'} {shape}"
            raise _undeclared(api, "attention sinks", got, "None", "--has-sink")
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,):
            raise ValueError(
                f"{api}: sinks must be a tensor of shape [num_heads] (got {shape}, expected "
                f"({num_heads},))."
            )
    return kv_heads


def validate_mla_impl_arguments(
    backend: type[AttentionBackend],
    *,
    num_heads: int,
    scale: float,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    kv_cache_dtype: str,
    workspace_tokens: int,
) -> None:
    """Check an MLA impl's constructor arguments against `backend`'s declarations: sizes
    positive, the latent row `kv_lora_rank + qk_rope_head_dim` a head size and a split the
    backend declares, the KV-cache dtype one it takes."""
    api = f"{backend.get_name()} impl"
    if not backend.is_mla():
        raise TypeError(
            f"{api}: an MLA impl needs an MLA backend (got {backend.get_name()}, which declares "
            "is_mla() False). Set the impl's backend to an MLAAttentionBackend subclass."
        )
    sizes = {
        "num_heads": num_heads, "kv_lora_rank": kv_lora_rank,
        "qk_rope_head_dim": qk_rope_head_dim, "qk_nope_head_dim": qk_nope_head_dim,
        "v_head_dim": v_head_dim, "workspace_tokens": workspace_tokens,
    }  # fmt: skip
    for name, value in sizes.items():
        check_positive_int(api, name, value)
    _check_scale(api, scale)
    head_size = kv_lora_rank + qk_rope_head_dim
    if not backend.supports_head_size(head_size):
        raise ValueError(
            f"{api}: latent row size kv_lora_rank + qk_rope_head_dim not supported (got "
            f"{kv_lora_rank} + {qk_rope_head_dim} = {head_size}, expected one of "
            f"{backend.get_supported_head_sizes()})."
        )
    if not backend.supports_mla_split(kv_lora_rank, qk_rope_head_dim):
        splits = format_mla_splits(backend.get_supported_mla_splits())
        raise ValueError(
            f"{api}: latent split not supported (got kv_lora_rank={kv_lora_rank}, "
            f"qk_rope_head_dim={qk_rope_head_dim}, expected one of {splits}). "
            + _pick_another(f"--use-mla --qk-rope-head-dim {qk_rope_head_dim}")
        )
    _check_kv_cache_dtype(api, backend, kv_cache_dtype)
    head_dims = getattr(backend, "get_mla_head_dims_reason", None)
    reason = head_dims and head_dims(qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    if reason:
        raise ValueError(
            f"{api}: {reason} (got qk_nope_head_dim={qk_nope_head_dim}, qk_rope_head_dim="
            f"{qk_rope_head_dim}, v_head_dim={v_head_dim}). Pick another backend (`anyattn "
            "explain --use-mla` with --qk-nope-head-dim and --v-head-dim lists those that "
            "support it)."
        )


def _check_scale(api: str, scale: object) -> None:
    """A positive finite real (a one-element tensor is read as its value)."""
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{api}: scale must be a positive finite float (got {scale!r}).")


def _check_kv_cache_dtype(api: str, backend: type[AttentionBackend], kv_cache_dtype: str) -> None:
    """A known KV-cache dtype that `backend` declares."""
    parse_cache_dtype(kv_cache_dtype, argument=f"{api}: kv_cache_dtype")
    if not backend.supports_kv_cache_dtype(kv_cache_dtype):
        raise ValueError(
            f"{api}: kv_cache_dtype not supported (got {kv_cache_dtype!r}, expected one of "
            f"{', '.join(backend.supported_kv_cache_dtypes)})."
        )


def _undeclared(api: str, feature: str, got: str, expected: str, flag: str) -> NotImplementedError:
    """A feature given to a backend that does not declare it: what was given, and the fix."""
    return NotImplementedError(
        f"{api}: {feature} not supported (got {got}, expected {expected}; the backend declares "
        f"no {feature} support). " + _pick_another(flag)
    )


def _pick_another(flag: str) -> str:
    return (
        f"Pick another backend (`anyattn explain --head-size N {flag}` lists those that "
        "support it)."
    )


def _num_slopes(alibi_slopes: Sequence | torch.Tensor) -> int:
    # a 0-d tensor has no `len`
    return alibi_slopes.numel() if isinstance(alibi_slopes, torch.Tensor) else len(alibi_slopes)
