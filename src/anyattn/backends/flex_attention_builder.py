"""FLEX_ATTENTION's metadata: the step's layout and one BlockMask per distinct mask.

`build` lays the step out on the host (`flex_attention_plan`) and makes, for every distinct
`mask_key` of its layers, a `BlockMask`: block lists over `TILE x TILE` tiles and a mask_mod
keeping key rows `lo[q] ... hi[q]` of query row q (and key row 0, the sink slot, with sinks).
For layers that read the paged cache it also finds each key's cache block and offset on the
device, so that `forward` copies the keys with one indexing op. It never syncs with the device.
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
from anyattn.backends.flex_attention_plan import (
    FIRST_KEY_ROW,
    TILE,
    StepLayout,
    block_lists,
    lay_out_step,
    pad_keys,
    pad_rows,
    row_bounds,
)
from anyattn.metadata import CommonAttentionMetadata
from anyattn.types import ENCODER_TYPES, AttentionCGSupport, AttentionType

__all__ = ["FlexAttentionMetadata", "FlexAttentionMetadataBuilder", "mask_key"]


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
        layout: the host layout (`flex_attention_plan.StepLayout`).
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
