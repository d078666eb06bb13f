"""What FlashInfer's planners need for one step, computed from the step's CPU mirrors.

Pure functions of numpy arrays (`query_start_loc_cpu`, `seq_lens_cpu`, ...): no torch, no
device, so that they run in `build` without touching the GPU and are tested exactly on the CPU.

FlashInfer describes a paged batch in CSR form (its "page table layout"):

- `qo_indptr` int32 `[n + 1]`: request i's query rows are `[qo_indptr[i], qo_indptr[i + 1])`;
- `paged_kv_indptr` int32 `[n + 1]`: request i's pages are
  `paged_kv_indices[paged_kv_indptr[i] : paged_kv_indptr[i + 1]]`;
- `paged_kv_indices` int32 `[paged_kv_indptr[-1]]`: physical page (kernel block) ids;
- `paged_kv_last_page_len` int32 `[n]`: tokens in request i's last page, in
  `[1, block_size]` (a request without pages is planned with 1, as FlashInfer's own examples do;
  its kernels read an empty page range as length 0).

The page ids live in the device block table, which has no CPU mirror: the builder gathers them
on the device, through `paged_kv_indptr` (`ops.gather_pages`), or as one copy of the table's
rectangle when every request reads the same number of pages (`PagedArrays.rectangle`); no
per-page index is built on the host. `paged_kv_gather_index` gives that index anyway, for
checks and CPU references.

A step is split into three parts, in token order decodes first (the builder asks for that
layout through `reorder_batch_threshold`): decodes (query length <= threshold) for the paged
decode wrapper, fresh prefills (no context) for the ragged prefill wrapper, which reads K/V
from the step's own inputs, and prefills with context for the paged prefill wrapper. Each
wrapper needs its requests contiguous in the token dimension; when fresh and context prefills
interleave, the fresh prefills outside one contiguous run go through the paged wrapper too
(their K/V are in the cache by then), see `split_batch`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BatchSplit",
    "PagedArrays",
    "StepArrays",
    "decode_part",
    "decode_step_arrays",
    "paged_kv_gather_index",
    "paged_kv_indices",
    "paged_kv_indptr",
    "plan_step",
    "qo_indptr",
    "ragged_kv_indptr",
    "split_batch",
]

Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class BatchSplit:
    """Which requests (and their token rows) each FlashInfer wrapper serves.

    Ranges are half-open `[start, end)`; request ranges index the batch, token ranges the flat
    token dimension. Decodes always lead: `decode_reqs == (0, num_decodes)`.
    """

    num_decodes: int
    num_decode_tokens: int
    ragged_reqs: Range
    paged_reqs: Range
    ragged_tokens: Range
    paged_tokens: Range


def split_batch(
    query_start_loc: np.ndarray,
    context_lens: np.ndarray,
    decode_threshold: int = 1,
    allow_ragged: bool = True,
) -> BatchSplit:
    """Split a step into decodes, ragged (fresh) prefills and paged prefills.

    Decodes are the leading requests whose query length is at most `decode_threshold` (the
    batch is laid out decodes first; a decode after a prefill is served as a prefill). Among
    the prefills after them, the ragged part is one contiguous run of fresh prefills
    (`context_lens == 0`): all of them when no prefill has context, else the leading or the
    trailing run of fresh prefills, whichever has more tokens (the leading one on a tie). Every
    other prefill goes to the paged part, which is contiguous too.

    Args:
        query_start_loc: `[n + 1]` offsets of each request's query rows (starts at 0).
        context_lens: `[n]` tokens in the cache before this step.
        decode_threshold: longest query that counts as a decode.
        allow_ragged: False sends every prefill to the paged part (fp8 caches: the inputs'
            K/V are not what the cache holds).
    """
    loc = np.asarray(query_start_loc, dtype=np.int64)
    context = np.asarray(context_lens, dtype=np.int64)
    return _split(loc, loc[1:] - loc[:-1], context, decode_threshold, allow_ragged)


def _split(
    loc: np.ndarray,
    query_lens: np.ndarray,
    context: np.ndarray,
    decode_threshold: int,
    allow_ragged: bool,
) -> BatchSplit:
    """`split_batch` on int64 arrays, with the query lengths already taken."""
    n = context.shape[0]
    if loc.shape[0] != n + 1:
        raise ValueError(
            f"split_batch: query_start_loc must have num_reqs + 1 entries (got "
            f"{loc.shape[0]}, expected {n + 1})."
        )
    num_decodes = n
    if n and query_lens.max() > decode_threshold:
        num_decodes = int(np.flatnonzero(query_lens > decode_threshold)[0])
    first, last = num_decodes, num_decodes  # the ragged run [first, last)
    if allow_ragged and num_decodes < n:
        has_context = np.flatnonzero(context[num_decodes:])
        if not has_context.size:
            first, last = num_decodes, n
        else:
            lead_end = num_decodes + int(has_context[0])
            trail_start = num_decodes + int(has_context[-1]) + 1
            lead_tokens = loc[lead_end] - loc[num_decodes]
            trail_tokens = loc[n] - loc[trail_start]
            if lead_tokens >= trail_tokens:
                first, last = num_decodes, lead_end
            else:
                first, last = trail_start, n
    # The paged part is what remains of the prefills: after a leading run, before a trailing one.
    paged = (last, n) if first == num_decodes else (num_decodes, first)
    ragged = (first, last)
    return BatchSplit(
        num_decodes=num_decodes,
        num_decode_tokens=int(loc[num_decodes]),
        ragged_reqs=ragged,
        paged_reqs=paged,
        ragged_tokens=(int(loc[ragged[0]]), int(loc[ragged[1]])),
        paged_tokens=(int(loc[paged[0]]), int(loc[paged[1]])),
    )


def qo_indptr(query_start_loc: np.ndarray, reqs: Range) -> np.ndarray:
    """int32 `[m + 1]` query-row offsets of requests `reqs`, starting at 0."""
    start, end = reqs
    loc = np.asarray(query_start_loc, dtype=np.int64)[start : end + 1]
    return (loc - loc[0]).astype(np.int32)


def ragged_kv_indptr(
    query_start_loc: np.ndarray, context_lens: np.ndarray, reqs: Range
) -> np.ndarray:
    """int32 `[m + 1]` key-row offsets of fresh prefills `reqs` in the step's own K/V rows.

    A fresh prefill attends to exactly its new tokens, so this equals `qo_indptr`.

    Raises:
        ValueError: a request in `reqs` has context (its keys are not all in the inputs).
    """
    start, end = reqs
    if np.any(np.asarray(context_lens)[start:end] != 0):
        raise ValueError(
            "ragged_kv_indptr: every request of the ragged part must be a fresh prefill (got a "
            "request with context). Send prefills with context to the paged part."
        )
    return qo_indptr(query_start_loc, reqs)


def paged_kv_indptr(seq_lens: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Page offsets and last-page lengths of requests holding `seq_lens` tokens.

    Returns:
        `(paged_kv_indptr, paged_kv_last_page_len)`: int32 `[n + 1]` (starts at 0) and int32
        `[n]` in `[1, block_size]` (1 for a request with no tokens, which gets no pages).
    """
    seq = np.asarray(seq_lens, dtype=np.int64)
    joint, _ = _page_table(seq, block_size, seq.shape[0])
    return _split_joint(joint)


def _page_table(seq: np.ndarray, block_size: int, num_reqs: int) -> tuple[np.ndarray, np.ndarray]:
    """`paged_kv_indptr` and `paged_kv_last_page_len` of int64 `seq` padded to `num_reqs`
    requests, written into one int32 array `[2 * num_reqs + 1]` (indptr, then last-page
    lengths: one copy to the device), and the pages of each request (int64 `[n]`).

    CUDA-graph padding requests have no pages and last-page length 1: the captured wrapper
    plans them, and its kernels read nothing for them."""
    if block_size < 1:
        raise ValueError(f"paged_kv_indptr: block_size must be >= 1 (got {block_size}).")
    # Few numpy calls, each on a whole batch: at a few hundred requests their fixed cost is
    # what the host pays.
    n = seq.shape[0]
    num_pages = (seq + (block_size - 1)) // block_size
    joint = np.empty(2 * num_reqs + 1, dtype=np.int32)
    indptr, last = joint[: num_reqs + 1], joint[num_reqs + 1 :]
    indptr[0] = 0
    # (the ufunc itself: `np.cumsum` adds a Python wrapper, 2.5x the time at 256 requests)
    np.add.accumulate(num_pages, out=indptr[1 : n + 1])
    # last page: the tokens past the full pages before it
    np.subtract(seq, (num_pages - 1) * block_size, out=last[:n], casting="unsafe")
    if n and _smallest(num_pages) < 1:
        if _smallest(seq) < 0:
            raise ValueError(
                f"paged_kv_indptr: seq_lens must not be negative (got {int(_smallest(seq))})."
            )
        last[:n][num_pages < 1] = 1
    if num_reqs > n:  # padding requests: no pages, last-page length 1
        indptr[n + 1 :] = indptr[n]
        last[n:] = 1
    return joint, num_pages


def _split_joint(joint: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indptr and last-page-length views of a `_page_table` array."""
    num_reqs = joint.shape[0] // 2
    return joint[: num_reqs + 1], joint[num_reqs + 1 :]


def _smallest(values: np.ndarray) -> np.integer:
    """`values.min()` of a non-empty array, without `ndarray.min`'s Python-level wrapper
    (`argmin` is one C call: half the host time at a few hundred entries)."""
    return values[values.argmin()]


def _largest(values: np.ndarray) -> np.integer:
    """`values.max()` of a non-empty array, as `_smallest`."""
    return values[values.argmax()]


def paged_kv_gather_index(
    seq_lens: np.ndarray, block_size: int, first_row: int, num_cols: int
) -> np.ndarray:
    """Flat positions in `block_table.reshape(-1)` of each request's pages, request by request
    (the host form of the device gather, `ops.gather_pages`; for checks and CPU references).

    Request i (block-table row `first_row + i`) holds `ceil(seq_lens[i] / block_size)` pages,
    read from the first columns of its row.

    Args:
        num_cols: columns of the (contiguous) block table.

    Returns:
        `[total_pages]`, int32 (int64 for a table of 2**31 entries or more).

    Raises:
        ValueError: a request needs more pages than the table has columns.
    """
    seq = np.asarray(seq_lens, dtype=np.int64)
    num_pages = (seq + (block_size - 1)) // block_size
    indptr = np.zeros(seq.shape[0] + 1, dtype=np.int64)
    indptr[1:] = num_pages.cumsum()
    most = int(_largest(num_pages)) if seq.shape[0] else 0
    rectangle = _rectangle(
        num_pages, most, indptr, block_size, first_row, num_cols, "paged_kv_gather_index"
    )
    if rectangle is not None:
        return _rectangle_positions(rectangle, num_cols)
    return _index_positions(num_pages, indptr, first_row, num_cols)


def _rectangle(
    num_pages: np.ndarray,
    most: int,
    indptr: np.ndarray,
    block_size: int,
    first_row: int,
    num_cols: int,
    api: str,
) -> tuple[slice, slice] | None:
    """The `(rows, columns)` rectangle of the block table holding the pages of requests
    `first_row, ...` when every request reads the same number of pages, else None; from each
    request's pages, the most of them (0 without requests) and their offsets (`[n + 1]`).

    Raises:
        ValueError: a request needs more pages than the table has columns (`api` says so).
    """
    n = num_pages.shape[0]
    _check_columns(api, most, block_size, num_cols)
    # FlashInfer's page offsets are int32 (so is `indptr`, which would have wrapped around): the
    # exact total is summed only when the bound n * most allows more.
    if n * most > _INT32_MAX and int(num_pages.sum(dtype=np.int64)) > _INT32_MAX:
        raise ValueError(
            f"paged_kv_indptr: too many pages for FlashInfer's int32 page offsets (got "
            f"{int(num_pages.sum(dtype=np.int64))}, expected <= {_INT32_MAX}). Split the batch."
        )
    if int(indptr[-1]) == n * most:  # every request has `most` pages (none when negative)
        return slice(first_row, first_row + n), slice(0, max(most, 0))
    return None


def _rectangle_positions(rectangle: tuple[slice, slice], num_cols: int) -> np.ndarray:
    """The flat table positions of a `_rectangle`, row by row."""
    rows, cols = rectangle
    dtype = _index_dtype(rows.stop, num_cols)
    row_starts = np.arange(rows.start, rows.stop, dtype=dtype) * num_cols
    return np.add.outer(row_starts, np.arange(cols.stop, dtype=dtype)).reshape(-1)


def _index_positions(
    num_pages: np.ndarray, indptr: np.ndarray, first_row: int, num_cols: int
) -> np.ndarray:
    """The flat table positions of every page, from each request's pages and offsets."""
    n = num_pages.shape[0]
    # Page j of the flat list, in request i, sits at column j - indptr[i] of row first_row + i.
    dtype = _index_dtype(first_row + n, num_cols)
    first = first_row * num_cols
    shift = np.arange(first, first + n * num_cols, num_cols, dtype=dtype)
    shift -= indptr[:-1].astype(dtype)
    index = np.arange(int(indptr[-1]), dtype=dtype)
    index += np.repeat(shift, np.maximum(num_pages, 0))
    return index


_INT32_MAX = 2**31 - 1  # (`np.iinfo` costs a microsecond a call)


def _index_dtype(num_rows: int, num_cols: int) -> type[np.integer]:
    """int32 for positions in a table of `num_rows` x `num_cols` entries, unless they need
    int64: half the bytes to write and to copy to the device."""
    return np.int32 if num_rows * num_cols <= _INT32_MAX else np.int64


def paged_kv_indices(
    block_table: np.ndarray, seq_lens: np.ndarray, block_size: int, first_row: int = 0
) -> np.ndarray:
    """int32 page ids of requests `first_row, ...` (the CPU form of the device gather)."""
    table = np.ascontiguousarray(block_table)
    index = paged_kv_gather_index(seq_lens, block_size, first_row, table.shape[1])
    return table.reshape(-1)[index].astype(np.int32)


@dataclass(frozen=True, slots=True)
class PagedArrays:
    """One paged wrapper's plan inputs (decode or prefill part).

    Attributes:
        qo_indptr: int32 `[m + 1]` query rows (prefill part; None for decodes, whose wrapper
            builds its own).
        paged_kv_indptr: int32 `[m + 1]`.
        paged_kv_last_page_len: int32 `[m]`.
        seq_lens: int32 `[m]` keys per request (padding requests: 0).
        rectangle: when every request reads the same number of pages, the `(rows, columns)`
            slices of the block table holding them, `block_table[rectangle]` read row by row
            (one device copy); else None, and the pages are gathered on the device through
            `paged_kv_indptr` (`ops.gather_pages`). Either way no per-page index is built.
        first_row: the block-table row of the part's first request.
        num_real_reqs: the part's requests before CUDA-graph padding (the padding requests
            have no pages and no block-table rows).
        max_pages: the most pages of one request (0 without requests).
        indptr_and_last: int32 `[2m + 1]`: the array `paged_kv_indptr` and
            `paged_kv_last_page_len` are views of, for one copy of both to the device.
    """

    qo_indptr: np.ndarray | None
    paged_kv_indptr: np.ndarray
    paged_kv_last_page_len: np.ndarray
    seq_lens: np.ndarray
    rectangle: tuple[slice, slice] | None
    first_row: int
    num_real_reqs: int
    max_pages: int
    indptr_and_last: np.ndarray

    @property
    def num_reqs(self) -> int:
        return int(self.paged_kv_last_page_len.shape[0])

    @property
    def num_pages(self) -> int:
        return int(self.paged_kv_indptr[-1])

    def gather_positions(self, num_cols: int) -> np.ndarray:
        """The pages' positions in `block_table.reshape(-1)` of a table of `num_cols` columns,
        in order (for tests and host-side checks: builds the index the device never needs)."""
        if self.rectangle is not None:
            return _rectangle_positions(self.rectangle, num_cols)
        indptr = self.paged_kv_indptr.astype(np.int64)
        return _index_positions(indptr[1:] - indptr[:-1], indptr, self.first_row, num_cols)


@dataclass(frozen=True, slots=True)
class StepArrays:
    """Everything FlashInfer's planners need for one step (see `plan_step`).

    Attributes:
        split: the decode / ragged / paged split.
        decode: the decode wrapper's arrays (padded to the CUDA-graph batch size), or None.
        paged: the paged prefill wrapper's arrays, or None.
        ragged_qo_indptr, ragged_kv_indptr: int32 `[m + 1]` of the ragged part, or None.
    """

    split: BatchSplit
    decode: PagedArrays | None
    paged: PagedArrays | None
    ragged_qo_indptr: np.ndarray | None
    ragged_kv_indptr: np.ndarray | None


def _paged_arrays(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    num_cols: int,
    reqs: Range,
    with_qo: bool,
    padded_num_reqs: int | None = None,
) -> PagedArrays:
    start, end = reqs
    seq = seq_lens[start:end]
    _check_padding(end - start, padded_num_reqs)
    num_reqs = end - start if padded_num_reqs is None else padded_num_reqs
    joint, num_pages = _page_table(seq, block_size, num_reqs)
    indptr, last = _split_joint(joint)
    most = int(_largest(num_pages)) if end > start else 0
    rectangle = _rectangle(
        num_pages, most, indptr[: end - start + 1], block_size, start, num_cols, "plan_step"
    )
    if padded_num_reqs is None:
        seq32 = seq.astype(np.int32)
    else:
        seq32 = np.zeros(padded_num_reqs, dtype=np.int32)
        seq32[: end - start] = seq
    return PagedArrays(
        qo_indptr=qo_indptr(query_start_loc, reqs) if with_qo else None,
        paged_kv_indptr=indptr,
        paged_kv_last_page_len=last,
        seq_lens=seq32,
        rectangle=rectangle,
        first_row=start,
        num_real_reqs=end - start,
        max_pages=most,
        indptr_and_last=joint,
    )


def decode_part(
    seq_lens: np.ndarray,
    block_size: int,
    num_cols: int,
    num_decodes: int,
    cudagraph_num_reqs: int | None = None,
) -> PagedArrays:
    """The decode wrapper's arrays of a step's `num_decodes` leading decodes (padded to
    `cudagraph_num_reqs`): what `plan_step` returns as `decode`, for a step planned without
    them (`decode_arrays=False`) whose decode wrapper's planner turns out to need them.

    Args:
        seq_lens: int `[>= num_decodes]` the step's lengths (its requests' order).
        block_size, num_cols: as `plan_step` takes them.
    """
    seq = np.asarray(seq_lens, dtype=np.int64)
    return _paged_arrays(
        None, seq, block_size, num_cols, (0, num_decodes), False, cudagraph_num_reqs
    )


def plan_step(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    num_cols: int,
    *,
    decode_threshold: int = 1,
    allow_ragged: bool = True,
    cudagraph_num_reqs: int | None = None,
    decode_arrays: bool = True,
) -> StepArrays:
    """The split and every wrapper's plan inputs for one step.

    Args:
        query_start_loc: int `[n + 1]` (the CPU mirror, real requests only).
        seq_lens: int `[n]` context + new tokens.
        block_size: kernel block (page) size.
        num_cols: columns of the block table.
        decode_threshold, allow_ragged: see `split_batch`.
        cudagraph_num_reqs: plan the decodes padded to this many requests (a CUDA-graph batch);
            the step must then be decodes only.
        decode_arrays: False leaves `decode` None (decodes that need no plan: FLASHINFER's
            XQA kernel reads the block table itself); the split is the same.

    Raises:
        ValueError: bad lengths, a table too narrow, or a padded plan for a step with prefills.
    """
    loc = np.asarray(query_start_loc, dtype=np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    query_lens = loc[1:] - loc[:-1]
    if query_lens.size and _smallest(query_lens) < 1:
        raise ValueError(
            "plan_step: every request needs at least one query token (got a query length of "
            f"{int(_smallest(query_lens))}); FlashInfer's wrappers plan no empty requests."
        )
    n = seq.shape[0]
    if loc.shape[0] == n + 1 and loc[-1] - loc[0] == n and decode_threshold >= 1:
        # n queries of at least one token each, n tokens in all: every request is a
        # single-token decode, the engine's usual step (and every CUDA-graph step), so the
        # split is known without `_split`'s scans.
        return _plan_decodes(loc, seq, block_size, num_cols, cudagraph_num_reqs, decode_arrays)
    return _plan_any(
        loc,
        seq,
        query_lens,
        block_size,
        num_cols,
        decode_threshold,
        allow_ragged,
        cudagraph_num_reqs,
        decode_arrays,
    )


def _plan_any(
    loc: np.ndarray,
    seq: np.ndarray,
    query_lens: np.ndarray,
    block_size: int,
    num_cols: int,
    decode_threshold: int,
    allow_ragged: bool,
    cudagraph_num_reqs: int | None,
    decode_arrays: bool,
) -> StepArrays:
    """`plan_step` of any batch (int64 `loc`, `seq`, `query_lens`, each query >= 1 token)."""
    context = seq - query_lens
    if context.size and _smallest(context) < 0:
        raise ValueError("plan_step: a request has seq_len shorter than its query length.")
    split = _split(loc, query_lens, context, decode_threshold, allow_ragged)
    if cudagraph_num_reqs is not None and split.num_decodes != seq.shape[0]:
        raise ValueError(
            f"plan_step: a CUDA-graph plan needs a batch of decodes only (got "
            f"{seq.shape[0] - split.num_decodes} prefills). Run steps with prefills eagerly."
        )
    _check_padding(split.num_decodes, cudagraph_num_reqs)
    # The table holds every request's pages, whichever wrapper reads them: checked on the whole
    # step, so a refusal reports the longest request, not the first part that does not fit.
    _check_width(seq, block_size, num_cols)
    decode = None
    if decode_arrays and (split.num_decodes or cudagraph_num_reqs):
        decode = _paged_arrays(
            loc, seq, block_size, num_cols, (0, split.num_decodes), False, cudagraph_num_reqs
        )
    paged = None
    if split.paged_reqs[1] > split.paged_reqs[0]:
        paged = _paged_arrays(loc, seq, block_size, num_cols, split.paged_reqs, True)
    ragged_qo = ragged_kv = None
    if split.ragged_reqs[1] > split.ragged_reqs[0]:
        ragged_qo = qo_indptr(loc, split.ragged_reqs)
        ragged_kv = ragged_kv_indptr(loc, context, split.ragged_reqs)
    return StepArrays(split, decode, paged, ragged_qo, ragged_kv)


def _plan_decodes(
    loc: np.ndarray,
    seq: np.ndarray,
    block_size: int,
    num_cols: int,
    cudagraph_num_reqs: int | None,
    decode_arrays: bool,
) -> StepArrays:
    """`plan_step` of a batch of single-token decodes (int64 `loc`, `seq`): what the general
    path returns for it, with only the decode wrapper's arrays to compute."""
    n = seq.shape[0]
    if n and _smallest(seq) < 1:  # context = seq - 1
        raise ValueError("plan_step: a request has seq_len shorter than its query length.")
    num_tokens = int(loc[n])
    if not decode_arrays:
        _check_padding(n, cudagraph_num_reqs)
        _check_width(seq, block_size, num_cols)
        return _arrays_of_decodes(n, num_tokens)
    decode = None
    if n or cudagraph_num_reqs:
        decode = _paged_arrays(loc, seq, block_size, num_cols, (0, n), False, cudagraph_num_reqs)
    return StepArrays(_arrays_of_decodes(n, num_tokens).split, decode, None, None, None)


def decode_step_arrays(
    num_decodes: int,
    max_seq_len: int,
    block_size: int,
    num_cols: int,
    cudagraph_num_reqs: int | None = None,
) -> StepArrays:
    """`plan_step(..., decode_arrays=False)` of a validated batch known to be `num_decodes`
    single-token decodes (`HostBatch.max_query_len` 1, as many tokens as requests), from its
    longest request (`max_seq_len` keys, at least 1) alone: the same checks (padding, the
    table's width) and result, without a pass over the lengths.

    Raises:
        ValueError: as `plan_step` does for such a batch.
    """
    _check_padding(num_decodes, cudagraph_num_reqs)
    if num_decodes:
        _check_columns("plan_step", -(-max_seq_len // block_size), block_size, num_cols)
    return _arrays_of_decodes(num_decodes, num_decodes)


# (a module-level cache, but of pure values: frozen, made from its key alone, bounded)
@functools.lru_cache(maxsize=4096)
def _arrays_of_decodes(num_decodes: int, num_tokens: int) -> StepArrays:
    """The split of `num_decodes` single-token decodes (their `num_tokens` token rows), with
    no wrapper's arrays: the same for every step of that size, so made once (two frozen
    dataclasses cost a build about 2 us each time; both are immutable)."""
    empty, end = (num_decodes, num_decodes), (num_tokens, num_tokens)
    split = BatchSplit(num_decodes, num_tokens, empty, empty, end, end)
    return StepArrays(split, None, None, None, None)


def _check_width(seq: np.ndarray, block_size: int, num_cols: int) -> None:
    """`plan_step`'s table-width check: the longest of the requests `seq` (int64) in pages."""
    if seq.size:
        most = -(-int(_largest(seq)) // block_size)
        _check_columns("plan_step", most, block_size, num_cols)


def _check_columns(api: str, most: int, block_size: int, num_cols: int) -> None:
    """A table of `num_cols` columns holds a request of `most` pages, or `api` says it does
    not."""
    if most > num_cols:
        raise ValueError(
            f"{api}: block_table too narrow for the longest sequence (got {num_cols} columns, "
            f"expected >= {most} for block_size {block_size}). Give it "
            "ceil(max_model_len / block_size) columns."
        )


def _check_padding(num_reqs: int, padded_num_reqs: int | None) -> None:
    if padded_num_reqs is not None and padded_num_reqs < num_reqs:
        raise ValueError(
            f"plan_step: more requests than the padded size (got {num_reqs}, expected <= "
            f"cudagraph_num_reqs {padded_num_reqs}). Plan a larger captured size or run eagerly."
        )
