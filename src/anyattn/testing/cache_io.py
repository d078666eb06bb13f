"""The kit's own KV-cache readers and writers, and the fp8 quantisation they agree on.

Deliberately simple (index writes, no kernels), so that a backend's cache writes can be compared
bit for bit with what they should be. Standard caches have the logical shape
`(num_blocks, 2, block_size, num_kv_heads, head_size)` (index 1: 0 = K, 1 = V), any layout; MLA
latent caches `(num_blocks, block_size, L + R)`, one row `[c_kv (L), k_pe (R)]` per token, with
one per-layer fp8 scale (docs/mla.md, "The cache").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from anyattn.ops.fp8_quant import quantize_fp8
from anyattn.testing.blocks import token_slots
from anyattn.types import is_fp8_cache

__all__ = [
    "as_stored", "dequantize_kv", "quantize_kv", "read_kv", "read_latents", "write_kv",
    "write_latents",
]  # fmt: skip


def _broadcast_scale(scale: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_kv_heads, head_size]; scale: [] or [num_kv_heads]
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=x.device)
    scale = scale.to(x.device, torch.float32)
    return scale.view(-1, 1) if scale.dim() == 1 else scale


def quantize_kv(
    x: torch.Tensor, kv_cache_dtype: str, cache_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The values a cache of `kv_cache_dtype` (element dtype `cache_dtype`) stores for `x`
    `[num_tokens, num_kv_heads, head_size]`: a cast, or for fp8 `x / scale` (float32 `[]` or
    `[num_kv_heads]`, None means 1) by `anyattn.ops.fp8_quant.quantize_fp8`, the one rule of every
    fp8 cache write (IEEE float32 division, nearest-even fp8, saturation, NaN as 0x7F)."""
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
    x: torch.Tensor, kv_cache_dtype: str, cache_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """float64 values a cache of `kv_cache_dtype` holding `x` gives back (`quantize_kv`, then
    `dequantize_kv`: for fp8 the quantised values)."""
    return dequantize_kv(quantize_kv(x, kv_cache_dtype, cache_dtype, scale), kv_cache_dtype, scale)


def _check_shape(kv_cache: torch.Tensor, api: str, is_latent: bool = False) -> None:
    if is_latent and kv_cache.dim() != 3:
        raise ValueError(
            f"{api}: kv_cache must be an MLA cache (num_blocks, block_size, L + R) "
            f"(got shape {tuple(kv_cache.shape)})."
        )
    if not is_latent and (kv_cache.dim() != 5 or kv_cache.shape[1] != 2):
        raise NotImplementedError(
            f"{api}: the kit covers KV caches of logical shape (num_blocks, 2, block_size, "
            f"num_kv_heads, head_size) (got {tuple(kv_cache.shape)})."
        )


def _store(
    blocks: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
    scale: torch.Tensor | None,
) -> None:  # fmt: skip
    """Write `quantize_kv(rows[t])` at slot `slot_mapping[t]` (-1 skipped) of `blocks`, a view
    `[num_blocks, block_size, ...]` of a cache (its own strides, so writes land in its storage)."""
    block_size = blocks.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(blocks.device)
    stored = quantize_kv(rows[keep.to(rows.device)], kv_cache_dtype, blocks.dtype, scale)
    blocks[slots // block_size, slots % block_size] = stored.to(blocks.device)


def _positions(
    block_table: torch.Tensor, seq_lens: Sequence[int], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(block_ids, offsets)` of each request's first `seq_lens[r]` positions, back to back."""
    positions = [torch.arange(s, device=block_table.device) for s in seq_lens]
    slots = token_slots(block_table, positions, block_size) if positions else torch.zeros(0)
    slots = slots.long().to(device)
    return slots // block_size, slots % block_size


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The kit's own cache writer: store `key`/`value` rows `[num_tokens, num_kv_heads,
    head_size]` at their slots (int64 `block_id * block_size + offset`, -1 skipped) of
    `kv_cache` `[num_blocks, 2, block_size, num_kv_heads, head_size]` (any layout), quantised
    as `quantize_kv` does with `k_scale`, `v_scale`."""
    _check_shape(kv_cache, "write_kv")
    _store(kv_cache.select(1, 0), key, slot_mapping, kv_cache_dtype, k_scale)
    _store(kv_cache.select(1, 1), value, slot_mapping, kv_cache_dtype, v_scale)


def read_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The stored K and V (`[sum(seq_lens), num_kv_heads, head_size]` each, cache dtype) of each
    request's first `seq_lens[r]` positions, back to back, through `block_table` (int
    `[num_reqs, max_blocks]` in the cache's block size)."""
    _check_shape(kv_cache, "read_kv")
    block_ids, offsets = _positions(block_table, seq_lens, kv_cache.shape[2], kv_cache.device)
    return kv_cache[block_ids, 0, offsets], kv_cache[block_ids, 1, offsets]


def write_latents(
    kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto", scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Store MLA rows `[kv_c[t] (L), k_pe[t] (R)]` at their slots (as `write_kv`, -1 skipped) of
    `kv_cache` `[num_blocks, block_size, L + R]`, fp8 with the per-layer `scale` (float32 `[]`,
    None means 1)."""
    _check_shape(kv_cache, "write_latents", is_latent=True)
    if kv_c.shape[0] != k_pe.shape[0] or kv_c.shape[-1] + k_pe.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(
            f"write_latents: kv_c [num_tokens, L] and k_pe [num_tokens, R] must fill rows of "
            f"{kv_cache.shape[-1]} (got {tuple(kv_c.shape)} and {tuple(k_pe.shape)})."
        )
    _store(kv_cache, torch.cat([kv_c, k_pe], dim=-1), slot_mapping, kv_cache_dtype, scale)


def read_latents(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: Sequence[int],
    kv_cache_dtype: str = "auto", scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """float64 MLA rows `[c_kv, k_pe]` of each request's first `seq_lens[r]` positions, back to
    back (fp8 dequantised with `scale`): `[sum(seq_lens), L + R]`."""
    _check_shape(kv_cache, "read_latents", is_latent=True)
    block_ids, offsets = _positions(block_table, seq_lens, kv_cache.shape[1], kv_cache.device)
    return dequantize_kv(kv_cache[block_ids, offsets], kv_cache_dtype, scale)
