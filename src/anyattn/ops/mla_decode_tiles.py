"""The launch shape of the MLA decode kernel (`anyattn.ops.mla_decode`): its tuning knobs, the
default choice per head count, and the conditions a shape puts on the cache.

How the defaults were measured, and the other shapes tried, are in benchmarks/RESULTS.md
(`benchmarks/mla_decode_tune.py` times them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "KV_LOADS",
    "MLADecodeTiles",
    "check_tiles",
    "mla_decode_tiles",
    "tma_unsupported_reason",
]

# How a key tile is read (see `MLADecodeTiles.kv_load`).
KV_LOADS = ("gather", "block", "tma")


@dataclass(frozen=True, slots=True)
class MLADecodeTiles:
    """Launch shape of `mla_decode_kernel`: its tuning knobs.

    Attributes:
        block_h: query heads per program, a power of two >= 16 (the rows of a `tl.dot` tile).
        tile_n: keys per step of the online softmax, a power of two >= 16.
        num_warps, num_stages: Triton launch options.
        latent_splits: programs per head tile, 1 or 2; with 2 each computes the full scores
            and accumulates half of the latent output columns (half the float32 accumulator
            per program, the scores computed twice).
        kv_load: how a key tile is read from the paged cache. "gather": a block-table entry
            per key, any block size. "block": one entry per tile and no key mask before a
            request's last partial tile (needs `block_size % tile_n == 0`). "tma": as
            "block", through TMA tensor descriptors (also needs a cache whose blocks are
            contiguous rows, `stride(0) == block_size * stride(1)`, `stride(2) == 1`, and
            16-byte aligned rows and rope columns; see `tma_unsupported_reason`).
    """

    block_h: int
    tile_n: int
    num_warps: int
    num_stages: int
    latent_splits: int = 1
    kv_load: Literal["gather", "block", "tma"] = "gather"

    def __post_init__(self) -> None:
        for name in ("block_h", "tile_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(
                    f"MLADecodeTiles: {name} must be a power of two >= 16 (got {value!r})."
                )
        if self.latent_splits not in (1, 2):
            raise ValueError(
                f"MLADecodeTiles: latent_splits must be 1 or 2 (got {self.latent_splits!r})."
            )
        if self.kv_load not in KV_LOADS:
            raise ValueError(
                f"MLADecodeTiles: kv_load must be one of {sorted(KV_LOADS)} (got {self.kv_load!r})."
            )

    def programs_per_row(self, num_heads: int) -> int:
        """Programs of one decode row and KV split: head tiles times latent splits."""
        return -(-num_heads // self.block_h) * self.latent_splits


def mla_decode_tiles(
    num_heads: int, kv_cache: torch.Tensor | None = None, kv_lora_rank: int | None = None
) -> MLADecodeTiles:
    """The tile shape for `num_heads` query heads reading `kv_cache` (`[num_blocks, block_size,
    L + R]`, latent width `kv_lora_rank`; None: a 16-bit cache of unknown layout).

    Up to 16 heads: one 16-row tile per program (the decode is memory-bound there: each latent
    row is read once per request). More than 32: 64-head tiles (compute-bound: each latent row
    read once per 64 heads, the accumulator `[64, 512]` float32 over 256 threads). Keys of a
    16-bit cache are read through TMA where the GPU has it (sm90+) and the cache allows it
    (`tma_unsupported_reason`, a block size that 64-key tiles divide); else one block-table
    entry per key. A float32 cache keeps 2 stages (5 of its key tiles would not fit in shared
    memory). The head tile, hence `programs_per_row`, depends on `num_heads` only.
    """
    tma = kv_cache is not None and kv_lora_rank is not None and _takes_tma(kv_cache, kv_lora_rank)
    stages = 2 if kv_cache is not None and kv_cache.element_size() > 2 else 5
    if num_heads <= 16:
        load = "tma" if tma else "gather"
        return MLADecodeTiles(block_h=16, tile_n=64, num_warps=8, num_stages=stages, kv_load=load)
    if num_heads <= 32:
        return MLADecodeTiles(block_h=32, tile_n=64, num_warps=4, num_stages=2)
    if tma:
        return MLADecodeTiles(block_h=64, tile_n=64, num_warps=8, num_stages=2, kv_load="tma")
    return MLADecodeTiles(block_h=64, tile_n=32, num_warps=8, num_stages=stages)


def _takes_tma(kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether the default tiles read `kv_cache` through TMA: a 16-bit CUDA cache (the dtypes the
    tile sweep ran) on sm90+ whose block size 64-key tiles divide and whose layout
    `tma_unsupported_reason` accepts."""
    return (
        kv_cache.is_cuda
        and kv_cache.dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(kv_cache.device)[0] >= 9
        and kv_cache.shape[1] % 64 == 0
        and tma_unsupported_reason(kv_cache, kv_lora_rank) is None
    )


def tma_unsupported_reason(kv_cache: torch.Tensor, kv_lora_rank: int) -> str | None:
    """Why `kv_load="tma"` cannot read `kv_cache` (None when it can): TMA descriptors need the
    cache's blocks laid out as contiguous rows, unit stride along a row, and 16-byte aligned
    rows, start and rope columns."""
    num_blocks, block_size, _ = kv_cache.shape
    item = kv_cache.element_size()
    stride_b, stride_s, stride_d = kv_cache.stride()
    if stride_d != 1 or (num_blocks > 1 and stride_b != block_size * stride_s):
        return (
            f"the cache's blocks are not contiguous rows (strides {kv_cache.stride()}, expected "
            f"({block_size} * row stride, row stride, 1))"
        )
    if (stride_s * item) % 16 or kv_cache.data_ptr() % 16 or (kv_lora_rank * item) % 16:
        return (
            f"rows, start or rope columns not 16-byte aligned (row stride {stride_s * item} B, "
            f"start {kv_cache.data_ptr() % 16} B past 16, rope at {kv_lora_rank * item} B)"
        )
    return None


def check_tiles(op: str, tiles: MLADecodeTiles, kv_cache: torch.Tensor, rank: int) -> None:
    """The block-size and layout conditions of `tiles.kv_load` (see `MLADecodeTiles`) for the
    launch `op`; raises `TypeError` / `ValueError` naming what does not hold."""
    if not isinstance(tiles, MLADecodeTiles):
        raise TypeError(f"{op}: tiles must be MLADecodeTiles (got {type(tiles).__name__}).")
    block_size = kv_cache.shape[1]
    if tiles.kv_load != "gather" and block_size % tiles.tile_n:
        raise ValueError(
            f"{op}: kv_load={tiles.kv_load!r} needs tile_n to divide the block size (got "
            f"tile_n {tiles.tile_n}, block_size {block_size}); use kv_load='gather'."
        )
    if tiles.latent_splits == 2 and rank <= 16:
        raise ValueError(
            f"{op}: latent_splits=2 needs kv_lora_rank > 16 (got {rank}): each half is a "
            "tl.dot operand of at least 16 columns."
        )
    if tiles.kv_load == "tma":
        reason = tma_unsupported_reason(kv_cache, rank)
        if reason is not None:
            raise ValueError(f"{op}: kv_load='tma' cannot read this cache: {reason}.")
