"""FLEX_ATTENTION's paged decode: FlexAttention's decoding kernel reading the KV cache in place.

A decode step's keys are the bulk of its memory traffic, and copying them out of the paged
cache before attending (what the rest of the backend does) reads and writes them once more
than attention itself: for 64 requests x 4096 keys on an H200 the copy took 0.54 ms and the
attention 0.37 ms. Here nothing is copied. K and V are strided views of the cache itself,
`[1, KVH, rows, D]`, whose row r is token `r % block_size` of view block `r // block_size`;
cache block `p` is view block `m * p` (`m` fixed by the layout: 2 for NHD, `2 * KVH` for HND,
since a block's K and V, and with HND its other heads, lie between one block's rows and the
next's). Batch entry b is decode request b; its BlockMask lists the view blocks of its own
block table row (`m * block_table[b]`, from the first block of its sliding window on) and
marks every one partial, so the mask_mod keeps the whole of each but the first and the last,
the keys from the window's start in the first and the first `last_len[b]` in the last.

Why every block is partial: FlexAttention's decoding kernel sizes its KV splits by the view's
whole length when full blocks are given, and by the entry's own blocks only when none are.

Why a static batch: the decoding kernel is taken only when the batch and head counts are
static (with a symbolic batch torch falls back to its main kernel, 1.8x slower on an H200), so
each batch bucket (`flex_attention_plan.pad_paged_batch`) compiles a graph of its own (1-4 s
each on an H200), once per process and cache geometry. The block lists are a fixed width
wide (`FlexAttentionMetadata.max_blocks_per_req`), so a step whose longest request grew by a
block does not compile again.

Kernel options: `flex_attention_launch.paged_decode_options` pipelines the decoding kernel
(its default launch is one stage: 1.79x its own call over contiguous keys at 16-token pages).

Where it applies (`paged_kv_views`, `FlexAttentionImpl._in_place`): CUDA, a decoder layer
without ALiBi or sinks (ALiBi needs a key's position, which a view block does not carry; a
sink would need a key of its own), a cache of the model dtype (fp8 is dequantised by the
copy), block sizes a power of two of at least 16 (the kernel's smallest key tile; its
template builds no other tiles), views whose offsets stay int32, and torch's
`BlockMask.from_kv_blocks(compute_q_blocks=...)`, without which torch would build a dense
mask over the whole cache. Anything else takes the copying decode layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from anyattn.backends.flex_attention_masks import FROM_KV_BLOCKS_TAKES_COMPUTE_Q, host_sections
from anyattn.backends.flex_attention_plan import TILE, pad_paged_batch, paged_decode_lists

if TYPE_CHECKING:
    from anyattn.backends.flex_attention import FlexAttentionMetadata

__all__ = [
    "PagedDecodePlan",
    "PagedKV",
    "make_paged_decode_plan",
    "paged_kv_views",
]

# The decoding kernel's smallest key tile (Triton's dot needs 16 rows).
_MIN_BLOCK = 16
_MAX_ELEMENTS = 2**31


@dataclass(frozen=True, slots=True)
class PagedKV:
    """K and V as FlexAttention reads them in place: `[1, KVH, rows, D]` views of one cache.

    Attributes:
        key, value: the views (row r: token `r % block_size` of view block
            `r // block_size`).
        blocks_per_cache_block: `m`: cache block p is view block `m * p`.
    """

    key: torch.Tensor
    value: torch.Tensor
    blocks_per_cache_block: int


def paged_kv_views(kv_cache: torch.Tensor) -> PagedKV | None:
    """The in-place views of `kv_cache` (logical `(num_blocks, 2, block_size, KVH, D)`, any
    layout), or None where FlexAttention cannot read it in place (see the module docstring)."""
    if not FROM_KV_BLOCKS_TAKES_COMPUTE_Q or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        return None
    num_blocks, _, block_size, kv_heads, size = kv_cache.shape
    s_block, s_kv, s_token, s_head, s_dim = kv_cache.stride()
    # (FlexAttention's decoding template builds key tiles of a power of two only: blocks of
    # 48 or 96 fail to compile there)
    power_of_two = block_size & (block_size - 1) == 0
    if block_size % _MIN_BLOCK or not power_of_two or s_dim != 1 or s_token <= 0:
        return None
    # Rows must be evenly spaced across blocks: a cache block spans m >= 1 view blocks.
    span = s_token * block_size
    if s_block < span or s_block % span:
        return None
    m = s_block // span
    # the last row any request can use: the last cache block's last token
    rows = (num_blocks - 1) * m * block_size + block_size
    # offsets from each view's start stay int32
    if (kv_heads - 1) * s_head + (rows - 1) * s_token + size >= _MAX_ELEMENTS:
        return None
    shape, strides = (1, kv_heads, rows, size), (rows * s_token, s_head, s_token, 1)
    base = kv_cache.storage_offset()
    key = kv_cache.as_strided(shape, strides, base)
    value = kv_cache.as_strided(shape, strides, base + s_kv)
    return PagedKV(key=key, value=value, blocks_per_cache_block=m)


@dataclass(slots=True)
class PagedDecodePlan:
    """The step's leading single-token requests, one batch entry each, over the cache in place.

    Attributes:
        num_decodes: real entries (requests `0 ... num_decodes - 1`).
        batch: entries the kernel sees (`pad_paged_batch(num_decodes)`; the padding visits
            nothing).
        block_mask: lists `m * block_table[b]` (with a window, from its first block on),
            all partial; its mask_mod keeps every key of the middle blocks, the keys from the
            window's start in the first and the first `last_len[b]` in the last.
    """

    num_decodes: int
    batch: int
    block_mask: object


def make_paged_decode_plan(
    md: FlexAttentionMetadata,
    paged: PagedKV,
    group: int,
    window: int | None,
    device: torch.device,
) -> PagedDecodePlan:
    """The BlockMask of the step's leading decodes (`md.layout.num_decodes` of them) over the
    views of `paged`, for a layer of `group` query heads per KV head and a sliding `window`
    (or None).

    Host work: five int32 arrays of the padded batch (`paged_decode_lists`), copied in one
    pinned buffer. Device work, none of it waiting on the device: the block table rows scaled
    into view blocks (with a window, from each entry's first block in the window on) and each
    entry's first and last view blocks gathered.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n, block_size = md.layout.num_decodes, md.block_size
    m = paged.blocks_per_cache_block
    batch = pad_paged_batch(n)

    def fill(buffer: np.ndarray, sections: list[np.ndarray]) -> None:
        paged_decode_lists(md.layout.key_lens[:n], block_size, window, out=tuple(sections))

    num_blocks, first_col, first_off, last_col, last_len = host_sections([batch] * 5, fill, device)
    table = md.block_table[:n]
    width = table.shape[1]
    # The lists are a fixed width wide (the kernel bakes it in: an engine's table grows with
    # its longest request, and each width would compile again); the columns past the table's
    # are never read, each entry's block count stops before them. A buffer per window: the
    # plans of one step must not share one.
    lists_width = max(width, md.max_blocks_per_req)
    indices = md.workspace.get(f"paged_indices/{window}", (batch, lists_width), torch.int32,
                               device)  # fmt: skip
    # (rows past n keep earlier values: valid block numbers an entry with no blocks never reads)
    if window is None:
        torch.mul(table, m, out=indices[:n, :width])
        first_block = None
    else:
        # entry b's list starts at its window's first block (columns past the table's last
        # are clamped: never read either)
        columns = first_col[:n, None] + torch.arange(width, dtype=torch.int32, device=device)
        columns = columns.clamp_(max=width - 1).long()
        torch.mul(table.gather(1, columns), m, out=indices[:n, :width])
        first_block = indices[:, 0]
    # the last block's position in the list
    last_in_list = (last_col - first_col).clamp_(min=0).long().view(batch, 1)
    last_block = indices.gather(1, last_in_list).view(batch)

    if first_block is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx // block_size != last_block[b]) | (kv_idx % block_size < last_len[b])

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            block, offset = kv_idx // block_size, kv_idx % block_size
            after_lo = (block != first_block[b]) | (offset >= first_off[b])
            return after_lo & ((block != last_block[b]) | (offset < last_len[b]))

    block_mask = BlockMask.from_kv_blocks(
        num_blocks.view(batch, 1, 1),
        indices.view(batch, 1, 1, lists_width),
        BLOCK_SIZE=(TILE, block_size),
        mask_mod=mask_mod,
        seq_lengths=(group, paged.key.shape[2]),
        compute_q_blocks=False,
    )
    return PagedDecodePlan(num_decodes=n, batch=batch, block_mask=block_mask)
