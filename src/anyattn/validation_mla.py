"""Validation of MLA calls, on the host, before the latent cache is written: the MLA analogue
of `anyattn.validation`. `check_mla_layer_call` is what `MLAAttention.forward` runs first;
`check_mqa_inputs`, `check_mha_inputs` and `check_mla_kv_write` check an MLA impl's three
entry points, which within a checked layer call (`mla_layer_call`) check only the tensors the
layer made for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from anyattn.ops.tensor_checks import check_mla_write_args, check_scale_values
from anyattn.types import is_fp8_cache
from anyattn.validation import (
    check_cache_dtype,
    check_layer_planned,
    check_metadata_type,
    check_step_against_cache,
    check_supported_dtype,
    layer_kv_scale,
    step_of,
)

__all__ = [
    "check_mha_inputs",
    "check_mla_cache",
    "check_mla_kv_write",
    "check_mla_layer_call",
    "check_mqa_inputs",
    "check_rope_outputs",
    "mla_layer_call",
]


class MLAImpl(Protocol):
    """What the checks read of an `anyattn.mla_impl.MLAAttentionImpl`."""

    num_heads: int
    head_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    kv_cache_dtype: str
    backend: type  # its `supported_dtypes`: the model dtypes the impl takes
    metadata_cls: type


def _name(impl: MLAImpl) -> str:
    return type(impl).__name__


def check_mla_layer_call(
    impl: MLAImpl, layer: object, hidden: torch.Tensor, kv_cache: torch.Tensor,
    attn_metadata: object, *, hidden_size: int | None = None, dtype: torch.dtype | None = None,
) -> None:  # fmt: skip
    """Check one `MLAAttention` call before anything is written: the metadata (its builder's,
    built for this layer, no more tokens than `hidden` has rows), `hidden` (`hidden_size`
    columns, the layer's `dtype`, one the impl takes), the latent cache, the step against it,
    and an fp8 cache's `k_scale`; a `TypeError` or `ValueError` names the first problem."""
    api = f"{_name(impl)} (MLAAttention.forward)"
    md = _check_metadata(api, impl, layer, attn_metadata)
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"{api}: hidden must be a torch.Tensor (got {type(hidden).__name__}).")
    if hidden.dim() != 2 or hidden.shape[0] < md.num_actual_tokens:
        raise ValueError(
            f"{api}: hidden must be [num_tokens, hidden_size] with num_tokens >= the "
            f"metadata's {md.num_actual_tokens} tokens (got {tuple(hidden.shape)})."
        )
    if hidden_size is not None and hidden.shape[1] != hidden_size:
        raise ValueError(
            f"{api}: hidden must have the layer's hidden_size columns (got "
            f"{tuple(hidden.shape)}, expected [num_tokens, {hidden_size}])."
        )
    if dtype is not None and hidden.dtype != dtype:
        raise ValueError(
            f"{api}: hidden must be in the layer's dtype (got {hidden.dtype}, expected {dtype})."
        )
    check_supported_dtype(api, "hidden", hidden, impl.backend.supported_dtypes)
    check_mla_cache(api, impl, kv_cache, md, hidden.dtype, hidden.device)
    _scale(api, impl, layer, kv_cache)


@contextmanager
def mla_layer_call(
    impl: MLAImpl, layer: object, kv_cache: torch.Tensor, attn_metadata: object
) -> Iterator[None]:
    """The body of a call `check_mla_layer_call` has checked: the impl's entry points called in
    it with these objects skip the cache, step and scale checks (the write only with the
    step's own slot mapping)."""
    step = step_of(attn_metadata)
    if step is None:
        yield
        return
    step.checks.mla_call = (impl, layer, kv_cache, attn_metadata)
    try:
        yield
    finally:
        step.checks.mla_call = None


def _in_layer_call(impl: MLAImpl, layer: object, kv_cache: object, attn_metadata: object) -> bool:
    """Whether this entry point runs inside the checked layer call of these very objects."""
    step = step_of(attn_metadata)
    call = None if step is None else step.checks.mla_call
    return call is not None and all(
        a is b for a, b in zip(call, (impl, layer, kv_cache, attn_metadata), strict=True)
    )


def check_rope_outputs(
    impl: MLAImpl, result: object, num_tokens: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the layer's `rope` returned, checked to be `(q_pe [T, H, R], k_pe [T, 1, R])` in
    the model `dtype` on `device`; a `TypeError` or `ValueError` names `rope` otherwise."""
    api = f"{_name(impl)} (MLAAttention.forward)"
    heads, rope_dim = impl.num_heads, impl.qk_rope_head_dim
    expected = (
        f"(q_pe [{num_tokens}, {heads}, {rope_dim}], k_pe [{num_tokens}, 1, {rope_dim}]) in "
        f"{dtype} on {device}"
    )
    if not (
        isinstance(result, tuple | list)
        and len(result) == 2
        and all(isinstance(x, torch.Tensor) for x in result)
    ):
        got = type(result).__name__
        if isinstance(result, tuple | list):
            got = f"{got} of {', '.join(type(x).__name__ for x in result) or 'nothing'}"
        raise TypeError(f"{api}: rope must return {expected} (got {got}).")
    q_pe, k_pe = result
    shapes = ((num_tokens, heads, rope_dim), (num_tokens, 1, rope_dim))
    for x, shape in zip((q_pe, k_pe), shapes, strict=True):
        if tuple(x.shape) != shape or x.dtype != dtype or x.device != device:
            raise ValueError(
                f"{api}: rope must return {expected} (got q_pe {list(q_pe.shape)} "
                f"{q_pe.dtype} on {q_pe.device}, k_pe {list(k_pe.shape)} {k_pe.dtype} on "
                f"{k_pe.device})."
            )
    return q_pe, k_pe


def check_mla_cache(
    api: str, impl: MLAImpl, kv_cache: object, md: object, dtype: torch.dtype,
    device: torch.device,
) -> None:  # fmt: skip
    """`kv_cache` is the latent cache `(num_blocks, block_size, L + R)` of the impl's dtype on
    `device`, and the step's slots and block ids fit in it (else `TypeError` / `ValueError`)."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{api}: kv_cache must be a torch.Tensor (got {type(kv_cache).__name__}).")
    expected = ("num_blocks", md.block_size, impl.head_size)
    if kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != expected[1:]:
        raise ValueError(
            f"{api}: kv_cache must be an MLA latent cache {list(expected)} (kv_lora_rank + "
            f"qk_rope_head_dim = {impl.kv_lora_rank} + {impl.qk_rope_head_dim}) (got "
            f"{tuple(kv_cache.shape)}). Allocate it with anyattn.kv_cache.allocate_kv_cache "
            "and the layer's MLA backend."
        )
    check_cache_dtype(api, kv_cache, impl.kv_cache_dtype, dtype)
    if kv_cache.device != device:
        raise ValueError(
            f"{api}: kv_cache is on another device than the inputs (got {kv_cache.device}, "
            f"expected {device})."
        )
    step = step_of(md)
    if step is not None:
        check_step_against_cache(api, step, kv_cache)


def check_mqa_inputs(
    api: str, impl: MLAImpl, layer: object, q_latent: object, q_pe: object, kv_cache: object,
    attn_metadata: object, output: object, output_lse: object,
) -> None:  # fmt: skip
    """`forward_mqa`'s arguments: `q_latent [T_dec, H, L]`, `q_pe [T_dec, H, R]`, `output` like
    `q_latent`, `output_lse` float32 `[H, >= T_dec]` or None, where `T_dec` is the metadata's
    `num_decode_tokens`; then the metadata and the cache (`check_mla_cache`), unless the layer
    call this runs in checked them (`mla_layer_call`)."""
    in_call = _in_layer_call(impl, layer, kv_cache, attn_metadata)
    md = attn_metadata if in_call else _check_metadata(api, impl, layer, attn_metadata)
    rows, heads = md.num_decode_tokens, impl.num_heads
    _check_rows(api, impl, "q_latent", q_latent, (rows, heads, impl.kv_lora_rank))
    _check_rows(api, impl, "q_pe", q_pe, (rows, heads, impl.qk_rope_head_dim), like=q_latent)
    _check_rows(api, impl, "output", output, (rows, heads, impl.kv_lora_rank), like=q_latent)
    if output_lse is not None and (
        not isinstance(output_lse, torch.Tensor)
        or output_lse.dtype != torch.float32
        or output_lse.dim() != 2
        or output_lse.shape[0] != heads
        or output_lse.shape[1] < rows
        or output_lse.device != q_latent.device
    ):
        got = (
            f"{output_lse.dtype} {tuple(output_lse.shape)} on {output_lse.device}"
            if isinstance(output_lse, torch.Tensor)
            else type(output_lse).__name__
        )
        raise ValueError(
            f"{api}: output_lse must be float32 [{heads}, >= {rows}] on {q_latent.device} "
            f"(got {got})."
        )
    if not in_call:
        check_mla_cache(api, impl, kv_cache, md, q_latent.dtype, q_latent.device)


def check_mha_inputs(
    api: str, impl: MLAImpl, layer: object, q: object, kv_c_normed: object, k_pe: object,
    kv_cache: object, attn_metadata: object, output: object,
) -> None:  # fmt: skip
    """`forward_mha`'s arguments: `q [T_pre, H, P + R]`, `kv_c_normed [T_pre, L]`,
    `k_pe [T_pre, R]`, `output [T_pre, H, Vd]`, where `T_pre` is the metadata's
    `num_prefill_tokens`; then the metadata and the cache (`check_mla_cache`), unless the layer
    call this runs in checked them (`mla_layer_call`)."""
    in_call = _in_layer_call(impl, layer, kv_cache, attn_metadata)
    md = attn_metadata if in_call else _check_metadata(api, impl, layer, attn_metadata)
    rows, heads = md.num_prefill_tokens, impl.num_heads
    qk = impl.qk_nope_head_dim + impl.qk_rope_head_dim
    _check_rows(api, impl, "q", q, (rows, heads, qk))
    _check_rows(api, impl, "kv_c_normed", kv_c_normed, (rows, impl.kv_lora_rank), like=q)
    _check_rows(api, impl, "k_pe", k_pe, (rows, impl.qk_rope_head_dim), like=q)
    _check_rows(api, impl, "output", output, (rows, heads, impl.v_head_dim), like=q)
    if not in_call:
        check_mla_cache(api, impl, kv_cache, md, q.dtype, q.device)
    if md.num_prefill_tokens and not hasattr(layer, "up_project"):
        raise TypeError(
            f"{api}: layer must have up_project(c_kv [N, L]) -> (k_nope [N, H, P], v [N, H, Vd]) "
            f"to read the cached context (got {type(layer).__name__} without it)."
        )


def check_mla_kv_write(
    impl: MLAImpl, layer: object, kv_c_normed: object, k_pe: object, kv_cache: object,
    slot_mapping: object, attn_metadata: object = None,
) -> torch.Tensor | None:  # fmt: skip
    """`do_kv_cache_update`'s checks: the arguments as `concat_and_cache_mla` takes them, the
    row sizes against the impl's, and the step against the cache when `attn_metadata` is
    given. Returns the write's scale (an fp8 cache's `layer.k_scale`, float32 `[]`) or None."""
    api = f"{_name(impl)}.do_kv_cache_update"
    step = step_of(attn_metadata)
    is_mirrored = step is not None and slot_mapping is step.slot_mapping
    # Inside the layer's checked call, with the step's own slots: only the new rows' shapes are
    # left to check (the cache, the slots' values and the scale were checked by the layer).
    checked = is_mirrored and _in_layer_call(impl, layer, kv_cache, attn_metadata)
    scale = None
    if isinstance(kv_cache, torch.Tensor):
        scale = _scale(api, impl, layer, kv_cache, check=not checked)
    check_mla_write_args(api, kv_c_normed, k_pe, kv_cache, slot_mapping, impl.kv_cache_dtype,
                         scale, check_values=not is_mirrored)  # fmt: skip
    if checked:
        return scale
    if (kv_c_normed.shape[1], k_pe.shape[1]) != (impl.kv_lora_rank, impl.qk_rope_head_dim):
        raise ValueError(
            f"{api}: kv_c_normed / k_pe sizes differ from the layer's (got "
            f"{kv_c_normed.shape[1]} / {k_pe.shape[1]}, expected {impl.kv_lora_rank} / "
            f"{impl.qk_rope_head_dim})."
        )
    if step is not None:
        check_step_against_cache(api, step, kv_cache)
    return scale


def _check_metadata(api: str, impl: MLAImpl, layer: object, attn_metadata: object):
    check_metadata_type(api, attn_metadata, impl.metadata_cls)
    check_layer_planned(attn_metadata.layer_names, layer, api)
    return attn_metadata


def _check_rows(
    api: str, impl: MLAImpl, name: str, x: object, shape: tuple[int, ...],
    like: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """`x` a tensor of exactly `shape`, of a supported dtype (`like`'s dtype and device)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{api}: {name} must be a torch.Tensor (got {type(x).__name__}).")
    if tuple(x.shape) != shape:
        raise ValueError(f"{api}: {name} must be {list(shape)} (got {list(x.shape)}).")
    if like is None:
        check_supported_dtype(api, name, x, impl.backend.supported_dtypes)
    elif x.dtype != like.dtype or x.device != like.device:
        raise ValueError(
            f"{api}: {name} dtype or device differs from the first input's (got {x.dtype} on "
            f"{x.device}, expected {like.dtype} on {like.device})."
        )


def _scale(
    api: str, impl: MLAImpl, layer: object, kv_cache: torch.Tensor, *, check: bool = True
) -> torch.Tensor | None:
    """The layer's `k_scale` (the one per-layer scale of an fp8 latent cache) as float32 `[]`
    on the cache's device, its values checked when it lives on the CPU (unless `check` is
    false: checked already); None for other caches."""
    if not is_fp8_cache(impl.kv_cache_dtype):
        return None
    scale = layer_kv_scale(api, layer, "k_scale", 1, kv_cache.device)
    if check and layer.k_scale.is_cpu:
        check_scale_values(api, "layer.k_scale", layer.k_scale, fp8=True)
    return scale.reshape(())
