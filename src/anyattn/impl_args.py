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

from anyattn.types import AttentionType, cache_torch_dtype, parse_cache_dtype

if TYPE_CHECKING:
    from anyattn.backend import AttentionBackend, AttentionImpl

__all__ = ["check_forward_inputs", "layer_kv_scale", "validate_impl_arguments"]


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
            f"{api}: attn_type not supported (got {attn_type.value}, expected one of "
            f"{', '.join(t.value for t in backend.supported_attn_types)}). "
            + _pick_another(f"--attn-type {attn_type.value}")
        )
    if alibi_slopes is not None:
        if not backend.supports_alibi():
            count = (
                f"{_num_slopes(alibi_slopes)} alibi_slopes"
                if isinstance(alibi_slopes, Sequence | torch.Tensor)
                else f"alibi_slopes of type {type(alibi_slopes).__name__}"
            )
            raise _undeclared(api, "ALiBi", count, "None", "--has-alibi")
        if not isinstance(alibi_slopes, Sequence | torch.Tensor):
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
            raise _undeclared(
                api,
                "sliding window",
                f"sliding_window={sliding_window!r}",
                "None",
                "--has-sliding-window",
            )
        if attn_type != AttentionType.DECODER:
            # DESIGN.md defines the window causally (p - W < j <= p).
            raise NotImplementedError(
                f"{api}: sliding window with {attn_type.value} attention not supported (got "
                f"sliding_window={sliding_window!r}, expected None; the window is defined "
                f"causally). Pass sliding_window=None for {attn_type.value} layers."
            )
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
            raise _undeclared(
                api,
                "logits soft cap",
                f"logits_soft_cap={logits_soft_cap!r}",
                "None or 0",
                "--has-logits-soft-cap",
            )
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


def check_forward_inputs(
    api: str,
    impl: AttentionImpl,
    supported_dtypes: tuple[torch.dtype, ...],
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    *,
    block_size: int,
    num_actual_tokens: int,
    output: torch.Tensor,
    output_lse: torch.Tensor | None,
    reads_cache: bool = True,
) -> None:
    """Shapes, dtypes and devices of one `forward` call's tensors, checked before anything is
    written (the shared part of every impl's `validate_inputs`).

    Args:
        api: names the caller in messages, e.g. "TRITON forward".
        impl: the impl (`num_heads`, `head_size`, `num_kv_heads`, `kv_cache_dtype`,
            `attn_type`).
        supported_dtypes: query dtypes the backend takes.
        query, key, value, kv_cache, output, output_lse: `forward`'s arguments.
        block_size: tokens per block of the step's block table.
        num_actual_tokens: real tokens of the step.
        reads_cache: False for attention that takes K/V only from its inputs (encoder).

    Raises:
        ValueError: the first mismatch, naming the argument, what was given and expected.
    """
    heads = (impl.num_heads, impl.head_size)
    if query.dim() != 3 or tuple(query.shape[1:]) != heads:
        raise ValueError(
            f"{api}: query must be [num_tokens, {heads[0]}, {heads[1]}] (got {tuple(query.shape)})."
        )
    if query.dtype not in supported_dtypes:
        raise ValueError(
            f"{api}: query dtype not supported (got {query.dtype}, expected one of "
            f"{', '.join(str(d).removeprefix('torch.') for d in supported_dtypes)})."
        )
    if output.shape != query.shape or output.dtype != query.dtype:
        raise ValueError(
            f"{api}: output must match query in shape and dtype (got {tuple(output.shape)} "
            f"{output.dtype}, expected {tuple(query.shape)} {query.dtype})."
        )
    if num_actual_tokens > query.shape[0]:
        raise ValueError(
            f"{api}: query has fewer rows than the metadata's tokens (got {query.shape[0]}, "
            f"expected >= {num_actual_tokens})."
        )
    if (key is None) != (value is None):
        raise ValueError(f"{api}: key and value must both be given or both be None.")
    kv_shape = (impl.num_kv_heads, impl.head_size)
    for name, tensor in (("key", key), ("value", value)):
        if tensor is None:
            continue
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != kv_shape:
            raise ValueError(
                f"{api}: {name} must be [num_tokens, {kv_shape[0]}, {kv_shape[1]}] (got "
                f"{tuple(tensor.shape)})."
            )
        if tensor.dtype != query.dtype:
            raise ValueError(
                f"{api}: {name} dtype differs from query (got {tensor.dtype}, expected "
                f"{query.dtype})."
            )
        if impl.attn_type != AttentionType.ENCODER_DECODER and tensor.shape[0] != query.shape[0]:
            raise ValueError(
                f"{api}: {name} and query differ in tokens (got {tensor.shape[0]} and "
                f"{query.shape[0]})."
            )
    if not reads_cache:
        if key is None:
            raise ValueError(f"{api}: {impl.attn_type.value} attention needs key and value.")
    else:
        cache_dtype = cache_torch_dtype(impl.kv_cache_dtype, query.dtype)
        expected = ("num_blocks", 2, block_size, *kv_shape)
        if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != expected[1:]:
            raise ValueError(
                f"{api}: kv_cache must be {list(expected)} (got {tuple(kv_cache.shape)}). "
                "Allocate it with anyattn.kv_cache.allocate_kv_cache."
            )
        if kv_cache.dtype != cache_dtype:
            raise ValueError(
                f"{api}: kv_cache dtype does not match kv_cache_dtype "
                f"{impl.kv_cache_dtype!r} (got {kv_cache.dtype}, expected {cache_dtype})."
            )
        if kv_cache.device != query.device:
            raise ValueError(
                f"{api}: kv_cache and query are on different devices (got {kv_cache.device} "
                f"and {query.device})."
            )
    if output_lse is not None and (
        output_lse.dtype != torch.float32
        or output_lse.dim() != 2
        or output_lse.shape[0] != impl.num_heads
        or output_lse.shape[1] < num_actual_tokens
    ):
        raise ValueError(
            f"{api}: output_lse must be float32 [{impl.num_heads}, num_tokens] (got "
            f"{output_lse.dtype} {tuple(output_lse.shape)})."
        )


def layer_kv_scale(
    api: str, layer: object, name: str, num_kv_heads: int, device: torch.device
) -> torch.Tensor:
    """`layer.k_scale` or `layer.v_scale` of an fp8 cache as float32 on `device`.

    Raises:
        ValueError: missing, or not of shape `[]`, `[1]` or `[num_kv_heads]`.
    """
    scale = getattr(layer, name, None)
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) not in ((), (1,), (num_kv_heads,)):
        got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(
            f"{api}: layer.{name} must be a float32 tensor of shape [] or [{num_kv_heads}] "
            f"for an fp8 KV cache (got {got})."
        )
    if scale.device != device or scale.dtype != torch.float32:
        scale = scale.to(device=device, dtype=torch.float32)
    return scale


def _num_slopes(alibi_slopes: Sequence | torch.Tensor) -> int:
    """Slopes in a list or a tensor of any rank (a 0-d tensor has no `len`)."""
    return alibi_slopes.numel() if isinstance(alibi_slopes, torch.Tensor) else len(alibi_slopes)
