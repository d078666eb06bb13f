"""The kit's own writer and reader of MLA latent caches (docs/mla.md, "The cache").

An MLA cache has the logical shape `(num_blocks, block_size, L + R)`: one row per token,
`[c_kv (L), k_pe (R)]`. fp8 caches store `quantize_fp8(row, scale)` with one per-layer scale,
the rule of every fp8 cache write (`anyattn.testing.cache_io.quantize_kv`). Plain index
writes, so that a backend's cache writes can be compared with them bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from anyattn.testing.cache_io import dequantize_kv, quantize_kv

__all__ = ["read_latents", "write_latents"]


def _check_cache(kv_cache: torch.Tensor, api: str) -> None:
    if kv_cache.dim() != 3:
        raise ValueError(
            f"{api}: kv_cache must be an MLA cache (num_blocks, block_size, L + R) "
            f"(got shape {tuple(kv_cache.shape)})."
        )


def write_latents(
    kv_cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    scale: torch.Tensor | None = None,
) -> None:
    """Store rows `[kv_c[t], k_pe[t]]` at their slots (-1 skipped).

    Args:
        kv_cache: `[num_blocks, block_size, L + R]`.
        kv_c: `[num_tokens, L]`; k_pe: `[num_tokens, R]`.
        slot_mapping: int64 `[num_tokens]`, `block_id * block_size + offset` or -1.
        kv_cache_dtype: "auto" or a cache dtype name.
        scale: float32 `[]`, the per-layer fp8 scale (None means 1).
    """
    _check_cache(kv_cache, "write_latents")
    rank = kv_c.shape[-1]
    if kv_c.shape[0] != k_pe.shape[0] or rank + k_pe.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(
            f"write_latents: kv_c [num_tokens, L] and k_pe [num_tokens, R] must fill rows of "
            f"{kv_cache.shape[-1]} (got {tuple(kv_c.shape)} and {tuple(k_pe.shape)})."
        )
    block_size = kv_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(kv_cache.device)
    rows = torch.cat([kv_c, k_pe], dim=-1)[keep.to(kv_c.device)]
    stored = quantize_kv(rows, kv_cache_dtype, kv_cache.dtype, scale)
    kv_cache[slots // block_size, slots % block_size] = stored.to(kv_cache.device)


def read_latents(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    kv_cache_dtype: str = "auto",
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 rows `[c_kv, k_pe]` of each request's first `seq_lens[r]` positions, back to
    back (fp8 dequantised with `scale`): `[sum(seq_lens), L + R]`."""
    _check_cache(kv_cache, "read_latents")
    block_size = kv_cache.shape[1]
    table = block_table.to(kv_cache.device).long()
    rows = []
    for r, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len, device=kv_cache.device)
        rows.append(kv_cache[table[r, positions // block_size], positions % block_size])
    stored = torch.cat(rows) if rows else kv_cache.new_zeros(0, kv_cache.shape[-1])
    return dequantize_kv(stored, kv_cache_dtype, scale)
