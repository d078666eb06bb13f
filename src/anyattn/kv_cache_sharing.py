"""One KV cache for several backends: the kernel block size, layout and cache dtype they all
read, decided up front from their declarations (docs/per_phase.md).

A layer whose decodes and prefills run on different backends keeps one cache, written once
per step by the layer and read by both. That needs one logical cache shape for one kernel
block size, one layout (stride order) and cache dtype both take, and neither backend writing
K/V inside its `forward`. `plan_shared_kv_cache` finds those or says which is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from anyattn.declarations import AttentionBackend
from anyattn.types import KVCacheLayout

__all__ = ["KVCacheNotShareableError", "SharedKVCache", "plan_shared_kv_cache"]


class KVCacheNotShareableError(ValueError):
    """The backends cannot read one KV cache; the message says which declaration differs."""


@dataclass(frozen=True, slots=True)
class SharedKVCache:
    """How a cache shared by `backends` (the decode backend first) is allocated: the
    `kernel_block_size` all their kernels read (an engine block is a whole number of them),
    the `layout` (the first of the first backend's preferences that all take) and its
    `stride_order`, and the `kv_cache_dtype`."""

    backends: tuple[type[AttentionBackend], ...]
    kernel_block_size: int
    layout: KVCacheLayout
    stride_order: tuple[int, ...]
    kv_cache_dtype: str

    def describe(self) -> str:
        names = " and ".join(b.get_name() for b in self.backends)
        return (
            f"{names} share one cache: kernel block {self.kernel_block_size}, layout "
            f"{self.layout}, cache dtype {self.kv_cache_dtype}"
        )


def _exact_kernel_sizes(backend: type[AttentionBackend], block_size: int) -> list[int]:
    """Kernel block sizes dividing `block_size` that `backend` reads as they are."""
    return [
        size
        for size in range(block_size, 0, -1)
        if block_size % size == 0
        and backend.supports_block_size(size)
        and backend.get_kernel_block_size(size) == size
    ]


def plan_shared_kv_cache(
    backends: Sequence[type[AttentionBackend]],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    kv_cache_dtype: str = "auto",
) -> SharedKVCache:
    """Decide the cache `backends` share for layers of `num_kv_heads` x `head_size` in engine
    blocks of `block_size`: the largest kernel block size all read exactly, the first layout of
    `backends[0]` all take (same stride order), and `kv_cache_dtype`.

    `backends`: the decode backend first; duplicates allowed. MLA layers pass 1 and `L + R`.

    Raises:
        KVCacheNotShareableError (a ValueError): naming the backends and what differs (a
            backend that writes K/V in its forward, the kernel block sizes, the layouts, the
            logical shapes, or a cache dtype one of them does not take).
    """
    unique = tuple(dict.fromkeys(backends))
    names = " and ".join(b.get_name() for b in unique)
    api = f"KV cache shared by {names}"
    for backend in unique:
        if backend.forward_includes_kv_cache_update:
            raise KVCacheNotShareableError(
                f"{api}: {backend.get_name()} writes K/V inside its forward "
                "(forward_includes_kv_cache_update), so the layer could not write them once per "
                "step for both."
            )
        if not backend.supports_kv_cache_dtype(kv_cache_dtype):
            raise KVCacheNotShareableError(
                f"{api}: cache dtype not taken by {backend.get_name()} (got {kv_cache_dtype}, "
                f"expected one of {', '.join(backend.supported_kv_cache_dtypes)})."
            )
    per_backend = {b.get_name(): _exact_kernel_sizes(b, block_size) for b in unique}
    common = set.intersection(*(set(sizes) for sizes in per_backend.values()))
    if not common:
        offered = "; ".join(
            f"{name}: {', '.join(map(str, sizes)) or 'none'}" for name, sizes in per_backend.items()
        )
        raise KVCacheNotShareableError(
            f"{api}: no kernel block size all of them read for engine blocks of {block_size} "
            f"(kernel block sizes dividing {block_size}: {offered})."
        )
    kernel = max(common)
    layouts = [
        layout
        for layout in unique[0].supported_kv_cache_layouts()
        if all(layout in b.supported_kv_cache_layouts() for b in unique[1:])
    ]
    if not layouts:
        offered = "; ".join(
            f"{b.get_name()}: {', '.join(str(x) for x in b.supported_kv_cache_layouts())}"
            for b in unique
        )
        raise KVCacheNotShareableError(f"{api}: no KV-cache layout all of them take ({offered}).")
    dims = (8, kernel, num_kv_heads, head_size, kv_cache_dtype)
    shapes = {b.get_name(): tuple(b.get_kv_cache_shape(*dims)) for b in unique}
    layout = next(
        (x for x in layouts if len({b.get_kv_cache_stride_order(x) for b in unique}) == 1), None
    )
    if len(set(shapes.values())) > 1 or layout is None:
        what = "logical cache shapes" if len(set(shapes.values())) > 1 else "stride orders"
        detail = "; ".join(
            f"{b.get_name()}: {shapes[b.get_name()]} in order "
            f"{b.get_kv_cache_stride_order(layouts[0])}"
            for b in unique
        )
        raise KVCacheNotShareableError(
            f"{api}: the {what} differ for 8 blocks of {kernel} tokens, num_kv_heads "
            f"{num_kv_heads}, head_size {head_size} ({detail})."
        )
    return SharedKVCache(
        unique, kernel, layout, tuple(unique[0].get_kv_cache_stride_order(layout)), kv_cache_dtype
    )
