"""FLEX_ATTENTION's per-step block masks on the device.

`flex_attention_plan` lays a step out on the host (numpy); this turns that layout into what
FlexAttention reads for one (causal, window, G, sink) combination of a layer: the BlockMask
(its partial and full tile lists, and a mask_mod over per-row or per-entry key bounds), the
positions and query-head indices the score mods read, and the score mod itself. Two layouts:

- `RowsPlan` (`make_rows_plan`): one batch entry, a row per token from `first_token` on
  (prefills, chunks, encoder and cross attention, and any decode not at the front of the
  batch). FLEX_ATTENTION plans it with `group` 1: FlexAttention's GQA serves a token's query
  heads. With `group` G > 1 row `t * G + g` would be token t's g-th query head of one KV head
  (the layout the backend used before: it needs the queries and output transposed).
- `DecodePlan` (`make_decode_plan`): the step's leading single-token requests, one batch entry
  each, for FlexAttention's decoding kernel.

Each plan's integer tensors are written by numpy into one host buffer (pinned on a GPU) and
copied section by section, so making a plan costs one host pass and a few non-blocking copies,
and never waits on the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from anyattn.backends.flex_attention_plan import (
    TILE,
    StepLayout,
    TileRuns,
    block_lists,
    decode_block_lists,
    pad_decodes,
    pad_rows,
    skipping_keys,
    tile_runs,
    window_lo,
)

if TYPE_CHECKING:
    from anyattn.backends.flex_attention import FlexAttentionMetadata

__all__ = [
    "FROM_KV_BLOCKS_TAKES_COMPUTE_Q",
    "DecodePlan",
    "RowsPlan",
    "host_sections",
    "make_decode_plan",
    "make_rows_plan",
    "score_mod",
]


@dataclass
class RowsPlan:
    """What one (causal, window, G, sink) combination of a step needs on the device, for the
    rows of tokens `first_token ...` (the tokens the decode layout leaves)."""

    first_token: int
    num_rows: int
    block_mask: object  # its mask_mod reads the first / last kept key of each row
    # int32 [num_rows]: the row's own position in the workspace's key rows (shifted with
    # `keys_skipped`)
    q_key_pos: torch.Tensor
    group_index: torch.Tensor  # int32 [num_rows]: query head within its group (0 with group 1)

    def position(self, b, q_idx):
        return self.q_key_pos[q_idx]

    def head(self, q_idx):
        return self.group_index[q_idx]


@dataclass
class DecodePlan:
    """The same for the decode layout: batch entry b is request b, a single-token
    request at the front of the batch; its query rows are its query heads of one KV head."""

    num_decodes: int
    batch: int  # num_decodes padded (`pad_decodes`)
    block_mask: object  # its mask_mod reads the first / last kept key of each entry
    q_key_pos: torch.Tensor  # int32 [batch]: the token's own position, key coordinates

    def position(self, b, q_idx):
        return self.q_key_pos[b]

    def head(self, q_idx):
        return q_idx


def make_rows_plan(
    md: FlexAttentionMetadata,
    causal: bool,
    window: int | None,
    group: int,
    has_sink: bool,
    device: torch.device,
    first_token: int = 0,
    keys_skipped: bool = False,
) -> RowsPlan:
    """Per-row key bounds and the BlockMask for one (causal, window, group, sink) combination,
    over the tokens from `first_token` on (which start a request). With `keys_skipped` the
    requests before them have no keys in the workspace (`skipping_keys`: their decodes read
    the cache in place), and the bounds are in the rows' own key coordinates."""
    layout, t0 = md.layout, first_token
    # (tokens before t0 are single-token requests: t0 is also the count of requests skipped)
    key_offset, kv_rows_padded = (
        skipping_keys(layout, t0) if keys_skipped else (0, md.kv_rows_padded)
    )
    lo, hi = (bound[t0:] for bound in _key_bounds(layout, causal, window))
    q_key_pos = layout.q_key_pos[t0:]
    if key_offset:
        lo, hi, q_key_pos = lo - key_offset, hi - key_offset, q_key_pos - key_offset
    q_start = layout.query_start_loc
    # the requests from token t0 on (t0 is 0 or the count of leading single-token requests)
    q_start = q_start[t0:] - q_start[t0] if t0 else q_start
    num_rows = pad_rows((md.num_actual_tokens - t0) * group)
    shape = (num_rows // TILE, kv_rows_padded // TILE)
    runs = tile_runs(lo, hi, q_start, group, has_sink)
    tensors = _plan_tensors(lo, hi, q_key_pos, group, num_rows, runs, shape, device)
    row_lo, row_hi, q_key_pos, group_index, *lists = tensors
    # (row and key tile counts vary with the step)
    seq_lengths = (num_rows, kv_rows_padded)
    block_mask = _block_mask(lists, row_lo, row_hi, False, has_sink, seq_lengths, (2, 3))
    return RowsPlan(
        first_token=t0,
        num_rows=num_rows,
        block_mask=block_mask,
        q_key_pos=q_key_pos,
        group_index=group_index,
    )


def make_decode_plan(
    md: FlexAttentionMetadata,
    causal: bool,
    window: int | None,
    group: int,
    has_sink: bool,
    device: torch.device,
) -> DecodePlan:
    """The decode layout's key bounds and BlockMask for the step's leading single-token
    requests (one batch entry each, padded to `pad_decodes`)."""
    layout = md.layout
    n, key_tiles = layout.num_decodes, md.kv_rows_padded // TILE
    batch = pad_decodes(n, group)
    sizes = [batch] * 3 + [batch, batch * key_tiles] * 2

    def fill(buffer: np.ndarray, sections: list[np.ndarray]) -> None:
        lo, hi, pos = sections[:3]
        lo[:n], hi[:n] = (bound[:n] for bound in _key_bounds(layout, causal, window))
        pos[:n] = layout.q_key_pos[:n]
        lo[n:], hi[n:], pos[n:] = 1, 0, 0  # padding entries keep nothing
        decode_block_lists(lo, hi, has_sink, key_tiles, out=tuple(sections[3:]))

    entry_lo, entry_hi, q_key_pos, *lists = host_sections(sizes, fill, device)
    shapes = ((batch, 1, 1), (batch, 1, 1, key_tiles)) * 2
    lists = [t.view(s) for t, s in zip(lists, shapes, strict=True)]
    # Batch and key tile counts vary with the step. (Marking the batch fails Inductor's CPU
    # template (torch 2.13), where it is symbolic under dynamic=True all the same: the CPU
    # recompile test counts it.)
    dims = (0, 3) if device.type == "cuda" else (3,)
    seq_lengths = (group, md.kv_rows_padded)
    block_mask = _block_mask(lists, entry_lo, entry_hi, True, has_sink, seq_lengths, dims)
    return DecodePlan(num_decodes=n, batch=batch, block_mask=block_mask, q_key_pos=q_key_pos)


def _key_bounds(
    layout: StepLayout, causal: bool, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Each token's first and last kept key row (`[num_tokens]` each): the window raises the
    first, causality picks the token's own position as the last."""
    return window_lo(layout, window), layout.hi_causal if causal else layout.hi_full


def _block_mask(
    lists: list[torch.Tensor],
    lo: torch.Tensor,
    hi: torch.Tensor,
    by_entry: bool,
    has_sink: bool,
    seq_lengths: tuple[int, int],
    dynamic_dims: tuple[int, ...],
):
    """The BlockMask of tile `lists` (partial, then full: num_blocks and indices each) whose
    mask_mod keeps keys `lo[i] ... hi[i]` (and key 0 with a sink), `i` the query row or, with
    `by_entry`, the batch entry. `dynamic_dims` of the lists are marked symbolic for
    torch.compile, so that no step size recompiles."""
    from torch.nn.attention.flex_attention import BlockMask

    def mask_mod(b, h, q_idx, kv_idx):
        i = b if by_entry else q_idx
        keep = (kv_idx >= lo[i]) & (kv_idx <= hi[i])
        return keep | (kv_idx == 0) if has_sink else keep

    for tensor in lists:
        for dim in dynamic_dims:
            if dim < tensor.dim():
                torch._dynamo.mark_dynamic(tensor, dim)
    extra = {"compute_q_blocks": False} if FROM_KV_BLOCKS_TAKES_COMPUTE_Q else {}
    return BlockMask.from_kv_blocks(
        *lists, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=seq_lengths, **extra
    )


# Sections of a plan's host buffer start at multiples of 16 int32 (64 bytes): Inductor's GPU
# kernels assume aligned inputs (and copy misaligned ones first).
_ALIGN = 16


def _plan_tensors(
    lo: np.ndarray,
    hi: np.ndarray,
    q_key_pos: np.ndarray,
    group: int,
    num_rows: int,
    runs: tuple[TileRuns, TileRuns],
    shape: tuple[int, int],
    device: torch.device,
) -> list[torch.Tensor]:
    """int32 `row_lo, row_hi, q_key_pos, group_index [num_rows]`, then the partial and the full
    tiles' `num_blocks [1, 1, row_tiles]` and `indices [1, 1, row_tiles, key_tiles]`.

    On the per-step host path each torch op costs microseconds and each `pin_memory()` more, so
    numpy writes them all into one host buffer (pinned from the start on a GPU). Every section
    then becomes a tensor of its own at storage offset 0: on the CPU by `from_numpy` (no copy),
    on a GPU by one non-blocking copy per section. Not views of one device buffer: each symbolic
    storage offset is one more size symbol in the compiled kernel, and Inductor's CPU template,
    which renames two of them by text substitution, fails to compile once one name is a prefix
    of another (`ks1`, `ks17`; torch 2.13); the GPU kernels were verified with offset-0 inputs.
    """
    sizes = [num_rows] * 4 + [shape[0], shape[0] * shape[1]] * 2

    def fill(buffer: np.ndarray, sections: list[np.ndarray]) -> None:
        # (rows are a multiple of 256: the four row sections lie back to back)
        _fill_rows(buffer[: 4 * num_rows].reshape(4, num_rows), lo, hi, q_key_pos, group)
        for i, marked in enumerate(runs):
            block_lists(marked, shape, out=(sections[4 + 2 * i], sections[5 + 2 * i]))

    tensors = host_sections(sizes, fill, device)
    list_shapes = ((1, 1, shape[0]), (1, 1, *shape)) * 2
    return [*tensors[:4], *(t.view(s) for t, s in zip(tensors[4:], list_shapes, strict=True))]


def host_sections(
    sizes: list[int],
    fill: Callable[[np.ndarray, list[np.ndarray]], None],
    device: torch.device,
) -> list[torch.Tensor]:
    """int32 tensors of `sizes` on `device`, each at storage offset 0, written by
    `fill(buffer, sections)` as numpy sections of one host buffer (pinned on a GPU: one
    non-blocking copy per section). Sections start at multiples of `_ALIGN` int32."""
    # the buffer's chunks: each section, then the padding that aligns the next one
    chunks = [n for size in sizes for n in (size, -size % _ALIGN)]
    host = torch.empty(sum(chunks), dtype=torch.int32, pin_memory=device.type == "cuda")
    buffer = host.numpy()
    starts = list(itertools.accumulate(chunks, initial=0))[:-1:2]
    sections = [buffer[start : start + size] for start, size in zip(starts, sizes, strict=True)]
    fill(buffer, sections)
    if device.type == "cpu":
        return [torch.from_numpy(section) for section in sections]
    return [
        host[start : start + size].to(device, non_blocking=True)
        for start, size in zip(starts, sizes, strict=True)
    ]


def _fill_rows(
    rows: np.ndarray, lo: np.ndarray, hi: np.ndarray, q_key_pos: np.ndarray, group: int
) -> None:
    """Writes int32 `rows [4, num_rows]`: each row's first and last kept key and its own
    position (its token's, for the token's `group` rows; padding rows keep nothing: lo 1 >
    hi 0, at position 0), then its query head within its KV head's group."""
    num_tokens, num_rows = lo.shape[0], rows.shape[1]
    used = num_tokens * group
    per_token = np.array((lo, hi, q_key_pos), dtype=np.int32)
    # (splitting the last axis of a slice gives a view: the writes land in `rows`)
    per_row = rows[:3, :used].reshape(3, num_tokens, group)
    if group <= 8:
        # numpy's inner loop runs over the last axis: one long strided copy per query head
        # beats a broadcast whose inner loop is `group` elements long.
        for head in range(group):
            per_row[:, :, head] = per_token
    else:
        per_row[:] = per_token[:, :, None]
    rows[:3, used:] = ((1,), (0,), (0,))
    whole = num_rows - num_rows % group
    rows[3, :whole] = np.tile(np.arange(group, dtype=np.int32), whole // group)
    rows[3, whole:] = np.arange(num_rows - whole)


def _from_kv_blocks_takes_compute_q() -> bool:
    import inspect

    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return False
    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


# Without it, from_kv_blocks also builds the transposed (backward-only) lists on the device.
FROM_KV_BLOCKS_TAKES_COMPUTE_Q = _from_kv_blocks_takes_compute_q()


def score_mod(mods: dict[str, torch.Tensor], plan: RowsPlan | DecodePlan) -> Callable:
    """Scale, soft cap, ALiBi, then the sink logit at key 0: DESIGN.md's order. `h` is the
    kernel's head (the KV head in the decode layouts, the query head in FLEX_ATTENTION's rows);
    the plan says which query head of its group (0 for those rows) and which position a row
    is, and `mods`' per-head tensors are `[heads, group]` to match."""
    scale, soft_cap = mods["scale"], mods.get("soft_cap")
    slopes, sinks = mods.get("alibi_slopes"), mods.get("sinks")
    position, head = plan.position, plan.head

    def score_mod(score, b, h, q_idx, kv_idx):
        score = score * scale
        if soft_cap is not None:
            score = soft_cap * torch.tanh(score / soft_cap)
        if slopes is not None:
            # key position minus query position: both in workspace coordinates
            score = score + slopes[h, head(q_idx)] * (kv_idx - position(b, q_idx))
        if sinks is not None:
            score = torch.where(kv_idx == 0, sinks[h, head(q_idx)], score)
        return score

    return score_mod
