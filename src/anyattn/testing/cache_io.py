"""The kit's own KV-cache reader and writer, and the fp8 quantisation they agree on.

Deliberately simple (index writes, no kernels), so that a backend's cache writes can be compared
bit for bit with what they should be. Caches have the standard logical shape
`(num_blocks, 2, block_size, num_kv_heads, head_size)` (index 1: 0 = K, 1 = V), any layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from anyattn.ops.fp8_quant import quantize_fp8
from anyattn.types import is_fp8_cache

__all__ = ["as_stored", "dequantize_kv", "quantize_kv", "read_kv", "write_kv"]


def _broadcast_scale(scale: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_kv_heads, head_size]; scale: [] or [num_kv_heads]
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=x.device)
    scale = scale.to(x.device, torch.float32)
    return scale.view(-1, 1) if scale.dim() == 1 else scale


def quantize_kv(
    x: torch.Tensor,
    kv_cache_dtype: str,
    cache_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The values a cache of `kv_cache_dtype` stores for `x`.

    fp8: `x / scale` by `anyattn.ops.fp8_quant.quantize_fp8`, the one rule of every fp8 cache
    write (an IEEE float32 division, nearest-even fp8, saturation at the format's largest finite
    value, NaN as the byte 0x7F); otherwise a cast.

    Args:
        x: `[num_tokens, num_kv_heads, head_size]`.
        cache_dtype: the cache's element dtype.
        scale: float32 `[]` or `[num_kv_heads]` (fp8 only; None means 1).
    """
    if is_fp8_cache(kv_cache_dtype):
        return quantize_fp8(x, _broadcast_scale(scale, x), cache_dtype)
    return x.to(cache_dtype)


def dequantize_kv(
    stored: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 values that `stored` (`[num_tokens, num_kv_heads, head_size]`) stands for."""
    if is_fp8_cache(kv_cache_dtype):
        return stored.double() * _broadcast_scale(scale, stored).double()
    return stored.double()


def as_stored(
    x: torch.Tensor,
    kv_cache_dtype: str,
    cache_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 values a cache of `kv_cache_dtype` holding `x` gives back (`quantize_kv`, then
    `dequantize_kv`: for fp8 the quantised values)."""
    return dequantize_kv(quantize_kv(x, kv_cache_dtype, cache_dtype, scale), kv_cache_dtype, scale)


def _check_cache_shape(kv_cache: torch.Tensor, api: str) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise NotImplementedError(
            f"{api}: the kit covers KV caches of logical shape (num_blocks, 2, block_size, "
            f"num_kv_heads, head_size) (got {tuple(kv_cache.shape)})."
        )


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The kit's own cache writer: store `key`/`value` rows at their slots (-1 skipped).

    Args:
        kv_cache: `[num_blocks, 2, block_size, num_kv_heads, head_size]`, any layout.
        key, value: `[num_tokens, num_kv_heads, head_size]`.
        slot_mapping: int64 `[num_tokens]`, `block_id * block_size + offset` or -1.
        kv_cache_dtype: "auto" or a cache dtype name; fp8 as in `quantize_kv`.
        k_scale, v_scale: float32 `[]` or `[num_kv_heads]`.
    """
    _check_cache_shape(kv_cache, "write_kv")
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(kv_cache.device)
    block_ids, offsets = slots // block_size, slots % block_size
    for index, x, scale in ((0, key, k_scale), (1, value, v_scale)):
        stored = quantize_kv(x[keep.to(x.device)], kv_cache_dtype, kv_cache.dtype, scale)
        # select() keeps the layout's strides, so the write lands in the cache's own storage.
        kv_cache.select(1, index)[block_ids, offsets] = stored.to(kv_cache.device)


def read_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored K and V of each request's first `seq_lens[r]` positions, back to back.

    Args:
        kv_cache: `[num_blocks, 2, block_size, num_kv_heads, head_size]`.
        block_table: int `[num_reqs, max_blocks]` in the cache's block size.

    Returns:
        `(key, value)`, each `[sum(seq_lens), num_kv_heads, head_size]` in the cache dtype.
    """
    _check_cache_shape(kv_cache, "read_kv")
    block_size = kv_cache.shape[2]
    table = block_table.to(kv_cache.device).long()
    keys, values = [], []
    for r, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len, device=kv_cache.device)
        block_ids = table[r, positions // block_size]
        keys.append(kv_cache[block_ids, 0, positions % block_size])
        values.append(kv_cache[block_ids, 1, positions % block_size])
    return torch.cat(keys), torch.cat(values)
