"""How FLEX_ATTENTION lays a step out for FlexAttention, as small pure functions on the host.

Everything here works on numpy arrays from the `*_cpu` mirrors of `CommonAttentionMetadata`,
so it is tested exactly on the CPU and never synchronises with a GPU:

- `lay_out_step`: where each request's keys go in the key workspace (row 0 is the sink slot)
  and, per query token, the range of key rows it keeps (causal or bidirectional) and its own
  position, in workspace coordinates.
- `window_lo`: the first kept key row under a sliding window.
- `pad_rows`, `pad_keys`: the bucketed lengths the compiled kernel sees.
- `tile_masks`, `block_lists`: FlexAttention's block-sparse mask (which 128 x 128 tiles of
  query rows x key rows to visit, and which of them need no mask at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "TILE",
    "StepLayout",
    "block_lists",
    "lay_out_step",
    "pad_keys",
    "pad_rows",
    "tile_masks",
    "window_lo",
]

# FlexAttention's sparse block: a BlockMask marks tiles of 128 query rows x 128 key rows.
TILE = 128
# Two tiles at least: torch.compile specialises dimensions of size 1 (one more graph).
_MIN_ROWS = 2 * TILE


def pad_rows(num_rows: int) -> int:
    """Padded length for `num_rows` query rows: a power of two (at least 256) up to 8192, then
    a multiple of an eighth of the next power of two (at most 12.5% padding). Always an even
    number of tiles."""
    n = max(num_rows, _MIN_ROWS)
    power = 1 << (n - 1).bit_length()
    if power <= 8192:
        return power
    step = power // 8
    return -(-n // step) * step


def pad_keys(num_key_rows: int) -> int:
    """Padded length for `num_key_rows` key rows: `pad_rows(n) + TILE`, an odd number of tiles.

    torch.compile gives equal sizes one symbol ("duck sizing") and recompiles at the first step
    where they differ; with rows an even and keys an odd number of tiles, no row count, key
    count or tile count can ever be equal to another.
    """
    return pad_rows(num_key_rows) + TILE


@dataclass(frozen=True)
class StepLayout:
    """Where one step's keys and queries sit, in workspace coordinates (read-only arrays, some
    shared: `hi_causal` is `q_key_pos`, and for single-token decodes `lo` is `key_start`).

    Attributes:
        num_key_rows: key rows in use: 1 (the sink slot) + every request's keys.
        query_start_loc: `[num_reqs + 1]`, as given (int32 or int64).
        key_start: int64 `[num_reqs]`: each request's first key row.
        key_lens: `[num_reqs]`: each request's keys, as given (int32 or int64).
        lo: int64 `[num_tokens]`: first key row each query token keeps (its request's first).
        hi_causal: int64 `[num_tokens]`: last key row kept under causal attention (the token's
            own position).
        hi_full: int64 `[num_tokens]`: last key row kept without causality (its request's
            last key).
        q_key_pos: int64 `[num_tokens]`: the token's own position as a key row (for ALiBi's
            `j - p` and for windows).
    """

    num_key_rows: int
    query_start_loc: np.ndarray
    key_start: np.ndarray
    key_lens: np.ndarray
    lo: np.ndarray
    hi_causal: np.ndarray
    hi_full: np.ndarray
    q_key_pos: np.ndarray


def lay_out_step(
    query_start_loc: np.ndarray, key_lens: np.ndarray, context_lens: np.ndarray
) -> StepLayout:
    """Lay requests' keys back to back after the sink slot, and bound each token's keys.

    Host work grows with requests and query tokens, never with keys.

    Args:
        query_start_loc: `[num_reqs + 1]` offsets of each request's query tokens.
        key_lens: `[num_reqs]` keys per request (seq_lens; encoder lengths for cross attention).
        context_lens: `[num_reqs]` tokens before this step (the position of the first query).
    """
    # Copies: the layout is read again at the step's first forward, and the caller's arrays
    # are often views of an engine's mirrors that it refills for the next step.
    q_start = np.array(query_start_loc)
    key_lens = np.array(key_lens)
    num_reqs = key_lens.shape[0]
    # This runs on the per-step host path, where each numpy call costs about a microsecond:
    # per-request values are written in place into one array, then repeated once per token.
    per_request = np.empty((3, num_reqs), dtype=np.int64)
    key_start, key_end, offset = per_request[0], per_request[1], per_request[2]
    # each request's last key row (the ufunc itself: `cumsum` adds a wrapper and a cast)
    np.add.accumulate(key_lens, dtype=np.int64, out=key_end)
    np.subtract(key_end, key_lens, out=key_start)
    key_start += 1
    # A token's own key row is its index in the step plus its request's offset.
    np.add(key_start, context_lens, out=offset)
    query_lens = q_start[1:] - q_start[:-1]
    if (
        num_reqs
        and q_start.shape[0] == num_reqs + 1
        and q_start[-1] - q_start[0] == num_reqs
        and query_lens[query_lens.argmin()] == 1
    ):
        # Every query is one token (n of them, the least 1; `argmin` is one C call where `min`
        # adds a Python wrapper): the engine's usual decode step. Token i is request i, so the
        # per-request rows are the per-token ones, shared rather than repeated.
        offset -= q_start[0]
        lo, hi_full, q_key_pos = key_start, key_end, offset
    else:
        offset -= q_start[:-1]
        lo, hi_full, q_key_pos = per_request.repeat(query_lens, axis=1)
        q_key_pos += np.arange(q_key_pos.shape[0])
    return StepLayout(
        num_key_rows=1 + (int(key_end[-1]) if num_reqs else 0),
        query_start_loc=q_start,
        key_start=key_start,
        key_lens=key_lens,
        lo=lo,
        hi_causal=q_key_pos,
        hi_full=hi_full,
        q_key_pos=q_key_pos,
    )


def window_lo(layout: StepLayout, window: int | None) -> np.ndarray:
    """First kept key row per token: a window of W keeps `p - W < j <= p`."""
    if window is None:
        return layout.lo
    return np.maximum(layout.lo, layout.q_key_pos - (window - 1))


def tile_masks(
    lo: np.ndarray,
    hi: np.ndarray,
    query_start_loc: np.ndarray,
    group: int,
    shape: tuple[int, int],
    has_sink: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Which tiles the kernel must visit: `(partial, full)`, bool `[row_tiles, key_tiles]`.

    Query rows `t * group ... t * group + group - 1` belong to token t (its `group` query heads
    of one KV head), which keeps key rows `lo[t] ... hi[t]`. Within a request both bounds never
    decrease from token to token and consecutive ranges overlap, so the rows of one request
    inside one tile keep exactly the range `[lo[first], hi[last]]`. A tile is full (no mask
    needed) when one request fills its rows and every row keeps all of its keys. With a sink,
    every tile holding query rows also visits key tile 0 (the sink slot, row 0).
    """
    rows = lo.shape[0] * group
    if rows == 0:
        return np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
    # Segments: rows between consecutive tile starts and request starts (one tile, one request).
    q_start = np.asarray(query_start_loc)
    starts = np.union1d(q_start[:-1][np.diff(q_start) > 0] * group, np.arange(0, rows, TILE))
    ends = np.append(starts[1:], rows)
    first, last = starts // group, (ends - 1) // group
    tile = starts // TILE
    kept = lo[first] <= hi[last]
    covered = _mark_ranges(shape, tile[kept], lo[first][kept] // TILE, hi[last][kept] // TILE)
    # Full: key tiles inside [largest lo, smallest hi] of a tile filled by one request.
    full_lo = -(-lo[last] // TILE)
    full_hi = (hi[first] + 1) // TILE - 1
    whole = kept & (ends - starts == TILE) & (full_lo <= full_hi)
    full = _mark_ranges(shape, tile[whole], full_lo[whole], full_hi[whole])
    partial = covered & ~full
    if has_sink:
        # Row 0 lies in no request's range, so tile 0 is never full.
        partial[: -(-rows // TILE), 0] = True
    return partial, full


def _mark_ranges(
    shape: tuple[int, int], row: np.ndarray, first: np.ndarray, last: np.ndarray
) -> np.ndarray:
    """bool `shape` with `[row[i], first[i] ... last[i]]` set, through a difference array."""
    diff = np.zeros((shape[0], shape[1] + 1), dtype=np.int32)
    np.add.at(diff, (row, first), 1)
    np.add.at(diff, (row, last + 1), -1)
    return np.cumsum(diff, axis=1)[:, : shape[1]] > 0


def block_lists(tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A BlockMask's `(num_blocks [1, 1, row_tiles], indices [1, 1, row_tiles, key_tiles])`,
    int32: the marked key tiles of each row tile first, in increasing order."""
    num = tiles.sum(axis=1, dtype=np.int32)
    indices = np.argsort(~tiles, axis=1, kind="stable").astype(np.int32)
    return num[None, None], indices[None, None]
