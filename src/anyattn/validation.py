"""Validation of a layer call, on the host, before the cache is written (docs/design.md,
"Validation"): the step against one cache (`check_step_against_cache`, once per cache size)
and the call's tensors (`check_forward_inputs`, `check_kv_write`). `check_layer_call` checks a
whole call and records it, so that the impl's entry points called next with the same
arguments skip their checks. Nothing reads the device, except that a write given no step
reads back a device `slot_mapping`.
"""

from __future__ import annotations

from collections.abc import Set
from typing import NamedTuple, Protocol

import numpy as np
import torch

from anyattn.metadata import CommonAttentionMetadata
from anyattn.ops.tensor_checks import (
    cache_block_dims,
    check_kv_write_args,
    check_scale_values,
    check_slot_mapping,
    check_slot_values,
)
from anyattn.types import ENCODER_TYPES, AttentionType, cache_torch_dtype, is_fp8_cache

__all__ = [
    "check_forward",
    "check_forward_inputs",
    "check_kv_write",
    "check_layer_call",
    "check_layer_planned",
    "check_metadata_type",
    "check_step_against_cache",
    "layer_kv_scale",
    "step_of",
]


class AttentionImpl(Protocol):
    """What the checks read of an `anyattn.impl.AttentionImpl`."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    kv_cache_dtype: str
    attn_type: AttentionType
    sliding_window: int | None
    kv_sharing_target_layer_name: str | None
    backend: type  # its `supported_dtypes`: the query dtypes the impl takes

    def validate_inputs(self, query, key, value, kv_cache, attn_metadata, output, output_lse):
        """See `anyattn.impl.AttentionImpl.validate_inputs`."""


class _Call(NamedTuple):
    """A layer call checked in full, kept by its arguments' identities (`StepChecks.call`)."""

    impl: object
    layer: object
    query: torch.Tensor
    key: torch.Tensor | None
    value: torch.Tensor | None
    kv_cache: torch.Tensor
    slot_mapping: object
    attn_metadata: object
    output: torch.Tensor
    output_lse: torch.Tensor | None


def step_of(attn_metadata: object) -> CommonAttentionMetadata | None:
    """The step behind `attn_metadata`: itself when it is a `CommonAttentionMetadata`, else its
    `common_attn_metadata` (every shipped backend's metadata has one), else None."""
    if isinstance(attn_metadata, CommonAttentionMetadata):
        return attn_metadata
    common = getattr(attn_metadata, "common_attn_metadata", None)
    return common if isinstance(common, CommonAttentionMetadata) else None


def check_layer_planned(layer_names: Set[str], layer: object, api: str) -> None:
    """Refuse a `forward` for a layer not in `layer_names` (the metadata's: the builder's
    layers, so nothing was planned for it); a layer without a `layer_name` is not checked.

    Raises:
        ValueError: naming the layer and the builder's layers.
    """
    name = getattr(layer, "layer_name", None)
    if name is not None and name not in layer_names:
        raise ValueError(
            f"{api}: layer {name!r} is not one of the layers the metadata builder was made "
            f"for (got {name!r}, expected one of {sorted(layer_names)}). Pass every layer of "
            "the KV-cache group to the builder's constructor (layers={name: "
            "impl.layer_params()})."
        )


def check_layer_call(
    impl: AttentionImpl, layer: object, query: torch.Tensor, key: torch.Tensor | None,
    value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: object,
    output: torch.Tensor, output_lse: torch.Tensor | None, *, writes_kv: bool,
) -> None:  # fmt: skip
    """Check one layer call in full before its cache write (`Attention.forward` does): the
    layer is one the metadata was built for, the impl's `validate_inputs`, the step against
    the cache, and when `writes_kv` the write's slot mapping and fp8 scales; then record it,
    so that `do_kv_cache_update` and `forward` with these very arguments skip their checks.
    Raises `ValueError`, `TypeError` or `NotImplementedError` for the first problem found."""
    layer_names = getattr(attn_metadata, "layer_names", None)
    if isinstance(layer_names, frozenset):
        check_layer_planned(layer_names, layer, f"{type(impl).__name__}.forward")
    impl.validate_inputs(query, key, value, kv_cache, attn_metadata, output, output_lse)
    slot_mapping = getattr(attn_metadata, "slot_mapping", None)
    step = step_of(attn_metadata)
    if step is not None and impl.attn_type not in ENCODER_TYPES:  # (remembered: a look-up)
        check_step_against_cache(f"{type(impl).__name__}.forward", step, kv_cache)
    if writes_kv and key is not None and impl.kv_sharing_target_layer_name is None:
        api = f"{type(impl).__name__}.do_kv_cache_update"
        check_slot_mapping(api, slot_mapping, key.shape[0], kv_cache.device)
        if step is None or slot_mapping is not step.slot_mapping:
            check_slot_values(api, slot_mapping[: key.shape[0]], kv_cache)
        _write_scales(api, impl, layer, kv_cache)
    if step is not None:
        step.checks.call = _Call(impl, layer, query, key, value, kv_cache, slot_mapping,
                                 attn_metadata, output, output_lse)  # fmt: skip


def check_forward(
    impl: AttentionImpl, query: torch.Tensor, key: torch.Tensor | None,
    value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: object,
    output: torch.Tensor, output_lse: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """`forward`'s checks, its first step: none for the call `check_layer_call` has just
    checked (the record is taken), else the impl's `validate_inputs`."""
    step = step_of(attn_metadata)
    if step is not None and step.checks.call is not None:
        call, step.checks.call = step.checks.call, None  # one call's record serves one call
        checked = (call.impl, call.query, call.key, call.value, call.kv_cache,
                   call.attn_metadata, call.output, call.output_lse)  # fmt: skip
        if _same(checked, (impl, query, key, value, kv_cache, attn_metadata, output, output_lse)):
            return
    impl.validate_inputs(query, key, value, kv_cache, attn_metadata, output, output_lse)


def check_kv_write(
    impl: AttentionImpl, layer: object, key: torch.Tensor, value: torch.Tensor,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, attn_metadata: object = None,
) -> tuple[str, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """`do_kv_cache_update`'s checks (none for the call `check_layer_call` has checked): the
    arguments as `reshape_and_cache` takes them, the cache against the impl, and the step
    against the cache when `attn_metadata` is given. Returns `(kv_cache_dtype, k_scale,
    v_scale)` for the write (float32 scales on the cache's device for an fp8 cache, else None)."""
    api = f"{type(impl).__name__}.do_kv_cache_update"
    step = step_of(attn_metadata)
    call = None if step is None else step.checks.call
    if call is not None and _same(
        (call.impl, call.layer, call.key, call.value, call.kv_cache, call.slot_mapping),
        (impl, layer, key, value, kv_cache, slot_mapping),
    ):
        return (impl.kv_cache_dtype, *_write_scales(api, impl, layer, kv_cache, check=False))
    scales = _write_scales(api, impl, layer, kv_cache)
    is_mirrored = step is not None and slot_mapping is step.slot_mapping
    check_kv_write_args(api, key, value, kv_cache, slot_mapping, impl.kv_cache_dtype,
                        *scales, check_values=not is_mirrored)  # fmt: skip
    if tuple(kv_cache.shape[3:]) != (impl.num_kv_heads, impl.head_size):
        raise ValueError(
            f"{api}: kv_cache's [num_kv_heads, head_size] differ from the layer's (got "
            f"{list(kv_cache.shape[3:])}, expected [{impl.num_kv_heads}, {impl.head_size}])."
        )
    if step is not None:
        check_step_against_cache(api, step, kv_cache)
    return (impl.kv_cache_dtype, *scales)


def cache_block_shape(impl: AttentionImpl, block_size: int) -> tuple[int, ...]:
    """A standard cache's shape after `num_blocks`: `(2, block_size, num_kv_heads, head_size)`."""
    return (2, block_size, impl.num_kv_heads, impl.head_size)


def check_step_against_cache(
    api: str, step: CommonAttentionMetadata, kv_cache: torch.Tensor
) -> None:
    """Check the step's slots and the block ids its requests read against `kv_cache`'s
    `num_blocks` and `block_size` (standard or MLA cache), from the CPU mirrors; once per step
    and cache size.

    Raises:
        ValueError: a slot past the cache, a table too narrow for a request's keys, or a block
            id read outside `[0, num_blocks)`; naming the request, entry, value and valid range.
    """
    num_blocks, block_size = cache_block_dims(kv_cache)
    if (num_blocks, block_size) in step.checks.caches:
        return
    slots = step.slot_mapping_cpu.numpy()
    num_slots = num_blocks * block_size
    if slots.size and slots[slots.argmax()] >= num_slots:
        entry = int(slots.argmax())
        token = f"entry {entry}"
        if step.encoder_seq_lens_cpu is None and entry < step.num_actual_tokens:
            request = int(np.searchsorted(step.host_batch.query_start_loc, entry, "right")) - 1
            token = f"token {entry} (request {request})"
        raise ValueError(
            f"{api}: slot_mapping has a slot outside the cache at {token} (got {slots[entry]}, "
            f"expected -1 or 0 <= slot < num_blocks * block_size = {num_blocks} * {block_size})."
            " Compute the slots from the block table of this cache."
        )
    _check_block_table(api, step, num_blocks, block_size)
    step.checks.caches.add((num_blocks, block_size))


def _check_block_table(
    api: str, step: CommonAttentionMetadata, num_blocks: int, block_size: int
) -> None:
    num_reqs = step.num_reqs
    table = step.block_table_cpu.numpy()[:num_reqs]
    keys = step.host_batch.seq_lens
    if step.encoder_seq_lens_cpu is not None:  # cross attention reads the encoder's keys
        keys = step.encoder_seq_lens_cpu.numpy()[:num_reqs].astype(np.int64)
    num_cols = -(-keys // block_size)  # [num_reqs]: the columns each request reads
    width = table.shape[1]
    if num_reqs and num_cols[num_cols.argmax()] > width:
        request = int(num_cols.argmax())
        raise ValueError(
            f"{api}: block_table_tensor too narrow for request {request} (got {width} columns, "
            f"expected >= {num_cols[request]} for its {keys[request]} keys at block_size "
            f"{block_size})."
        )
    # The whole of the real rows first (one pass each way): columns past a request's keys may
    # hold anything, so only a failure there looks at which columns are read.
    if not table.size or (table.min() >= 0 and table.max() < num_blocks):
        return
    is_read = np.arange(width) < num_cols[:, None]
    bad = np.argwhere(is_read & ((table < 0) | (table >= num_blocks)))
    if bad.size:
        request, column = (int(i) for i in bad[0])
        raise ValueError(
            f"{api}: block_table_tensor has a block outside the cache for request {request}, "
            f"column {column} (got {table[request, column]}, expected 0 <= block < num_blocks "
            f"= {num_blocks} in the {num_cols[request]} columns its {keys[request]} keys read at "
            f"block_size {block_size}). Fix the block table or allocate a larger cache."
        )


def check_forward_inputs(
    api: str, impl: AttentionImpl, query: torch.Tensor, key: torch.Tensor | None,
    value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: object,
    metadata_type: type, *, output: torch.Tensor, output_lse: torch.Tensor | None,
    num_rows: int | None = None,
) -> None:  # fmt: skip
    """Shapes, dtypes and devices of one `forward` call's tensors, and the step against the
    cache (not for encoder attention, whose K/V come from the inputs): the shared part of
    every impl's `validate_inputs`. `api` names the caller ("TRITON forward"); `num_rows` are
    the query rows the kernels run (default: the metadata's `num_actual_tokens`).

    Raises:
        TypeError: metadata not of `metadata_type`.
        ValueError, NotImplementedError: the first mismatch, naming the argument.
    """
    check_metadata_type(api, attn_metadata, metadata_type)
    md = attn_metadata
    if impl.sliding_window is not None and not md.causal:
        raise NotImplementedError(
            f"{api}: sliding window with non-causal attention not supported (got "
            "attn_metadata.causal=False); the window is defined causally."
        )
    num_rows = md.num_actual_tokens if num_rows is None else num_rows
    reads_cache = impl.attn_type not in ENCODER_TYPES
    heads = (impl.num_heads, impl.head_size)
    if query.dim() != 3 or tuple(query.shape[1:]) != heads:
        raise ValueError(
            f"{api}: query must be [num_tokens, {heads[0]}, {heads[1]}] (got {tuple(query.shape)})."
        )
    check_supported_dtype(api, "query", query, impl.backend.supported_dtypes)
    if output.shape != query.shape or output.dtype != query.dtype:
        raise ValueError(
            f"{api}: output must match query in shape and dtype (got {tuple(output.shape)} "
            f"{output.dtype}, expected {tuple(query.shape)} {query.dtype})."
        )
    if num_rows > query.shape[0]:
        raise ValueError(
            f"{api}: query has fewer rows than the metadata's tokens (got {query.shape[0]}, "
            f"expected >= {num_rows})."
        )
    _check_forward_kv(api, impl, query, key, value)
    if not reads_cache:
        if key is None:
            raise ValueError(f"{api}: {impl.attn_type.value} attention needs key and value.")
    else:
        expected = ("num_blocks", *cache_block_shape(impl, md.block_size))
        if not isinstance(kv_cache, torch.Tensor):
            raise TypeError(
                f"{api}: kv_cache must be a torch.Tensor {list(expected)} (got "
                f"{type(kv_cache).__name__})."
            )
        if kv_cache.dim() != 5 or tuple(kv_cache.shape[1:]) != expected[1:]:
            raise ValueError(
                f"{api}: kv_cache must be {list(expected)} (got {tuple(kv_cache.shape)}). "
                "Allocate it with anyattn.kv_cache.allocate_kv_cache."
            )
        check_cache_dtype(api, kv_cache, impl.kv_cache_dtype, query.dtype)
        if kv_cache.device != query.device:
            raise ValueError(
                f"{api}: kv_cache and query are on different devices (got {kv_cache.device} "
                f"and {query.device})."
            )
    if output_lse is not None and (
        output_lse.dtype != torch.float32
        or output_lse.dim() != 2
        or output_lse.shape[0] != impl.num_heads
        or output_lse.shape[1] < num_rows
    ):
        raise ValueError(
            f"{api}: output_lse must be float32 [{impl.num_heads}, num_tokens] (got "
            f"{output_lse.dtype} {tuple(output_lse.shape)})."
        )
    if reads_cache and (step := step_of(md)) is not None:
        check_step_against_cache(api, step, kv_cache)


def check_supported_dtype(
    api: str, name: str, x: torch.Tensor, supported: tuple[torch.dtype, ...]
) -> None:
    """Raise `ValueError` unless `x`'s dtype is one of `supported` (the backend's)."""
    if x.dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ValueError(
            f"{api}: {name} dtype not supported (got {x.dtype}, expected one of {names})."
        )


def check_cache_dtype(
    api: str, kv_cache: torch.Tensor, kv_cache_dtype: str, model_dtype: torch.dtype
) -> None:
    """Raise `ValueError` unless `kv_cache` holds `kv_cache_dtype` for `model_dtype` inputs."""
    expected = cache_torch_dtype(kv_cache_dtype, model_dtype)
    if kv_cache.dtype != expected:
        raise ValueError(
            f"{api}: kv_cache dtype does not match kv_cache_dtype {kv_cache_dtype!r} (got "
            f"{kv_cache.dtype}, expected {expected})."
        )


def check_metadata_type(api: str, attn_metadata: object, metadata_type: type) -> None:
    """Raise `TypeError` unless `attn_metadata` is a `metadata_type` (a backend's metadata,
    made by the builder of the same name)."""
    if not isinstance(attn_metadata, metadata_type):
        builder = metadata_type.__name__.removesuffix("Metadata") + "MetadataBuilder"
        raise TypeError(
            f"{api}: attn_metadata must come from {builder}.build (got "
            f"{type(attn_metadata).__name__})."
        )


def _check_forward_kv(
    api: str, impl: AttentionImpl, query: torch.Tensor, key: torch.Tensor | None,
    value: torch.Tensor | None
) -> None:  # fmt: skip
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
        if tensor.dtype != query.dtype or tensor.device != query.device:
            raise ValueError(
                f"{api}: {name} dtype or device differs from query's (got {tensor.dtype} on "
                f"{tensor.device}, expected {query.dtype} on {query.device})."
            )
        if impl.attn_type != AttentionType.ENCODER_DECODER and tensor.shape[0] != query.shape[0]:
            raise ValueError(
                f"{api}: {name} and query differ in tokens (got {tensor.shape[0]} and "
                f"{query.shape[0]})."
            )


def layer_kv_scale(
    api: str, layer: object, name: str, num_kv_heads: int, device: torch.device
) -> torch.Tensor:
    """`layer.k_scale` or `layer.v_scale` of an fp8 cache as float32 on `device`, shape `[]`
    or `[num_kv_heads]` (`[1]` taken as `[]`), values unread; a `ValueError` when missing or
    of another shape."""
    scale = getattr(layer, name, None)
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) not in ((), (1,), (num_kv_heads,)):
        got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(
            f"{api}: layer.{name} must be a float32 tensor of shape [] or [{num_kv_heads}] "
            f"for an fp8 KV cache (got {got})."
        )
    return _on(scale, device)


def _on(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    if scale.device != device or scale.dtype != torch.float32:
        scale = scale.to(device=device, dtype=torch.float32)
    return scale.reshape(()) if scale.dim() == 1 and scale.shape[0] == 1 else scale


def _write_scales(
    api: str, impl: AttentionImpl, layer: object, kv_cache: torch.Tensor, check: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The write's scales: the layer's, for an fp8 cache only (others ignore them); a CPU
    scale's values are checked (finite, > 0), a device scale's are not read."""
    if not is_fp8_cache(impl.kv_cache_dtype):
        return None, None
    if not check:  # checked by `check_layer_call`: only converted
        return _on(layer.k_scale, kv_cache.device), _on(layer.v_scale, kv_cache.device)
    scales = []
    for name in ("k_scale", "v_scale"):
        scale = layer_kv_scale(api, layer, name, impl.num_kv_heads, kv_cache.device)
        if getattr(layer, name).is_cpu:
            check_scale_values(api, f"layer.{name}", getattr(layer, name), fp8=True)
        scales.append(scale)
    return scales[0], scales[1]


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Whether two argument tuples (of one length) hold the very same objects."""
    return all(x is y for x, y in zip(a, b, strict=True))
