"""FLEX_ATTENTION's plan: the step's layout for FlexAttention, its BlockMasks, the metadata.

A step is one FlexAttention batch entry: a query row per token over a key workspace holding
every request's keys back to back. Key row 0 is the sink slot; request r's keys are rows
`key_start[r] ...` from `FIRST_KEY_ROW` (one tile on: a fresh prefill's causal diagonal stays on
tile boundaries). Token t keeps key rows `lo[t] ... hi[t]`. Rows and keys are padded to buckets
torch.compile never sees equal (equal sizes share a symbol, and compile again once they
differ); padding rows keep nothing. `build` lays the step out on the host (numpy), makes one
`BlockMask` per distinct `mask_key` of its layers, and for layers that read the paged cache
finds each key's cache block and offset on the device; it never syncs with the device.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from anyattn.async_copy import to_device
from anyattn.backend import AttentionMetadataBuilder
from anyattn.metadata import CommonAttentionMetadata
from anyattn.types import ENCODER_TYPES, AttentionCGSupport, AttentionType

__all__ = [
    "FIRST_KEY_ROW", "TILE", "FlexAttentionMetadata", "FlexAttentionMetadataBuilder",
    "StepLayout", "block_lists", "lay_out_step", "mask_key", "pad_keys", "pad_rows",
    "row_bounds",
]  # fmt: skip

TILE = 128  # a BlockMask marks tiles of TILE query rows x TILE key rows
FIRST_KEY_ROW = TILE  # the key workspace's first request key row (row 0 is the sink slot)


def pad_rows(num_rows: int) -> int:
    """Padded length for `num_rows` query rows: a power of two up to 8192, then a multiple of
    an eighth of the next power of two. Always an even number of tiles, at least two (torch.
    compile specialises dimensions of size 1)."""
    n = max(num_rows, 2 * TILE)
    power = 1 << (n - 1).bit_length()
    if power <= 8192:
        return power
    step = power // 8
    return -(-n // step) * step


def pad_keys(num_key_rows: int) -> int:
    """Padded length for `num_key_rows` key rows: `pad_rows(n) + TILE`, an odd number of tiles,
    so never equal to a row count (even tiles) or to a tile count."""
    return pad_rows(num_key_rows) + TILE


@dataclass(frozen=True)
class StepLayout:
    """Where one step's keys and queries sit, in key-workspace rows.

    Attributes:
        num_key_rows: rows in use: `FIRST_KEY_ROW` + every request's keys.
        query_start_loc, key_start, key_lens: int64 `[num_reqs (+ 1)]`: each request's first
            query token, first key row and number of keys.
        lo, hi_full: int64 `[num_tokens]`: the first and last key row of the token's request.
        q_key_pos: int64 `[num_tokens]`: the token's own position as a key row (the last key
            it keeps under causal attention; ALiBi's query position).
    """

    num_key_rows: int
    query_start_loc: np.ndarray
    key_start: np.ndarray
    key_lens: np.ndarray
    lo: np.ndarray
    hi_full: np.ndarray
    q_key_pos: np.ndarray


def lay_out_step(
    query_start_loc: np.ndarray, key_lens: np.ndarray, context_lens: np.ndarray
) -> StepLayout:
    """Lay the requests' keys (`key_lens [num_reqs]`: seq_lens, or the encoder's lengths for
    cross attention) back to back from `FIRST_KEY_ROW` and place each query token
    (`query_start_loc [num_reqs + 1]`, `context_lens [num_reqs]` tokens before this step). The
    layout's arrays are its own (the caller's may be refilled for the next step)."""
    q_start = np.asarray(query_start_loc, dtype=np.int64).copy()
    lens = np.asarray(key_lens, dtype=np.int64).copy()
    query_lens = np.diff(q_start)
    key_start = FIRST_KEY_ROW + np.cumsum(lens) - lens
    # token t of request r sits at key row key_start[r] + context_lens[r] + (t - q_start[r])
    offset = key_start + np.asarray(context_lens, dtype=np.int64) - q_start[:-1]
    q_key_pos = (
        np.repeat(offset, query_lens) + np.arange(int(q_start[-1] - q_start[0])) + q_start[0]
    )
    return StepLayout(
        num_key_rows=FIRST_KEY_ROW + int(lens.sum()),
        query_start_loc=q_start,
        key_start=key_start,
        key_lens=lens,
        lo=np.repeat(key_start, query_lens),
        hi_full=np.repeat(key_start + lens - 1, query_lens),
        q_key_pos=q_key_pos,
    )


def row_bounds(
    layout: StepLayout, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Each token's first and last kept key row (`[num_tokens]` each): causality ends them at
    the token's own position, a window of W starts them at `position - W + 1`."""
    hi = layout.q_key_pos if causal else layout.hi_full
    if window is None:
        return layout.lo, hi
    return np.maximum(layout.lo, layout.q_key_pos - (window - 1)), hi


def block_lists(
    lo: np.ndarray,
    hi: np.ndarray,
    query_start_loc: np.ndarray,
    has_sink: bool,
    num_rows: int,
    num_keys: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """FlexAttention's block lists for rows that keep key rows `lo[t] ... hi[t]` (token t).

    Within a request both bounds never decrease from token to token and consecutive ranges
    overlap or touch, so the rows of one request inside one row tile (a segment) keep exactly
    the key rows `lo[first] ... hi[last]`. A tile is full when one segment holds all of its row
    tile's tokens and every one keeps all the tile's keys (padding rows are never read). Key
    tile 0 is never full (rows 1 ... 127 are masked); with `has_sink` every row tile holding a
    token visits it. `lo > hi`: no keys; `num_rows`, `num_keys` are multiples of `TILE`.

    Returns int32 `(kv_num_blocks [1, 1, R], kv_indices [1, 1, R, K], full_kv_num_blocks,
    full_kv_indices)` (R row tiles, K key tiles): each row tile's marked key tiles first, in
    increasing order, then the others.
    """
    shape = (num_rows // TILE, num_keys // TILE)
    partial, full = np.zeros((2, *shape), dtype=bool)
    n = lo.shape[0]
    if n:
        starts = np.union1d(np.asarray(query_start_loc[:-1]), np.arange(0, n, TILE))
        starts = starts[starts < n]
        ends = np.append(starts[1:], n)
        first, last = starts, ends - 1
        tile = starts // TILE
        kept = lo[first] <= hi[last]
        _mark(partial, tile[kept], lo[first][kept] // TILE, hi[last][kept] // TILE)
        # full: the segment holds all its tile's tokens; key tiles inside every row's range
        alone = (starts % TILE == 0) & (ends == np.minimum(starts + TILE, n))
        full_lo = -(-lo[last] // TILE)
        full_hi = (hi[first] + 1) // TILE - 1
        whole = kept & alone & (full_lo <= full_hi)
        _mark(full, tile[whole], full_lo[whole], full_hi[whole])
        full[:, 0] = False
        partial &= ~full
        if has_sink:
            partial[: -(-n // TILE), 0] = True
    return (*_lists(partial), *_lists(full))


def _mark(grid: np.ndarray, tile: np.ndarray, first: np.ndarray, last: np.ndarray) -> None:
    """Marks key tiles `first[i] ... last[i]` of row tile `tile[i]` (a difference array)."""
    diff = np.zeros((grid.shape[0], grid.shape[1] + 1), dtype=np.int64)
    np.add.at(diff, (tile, first), 1)
    np.add.at(diff, (tile, last + 1), -1)
    grid |= np.cumsum(diff, axis=1)[:, :-1] > 0


def _lists(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(num_blocks [1, 1, R], indices [1, 1, R, K])` of a bool tile grid: a stable argsort
    puts each row tile's marked key tiles first."""
    num = grid.sum(axis=1, dtype=np.int32)
    indices = np.argsort(~grid, axis=1, kind="stable").astype(np.int32)
    return num[None, None], indices[None, None]


MaskKey = tuple[bool, "int | None", bool]


def mask_key(
    attn_type: AttentionType, step_causal: bool, window: int | None, has_sinks: bool
) -> MaskKey:
    """What a layer's BlockMask depends on: causality (decoder layers of a causal step), its
    sliding window and whether it has sinks."""
    return (step_causal and attn_type == AttentionType.DECODER, window, has_sinks)


@dataclass(frozen=True)
class FlexAttentionMetadata:
    """What `FlexAttentionImpl.forward` reads for one step.

    Attributes:
        num_actual_tokens: real tokens; output rows past it are untouched.
        block_size: tokens per block of the block table.
        slot_mapping: int64 `[num_tokens]` (device), for the layer's cache write.
        causal: the step's causal flag (decoder layers only).
        layout: the host layout (`StepLayout`).
        num_rows, num_keys: padded query and key rows the kernel sees.
        q_key_pos: int32 `[num_rows]` (device): each row's position as a key row (ALiBi).
        masks: one `BlockMask` per `mask_key` of the builder's layers.
        key_blocks, key_offsets: int64 (device): cache block and offset of each key in use,
            or None when no layer reads the cache.
        layer_names: the builder's layers (`forward` refuses others).
        common_attn_metadata: the step it was built from (its mirrors for the checks).
    """

    num_actual_tokens: int
    block_size: int
    slot_mapping: torch.Tensor
    causal: bool
    layout: StepLayout
    num_rows: int
    num_keys: int
    q_key_pos: torch.Tensor
    masks: Mapping[MaskKey, object]
    key_blocks: torch.Tensor | None
    key_offsets: torch.Tensor | None
    layer_names: frozenset[str]
    common_attn_metadata: CommonAttentionMetadata


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder[FlexAttentionMetadata]):
    """Builds `FlexAttentionMetadata` from the CPU mirrors; never syncs with the device."""

    _cudagraph_support = AttentionCGSupport.NEVER
    backend: ClassVar[type]  # set in `anyattn.backends.flex_attention`

    def __init__(self, kv_cache_spec, layers, limits, device) -> None:
        super().__init__(kv_cache_spec, layers, limits, device)
        self.backend.check_kv_cache_spec(kv_cache_spec, type(self).__name__)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> FlexAttentionMetadata:
        api = f"{type(self).__name__}.build"
        cm = common_attn_metadata
        if common_prefix_len:
            raise ValueError(
                f"{api}: cascade attention not supported (got common_prefix_len="
                f"{common_prefix_len}, expected 0). FLEX_ATTENTION declares no cascade."
            )
        host, num_reqs, block_size = cm.host_batch, cm.num_reqs, self.kv_cache_spec.block_size
        key_lens = host.seq_lens
        if cm.encoder_seq_lens_cpu is not None:  # cross attention: the encoder's keys
            key_lens = cm.encoder_seq_lens_cpu.numpy()[:num_reqs]
        longest = int(key_lens.max(initial=0))
        width = cm.block_table_tensor.shape[1]
        if longest > width * block_size:
            raise ValueError(
                f"{api}: block_table too narrow for the longest sequence (got {width} columns, "
                f"expected >= {-(-longest // block_size)} for block_size {block_size})."
            )
        layout = lay_out_step(host.query_start_loc, key_lens, host.context_lens)
        n = cm.num_actual_tokens
        num_rows, num_keys = pad_rows(n), pad_keys(layout.num_key_rows)
        device = self.device
        q_key_pos = np.zeros(num_rows, dtype=np.int32)
        q_key_pos[:n] = layout.q_key_pos[:n]
        masks = {}
        for params in self.layers.values():
            key = mask_key(params.attn_type, cm.causal, params.sliding_window, params.has_sinks)
            if key not in masks:
                masks[key] = _block_mask(layout, key, n, num_rows, num_keys, device)
        key_blocks = key_offsets = None
        if any(p.attn_type not in ENCODER_TYPES for p in self.layers.values()):
            key_blocks, key_offsets = _key_slots(layout, cm.block_table_tensor, block_size, device)
        return FlexAttentionMetadata(
            num_actual_tokens=n,
            block_size=block_size,
            slot_mapping=cm.slot_mapping,
            causal=cm.causal,
            layout=layout,
            num_rows=num_rows,
            num_keys=num_keys,
            q_key_pos=to_device(q_key_pos, device),
            masks=masks,
            key_blocks=key_blocks,
            key_offsets=key_offsets,
            layer_names=frozenset(self.layer_names),
            common_attn_metadata=cm,
        )


def _block_mask(
    layout: StepLayout, key: MaskKey, n: int, num_rows: int, num_keys: int, device
) -> object:
    """The BlockMask of one `mask_key`."""
    from torch.nn.attention.flex_attention import BlockMask

    causal, window, has_sink = key
    lo, hi = row_bounds(layout, causal, window)
    lists = block_lists(lo[:n], hi[:n], layout.query_start_loc, has_sink, num_rows, num_keys)
    bounds = np.zeros((2, num_rows), dtype=np.int32)
    bounds[0, n:] = 1  # padding rows keep nothing (lo 1 > hi 0)
    bounds[0, :n], bounds[1, :n] = lo[:n], hi[:n]
    row_lo, row_hi = (to_device(b, device) for b in bounds)
    tensors = [to_device(a, device) for a in lists]
    # row and key tile counts vary with the step
    for tensor in tensors:
        for dim in range(2, tensor.dim()):
            torch._dynamo.mark_dynamic(tensor, dim)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (kv_idx >= row_lo[q_idx]) & (kv_idx <= row_hi[q_idx])
        return keep | (kv_idx == 0) if has_sink else keep

    return BlockMask.from_kv_blocks(
        *tensors, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(num_rows, num_keys),
        **_no_q_blocks(),
    )  # fmt: skip


def _key_slots(
    layout: StepLayout, block_table: torch.Tensor, block_size: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache block and offset of each key row in use (int64 `[num_key_rows - FIRST_KEY_ROW]`
    each, on `device`), by one device gather: request r's key j is in column `j // block_size`
    of its block-table row."""
    lens = layout.key_lens
    request = np.repeat(np.arange(lens.shape[0]), lens)
    position = np.arange(request.shape[0]) - np.repeat(layout.key_start - FIRST_KEY_ROW, lens)
    request_t, position_t = (to_device(a, device) for a in (request, position))
    blocks = block_table[request_t, torch.div(position_t, block_size, rounding_mode="floor")]
    return blocks.long(), position_t % block_size


@functools.cache
def _no_q_blocks() -> dict[str, bool]:
    """`compute_q_blocks=False` where torch takes it: without it `from_kv_blocks` also builds
    the transposed (backward-only) lists on the device."""
    from torch.nn.attention.flex_attention import BlockMask

    parameters = inspect.signature(BlockMask.from_kv_blocks).parameters
    return {"compute_q_blocks": False} if "compute_q_blocks" in parameters else {}
