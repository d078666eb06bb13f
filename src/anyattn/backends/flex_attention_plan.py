"""How FLEX_ATTENTION lays a step out for FlexAttention: pure numpy functions on the host.

A step is one FlexAttention batch entry: a query row per token over a key workspace holding
every request's keys back to back. Key row 0 is the sink slot; request r's keys are rows
`key_start[r] ...` from `FIRST_KEY_ROW`, one whole tile on, which keeps a fresh prefill's causal
diagonal on tile boundaries. Token t keeps key rows `lo[t] ... hi[t]`. Rows and keys are padded
to buckets that torch.compile never sees equal (it gives equal sizes one symbol and compiles
again once they differ); padding rows keep nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "FIRST_KEY_ROW", "TILE", "StepLayout", "block_lists", "lay_out_step", "pad_keys", "pad_rows",
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
