"""How FLEX_ATTENTION lays a step out for FlexAttention, as small pure functions on the host.

Everything here works on numpy arrays from the `*_cpu` mirrors of `CommonAttentionMetadata`,
so it is tested exactly on the CPU and never synchronises with a GPU:

- `lay_out_step` (and `lay_out_owned`, its no-copy form for the builder): where each
  request's keys go in the key workspace (row 0 is the sink slot, the keys start at
  `FIRST_KEY_ROW`) and, per query token, the range of key rows it keeps (causal or
  bidirectional) and its own position, in workspace coordinates.
- `window_lo`: the first kept key row under a sliding window.
- `pad_rows`, `pad_keys`: the bucketed lengths the compiled kernel sees.
- `tile_runs`, `block_lists`: FlexAttention's block-sparse mask (which 128 x 128 tiles of
  query rows x key rows to visit, and which of them need no mask at all), as runs of key
  tiles per row tile and as the BlockMask's lists; `tile_masks` shows the runs as bool grids.
- `pad_decodes`, `decode_block_lists`: the same for the decode layout on CUDA, where each
  single-token request is one batch entry of FlexAttention's decoding kernel.
- `pad_paged_batch`, `paged_decode_lists`: the batch buckets and per-entry block counts of
  the paged decode (`flex_attention_paged`), which reads the cache in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "FIRST_KEY_ROW",
    "TILE",
    "StepLayout",
    "TileRuns",
    "block_lists",
    "decode_block_lists",
    "lay_out_owned",
    "lay_out_step",
    "pad_decodes",
    "pad_keys",
    "pad_paged_batch",
    "pad_rows",
    "paged_decode_lists",
    "skipping_keys",
    "tile_masks",
    "tile_runs",
    "window_lo",
]

# FlexAttention's sparse block: a BlockMask marks tiles of 128 query rows x 128 key rows.
TILE = 128
# The key workspace's first request key row. Row 0 is the sink slot; starting the keys one
# whole tile later (rows 1 ... TILE - 1 stay unused) keeps a fresh prefill's causal diagonal
# on tile boundaries: its query row t and its key row FIRST_KEY_ROW + t sit at the same place
# in their tiles, as in FlexAttention over keys packed from row 0. With the keys from row 1,
# every row tile's diagonal straddled two key tiles, one more partly masked tile per row
# tile. On an H200 the prefill kernel went from 1.03x to 0.96x FlexAttention over packed keys
# at 4 x 4096, and from 1.12x to 0.94x at 16 x 1024 (benchmarks/RESULTS.md).
FIRST_KEY_ROW = TILE
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


def pad_decodes(num_decodes: int, group: int) -> int:
    """Padded batch for `num_decodes` requests of the decode layout, whose query length is
    `group` (query heads per KV head): an even number, at least 2, other than `group` and
    `TILE`.

    torch.compile specialises size 1, and gives equal sizes one symbol ("duck sizing"): a batch
    equal to the query length or the tile size (numbers the compiled call sees, as the
    BlockMask's) would be tied to it, and the next step with another batch would recompile.
    Key tile counts (`pad_keys`) are odd, so never equal either.
    """
    padded = max(2, num_decodes + (num_decodes & 1))
    while padded in (group, TILE):
        padded += 2
    return padded


def pad_paged_batch(num_decodes: int) -> int:
    """Batch bucket of the paged decode, which compiles one graph per bucket (its batch is
    static): powers of two up to 32, then steps of an eighth of the next power of two (at
    most 25% padding; 18 buckets up to 256 requests)."""
    n = max(num_decodes, 1)
    power = 1 << (n - 1).bit_length()
    if power <= 32:
        return power
    step = power // 8
    return -(-n // step) * step


def paged_decode_lists(
    key_lens: np.ndarray,
    block_size: int,
    window: int | None = None,
    out: tuple[np.ndarray, ...] | None = None,
) -> tuple[np.ndarray, ...]:
    """Per batch entry of the paged decode: the cache blocks it visits and where its kept keys
    start and end in them.

    A decode token at position `p = len - 1` keeps keys `lo ... p`, `lo = 0` or, with a window
    of W, `max(0, len - W)`. It visits the block table columns `first_col ... last_col`.

    Args:
        key_lens: `[n]` keys per decode request.
        block_size: tokens per cache block.
        window: the sliding window W, or None.
        out: five int32 arrays of the padded batch (`>= n`) to write into; entries past `n`
            visit nothing (all 0). New arrays of `n` if None.

    Returns:
        int32 `(num_blocks, first_col, first_off, last_col, last_len)`: blocks visited
        (`last_col - first_col + 1`, 0 without keys), the first block's column and the offset
        of `lo` in it, the last block's column and the keys kept in it (`p - last_col *
        block_size + 1`).
    """
    n = key_lens.shape[0]
    out = out or tuple(np.empty(n, np.int32) for _ in range(5))
    num_blocks, first_col, first_off, last_col, last_len = (a[:n] for a in out)
    lens = key_lens.astype(np.int64)
    lo = np.zeros(n, np.int64) if window is None else np.maximum(lens - window, 0)
    has_keys = lens > 0
    np.floor_divide(lo, block_size, out=first_col, casting="unsafe")
    np.subtract(lo, first_col * block_size, out=first_off, casting="unsafe")
    np.floor_divide(np.maximum(lens - 1, 0), block_size, out=last_col, casting="unsafe")
    np.subtract(lens, last_col * block_size, out=last_len, casting="unsafe")
    np.subtract(last_col + 1, first_col, out=num_blocks)
    num_blocks *= has_keys
    for array in out:
        array[n:] = 0
    return out


@dataclass(frozen=True)
class StepLayout:
    """Where one step's keys and queries sit, in workspace coordinates (read-only arrays, some
    shared: `hi_causal` is `q_key_pos`, and for single-token decodes `lo` is `key_start`).

    Attributes:
        num_key_rows: key rows in use: `FIRST_KEY_ROW` (the sink slot and unused rows) +
            every request's keys.
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
        num_decodes: how many requests at the front of the batch have one query token each
            (all of a decode step; the engine puts decodes first when a builder asks for it
            through `reorder_batch_threshold`). Token i < num_decodes is request i.
    """

    num_key_rows: int
    query_start_loc: np.ndarray
    key_start: np.ndarray
    key_lens: np.ndarray
    lo: np.ndarray
    hi_causal: np.ndarray
    hi_full: np.ndarray
    q_key_pos: np.ndarray
    num_decodes: int


def lay_out_step(
    query_start_loc: np.ndarray, key_lens: np.ndarray, context_lens: np.ndarray
) -> StepLayout:
    """Lay requests' keys back to back from row `FIRST_KEY_ROW` (row 0 is the sink slot), and
    bound each token's keys.

    Host work grows with requests and query tokens, never with keys.

    Args:
        query_start_loc: `[num_reqs + 1]` offsets of each request's query tokens.
        key_lens: `[num_reqs]` keys per request (seq_lens; encoder lengths for cross attention).
        context_lens: `[num_reqs]` tokens before this step (the position of the first query).
    """
    # Copies: the layout is read again at the step's first forward, and the caller's arrays
    # are often views of an engine's mirrors that it refills for the next step.
    q_start = np.array(query_start_loc)
    return lay_out_owned(q_start, np.array(key_lens), context_lens, q_start[1:] - q_start[:-1])


def lay_out_owned(
    query_start_loc: np.ndarray,
    key_lens: np.ndarray,
    context_lens: np.ndarray,
    query_lens: np.ndarray,
) -> StepLayout:
    """`lay_out_step` of arrays the layout may keep as they are (no copies), with each
    request's query length given (`query_start_loc[1:] - query_start_loc[:-1]`): the
    builder's path, from the arrays of `CommonAttentionMetadata.host_batch`."""
    q_start = query_start_loc
    num_reqs = key_lens.shape[0]
    # This runs on the per-step host path, where each numpy call costs about a microsecond:
    # per-request values are written in place into one array, then repeated once per token.
    per_request = np.empty((3, num_reqs), dtype=np.int64)
    key_start, key_end, offset = per_request[0], per_request[1], per_request[2]
    # each request's keys so far (the ufunc itself: `cumsum` adds a wrapper and a cast), then
    # its first and its last key row
    np.add.accumulate(key_lens, dtype=np.int64, out=key_end)
    np.subtract(key_end, key_lens, out=key_start)
    key_start += FIRST_KEY_ROW
    key_end += FIRST_KEY_ROW - 1
    # A token's own key row is its index in the step plus its request's offset.
    np.add(key_start, context_lens, out=offset)
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
        num_decodes = num_reqs
    else:
        offset -= q_start[:-1]
        lo, hi_full, q_key_pos = per_request.repeat(query_lens, axis=1)
        q_key_pos += np.arange(q_key_pos.shape[0])
        # (argmax finds the first request with another query length; one exists here)
        num_decodes = int((query_lens != 1).argmax()) if num_reqs else 0
    return StepLayout(
        num_key_rows=int(key_end[-1]) + 1 if num_reqs else FIRST_KEY_ROW,
        query_start_loc=q_start,
        key_start=key_start,
        key_lens=key_lens,
        lo=lo,
        hi_causal=q_key_pos,
        hi_full=hi_full,
        q_key_pos=q_key_pos,
        num_decodes=num_decodes,
    )


def skipping_keys(layout: StepLayout, num_skipped: int) -> tuple[int, int]:
    """Where the keys go when the first `num_skipped` requests' keys are not copied (decodes
    reading the cache in place): the copied keys start at `FIRST_KEY_ROW` all the same, so
    the workspace holds only them.

    Returns:
        `(key_offset, kv_rows_padded)`: what to subtract from the layout's key rows (`lo`,
        `hi_*`, `q_key_pos`, `key_start`) to get workspace rows, and the padded key length
        (`pad_keys` of the rows in use). `(0, pad_keys(layout.num_key_rows))` for none.
    """
    if not num_skipped:
        return 0, pad_keys(layout.num_key_rows)
    if num_skipped < layout.key_start.shape[0]:
        offset = int(layout.key_start[num_skipped]) - FIRST_KEY_ROW
    else:  # every request skipped: no key is left to copy
        offset = layout.num_key_rows - FIRST_KEY_ROW
    return offset, pad_keys(layout.num_key_rows - offset)


def window_lo(layout: StepLayout, window: int | None) -> np.ndarray:
    """First kept key row per token: a window of W keeps `p - W < j <= p`."""
    if window is None:
        return layout.lo
    return np.maximum(layout.lo, layout.q_key_pos - (window - 1))


@dataclass(frozen=True)
class TileRuns:
    """Tiles of FlexAttention's block-sparse mask as runs of consecutive key tiles.

    Run i marks key tiles `first[i] ... last[i]` of row tile `tile[i]`. Runs are sorted by row
    tile, then key tile, and apart (neither overlapping nor touching), so a step's mask costs
    work per run (a few per row tile), not per tile of the whole grid.

    Attributes:
        tile: int64 `[num_runs]`: row tile (128 query rows).
        first: int64 `[num_runs]`: first key tile of the run.
        last: int64 `[num_runs]`: last key tile of the run.
    """

    tile: np.ndarray
    first: np.ndarray
    last: np.ndarray

    def mask(self, shape: tuple[int, int]) -> np.ndarray:
        """The marked tiles as bool `[row_tiles, key_tiles]`."""
        lengths = self.last - self.first + 1
        # flat index of each marked tile: its run's start, then counting up
        offset = np.cumsum(lengths) - lengths
        flat = np.repeat(self.tile * shape[1] + self.first - offset, lengths)
        flat += np.arange(flat.shape[0])
        grid = np.zeros(shape, dtype=bool)
        grid.reshape(-1)[flat] = True
        return grid


def tile_runs(
    lo: np.ndarray,
    hi: np.ndarray,
    query_start_loc: np.ndarray,
    group: int,
    has_sink: bool,
) -> tuple[TileRuns, TileRuns]:
    """Which tiles the kernel must visit: `(partial, full)`; full tiles need no mask.

    Query rows `t * group ... t * group + group - 1` belong to token t (its `group` query heads
    of one KV head), which keeps key rows `lo[t] ... hi[t]`. Within a request both bounds never
    decrease from token to token and consecutive ranges overlap, so the rows of one request
    inside one tile keep exactly the range `[lo[first], hi[last]]`; later requests keep later
    keys (`lay_out_step` lays them out in order), so these ranges come sorted. A tile is full
    when one request fills its rows and every row keeps all of its keys. With a sink, every
    tile holding query rows also visits key tile 0 (the sink slot, row 0).
    """
    rows = lo.shape[0] * group
    if rows == 0:
        empty = TileRuns(*np.zeros((3, 0), dtype=np.int64))
        return empty, empty
    # Segments: rows between consecutive tile starts and request starts (one tile, one request).
    starts = _segment_starts(np.asarray(query_start_loc), group, rows)
    ends = np.append(starts[1:], rows)
    first, last = starts // group, (ends - 1) // group
    tile = starts // TILE
    kept = lo[first] <= hi[last]
    # Full: key tiles inside [largest lo, smallest hi] of a tile filled by one request.
    full_lo = -(-lo[last] // TILE)
    full_hi = (hi[first] + 1) // TILE - 1
    whole = kept & (ends - starts == TILE) & (full_lo <= full_hi)
    full = TileRuns(tile[whole], full_lo[whole], full_hi[whole])
    # Partial: per segment, in key order, up to three runs: the sink tile (on a row tile's
    # first segment), the covered tiles before the full ones (all of them when none is full),
    # the covered tiles after them. Row 0 lies in no request's range: tile 0 is never full.
    runs = np.zeros((3, starts.shape[0], 3), dtype=np.int64)  # row tile, first, last
    runs[0] = tile[:, None]
    runs[1, :, 1] = lo[first] // TILE
    runs[1, :, 2] = full_hi + 1
    runs[2, :, 2] = hi[last] // TILE
    runs[2, :, 1] = np.where(whole, full_lo - 1, runs[2, :, 2])
    is_run = runs[1] <= runs[2]
    is_run[:, 0] = has_sink and (starts & (TILE - 1)) == 0
    is_run[:, 1] &= kept
    is_run[:, 2] &= whole
    return _merge_runs(*runs[:, is_run]), full


def _segment_starts(query_start_loc: np.ndarray, group: int, rows: int) -> np.ndarray:
    """Sorted distinct rows where a tile or a request with query tokens starts."""
    starts = np.concatenate((query_start_loc[:-1] * group, np.arange(0, rows, TILE)))
    starts.sort()
    # A request without query tokens starts where the next one does (or at `rows`).
    is_new = np.empty(starts.shape[0], dtype=bool)
    is_new[0] = True
    np.not_equal(starts[1:], starts[:-1], out=is_new[1:])
    is_new &= starts < rows
    return starts[is_new]


def _merge_runs(tile: np.ndarray, first: np.ndarray, last: np.ndarray) -> TileRuns:
    """Sorted runs with those that overlap or touch in one row tile merged (neighbouring
    requests often share a key tile)."""
    if tile.shape[0] == 0:
        return TileRuns(tile, first, last)
    is_new = np.empty(tile.shape[0], dtype=bool)
    is_new[0] = True
    np.not_equal(tile[1:], tile[:-1], out=is_new[1:])
    is_new[1:] |= first[1:] > last[:-1] + 1
    heads = np.flatnonzero(is_new)
    return TileRuns(tile[heads], first[heads], np.maximum.reduceat(last, heads))


def tile_masks(
    lo: np.ndarray,
    hi: np.ndarray,
    query_start_loc: np.ndarray,
    group: int,
    shape: tuple[int, int],
    has_sink: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """`tile_runs` as bool masks `(partial, full)`, each `[row_tiles, key_tiles]` (to test and
    inspect them; the plan itself goes from runs to block lists)."""
    partial, full = tile_runs(lo, hi, query_start_loc, group, has_sink)
    return partial.mask(shape), full.mask(shape)


def block_lists(
    runs: TileRuns,
    shape: tuple[int, int],
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A BlockMask's `(num_blocks [1, 1, row_tiles], indices [1, 1, row_tiles, key_tiles])`,
    int32: each row tile's marked key tiles first, in increasing order, then the others, in
    increasing order (what a stable argsort of the unmarked flags gives).

    Args:
        runs: the marked tiles.
        shape: `(row_tiles, key_tiles)`.
        out: int32 `[row_tiles]` and `[row_tiles * key_tiles]` to write into (e.g. parts of
            one buffer copied to the device at once); new arrays if None.
    """
    num_row_tiles, key_tiles = shape
    if out is None:
        out = np.empty(num_row_tiles, np.int32), np.empty(num_row_tiles * key_tiles, np.int32)
    num, indices = out[0], out[1].reshape(shape)
    num[:] = np.bincount(runs.tile, runs.last - runs.first + 1, minlength=num_row_tiles)
    columns = np.arange(key_tiles, dtype=np.int32)
    if runs.tile.shape[0] == 0:
        indices[:] = columns
        return num[None, None], indices[None, None]
    # Row tiles without runs (padding rows, mostly) list their key tiles in order.
    lo_row, hi_row = int(runs.tile[0]), int(runs.tile[-1]) + 1
    indices[:lo_row] = columns
    indices[hi_row:] = columns
    shifts = _index_shifts(runs, num[lo_row:hi_row], lo_row, key_tiles)
    np.add(shifts.reshape(hi_row - lo_row, key_tiles), columns, out=indices[lo_row:hi_row])
    return num[None, None], indices[None, None]


def _index_shifts(runs: TileRuns, num: np.ndarray, lo_row: int, key_tiles: int) -> np.ndarray:
    """int32 `[num.shape[0] * key_tiles]`: `indices - column` over row tiles `lo_row ...`.

    A row tile's list is its runs, then the unmarked tiles before each run, then the tiles
    after its last run; each of these pieces counts up one by one, so `indices - column` is
    constant over a piece, and `np.repeat` writes it at memory speed (an argsort or a cumsum
    over the whole grid costs far more).
    """
    row, first, last = runs.tile - lo_row, runs.first, runs.last
    lengths = last - first + 1
    runs_per_row = np.bincount(row, minlength=num.shape[0])
    run_end = np.cumsum(runs_per_row)  # past each row tile's last run
    first_run = (run_end - runs_per_row)[row]  # of the run's row tile
    rank = np.arange(row.shape[0]) - first_run  # the run's place in its row tile
    marked_before = np.cumsum(lengths) - lengths
    marked_before -= marked_before[first_run]  # marked tiles before the run, in its row tile
    last_before = np.empty_like(last)  # the previous run's last tile, -1 for a row's first
    last_before[0] = -1
    last_before[1:] = last[:-1]
    last_before[rank == 0] = -1
    # Pieces of each row tile, in order: its runs in columns 0 ... m - 1 (m: the most runs of
    # a row tile), the gaps before them in m ... 2m - 1, the tail in 2m; the others are empty.
    m = int(runs_per_row.max())
    shift = np.zeros((num.shape[0], 2 * m + 1), dtype=np.int32)  # the tail's: 0
    size = np.zeros(shift.shape, dtype=np.int64)
    shift[row, rank] = first - marked_before
    size[row, rank] = lengths
    # unmarked tile j comes after all marked ones: at num + j - (marked tiles before j)
    gap = rank + m
    shift[row, gap] = marked_before - num[row]
    size[row, gap] = first - last_before - 1
    last_of_row = last[run_end - 1]  # (row tile lo_row has a run: never index -1)
    size[:, 2 * m] = key_tiles - 1 - np.where(runs_per_row, last_of_row, -1)
    return np.repeat(shift.reshape(-1), size.reshape(-1))


def decode_block_lists(
    lo: np.ndarray,
    hi: np.ndarray,
    has_sink: bool,
    key_tiles: int,
    out: tuple[np.ndarray, ...] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The decode layout's BlockMask lists: batch entry b keeps key rows `lo[b] ... hi[b]`.

    Each entry of the batch is one request with one query token (its query heads are the
    query rows of one KV head), so its tiles are a run of consecutive key tiles: those wholly
    inside the range are full (no mask), the one or two at its ends partial, and with a sink
    key tile 0 (the sink slot, row 0, never inside a range) is partial too. An entry with
    `lo > hi` keeps no key: it visits the sink tile alone, or nothing without a sink (as the
    rows do: a token of a cross attention without encoder keys still sees the sink).

    Args:
        lo, hi: int `[batch]` first and last kept key row of each entry.
        has_sink: every entry that keeps a key also visits key tile 0.
        key_tiles: key tiles of the step (the lists' last dimension).
        out: int32 `[batch]`, `[batch * key_tiles]`, `[batch]`, `[batch * key_tiles]` to write
            into; new arrays if None.

    Returns:
        int32 `(partial_num [batch, 1, 1], partial_indices [batch, 1, 1, key_tiles],
        full_num [batch, 1, 1], full_indices [batch, 1, 1, key_tiles])`: each entry's tiles
        first, in increasing order; the rest of a row holds valid tile numbers, never read.
    """
    batch = lo.shape[0]
    if out is None:
        out = tuple(np.empty(n, np.int32) for n in (batch, batch * key_tiles) * 2)
    part_num, part_idx, full_num, full_idx = out
    part_idx, full_idx = part_idx.reshape(batch, key_tiles), full_idx.reshape(batch, key_tiles)
    kept = lo <= hi
    first, last = lo // TILE, hi // TILE
    full_lo, full_hi = -(-lo // TILE), (hi + 1) // TILE - 1
    num_full = np.where(kept, np.maximum(full_hi - full_lo + 1, 0), 0)
    full_num[:] = num_full
    # full tiles count up from full_lo (clipped where unused: any valid tile will do there)
    np.add(full_lo[:, None], np.arange(key_tiles), out=full_idx, casting="unsafe")
    np.minimum(full_idx, key_tiles - 1, out=full_idx)
    # Partial candidates in increasing order: the sink tile, the first, the last tile.
    candidates = np.stack((np.zeros_like(first), first, last), axis=1)
    valid = np.empty((batch, 3), dtype=bool)
    valid[:, 1] = (first < full_lo) | (num_full == 0)
    valid[:, 2] = (last > first) & ((last > full_hi) | (num_full == 0))
    valid[:, 1:] &= kept[:, None]
    # the sink tile, unless the entry's first tile is tile 0 already
    valid[:, 0] = has_sink & ~(kept & (first == 0))
    part_num[:] = valid.sum(axis=1)
    part_idx[:] = np.arange(key_tiles)
    rows, cols = np.nonzero(valid)
    # column of each candidate within its row: how many valid ones precede it
    part_idx[rows, (np.cumsum(valid, axis=1) - 1)[rows, cols]] = candidates[rows, cols]
    shapes = ((batch, 1, 1), (batch, 1, 1, key_tiles)) * 2
    return tuple(a.reshape(shape) for a, shape in zip(out, shapes, strict=True))  # type: ignore[return-value]
