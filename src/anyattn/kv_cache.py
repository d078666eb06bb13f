"""Allocate a layer's paged KV cache in the backend's logical shape and a chosen layout."""

from __future__ import annotations

import torch

from anyattn.backend import AttentionBackend
from anyattn.types import KVCacheLayout, cache_torch_dtype

__all__ = ["allocate_kv_cache"]


def allocate_kv_cache(
    backend: type[AttentionBackend],
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    layout: KVCacheLayout | str | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zeroed KV cache for one layer, in the backend's logical shape (for most backends
    `[num_blocks, 2, block_size, num_kv_heads, head_size]`) with the strides of `layout`: NHD
    (tokens outer) or HND (heads outer) inside each block; None: the backend's preferred one.
    Elements are `kv_cache_dtype` resolved against the model `dtype`.
    """
    shape = backend.get_kv_cache_shape(
        num_blocks, block_size, num_kv_heads, head_size, kv_cache_dtype
    )
    if layout is None:
        layout = backend.supported_kv_cache_layouts()[0]
    order = backend.get_kv_cache_stride_order(layout)
    physical = torch.zeros(
        [shape[i] for i in order], dtype=cache_torch_dtype(kv_cache_dtype, dtype), device=device
    )
    inverse = [order.index(i) for i in range(len(order))]
    return physical.permute(*inverse)
