"""The arguments FlashInfer's paged wrappers' `plan()` takes, made from one step's batch.

FlashInfer describes a batch's keys as CSR page lists: `kv_indptr[i] : kv_indptr[i + 1]` are
request i's entries of the flat page list `kv_indices`, `kv_last_page_len[i]` (1 to
`block_size`) the tokens of its last page; prefills also take `qo_indptr`. Offsets and last-page
lengths are made on the host from the step's mirrors (`plan()` reads them there); the page list
is gathered from the block table on its device, so nothing waits on the device. Every array
here is int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from anyattn.async_copy import to_device
from anyattn.metadata import HostBatch

__all__ = [
    "PagedIndex",
    "first_trailing_fresh",
    "gather_pages",
    "num_leading_decodes",
    "paged_index",
    "query_indptr",
]


@dataclass(frozen=True, slots=True)
class PagedIndex:
    """One part of a step as FlashInfer's paged wrappers take it.

    Attributes:
        qo_indptr: int32 `[n + 1]` CPU: query rows of each request, from the part's first row.
        kv_indptr: int32 `[n + 1]` CPU: each request's entries of `kv_indices`.
        kv_indices: int32 `[kv_indptr[-1]]` on the table's device: the page ids.
        kv_last_page_len: int32 `[n]` CPU: tokens in each request's last page (1 for a
            padding request, which has no pages).
        num_pages: `kv_indptr[-1]`.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    num_pages: int


def num_leading_decodes(host: HostBatch) -> int:
    """How many requests at the front of the batch have one query token."""
    not_decode = np.flatnonzero(host.query_lens != 1)
    return int(not_decode[0]) if not_decode.size else int(host.query_lens.shape[0])


def first_trailing_fresh(host: HostBatch, start: int) -> int:
    """The first of the requests at the end of the batch (from `start` on) that have no
    context: those are `[first, num_reqs)`."""
    has_context = np.flatnonzero(host.context_lens[start:] != 0)
    return start + (int(has_context[-1]) + 1 if has_context.size else 0)


def query_indptr(host: HostBatch, reqs: tuple[int, int]) -> torch.Tensor:
    """int32 `[n + 1]` CPU: the query rows of requests `[reqs[0], reqs[1])`, from their first
    row (for fresh prefills, their keys' offsets too)."""
    query_start = host.query_start_loc[reqs[0] : reqs[1] + 1]
    return torch.from_numpy((query_start - query_start[0]).astype(np.int32))


def paged_index(
    host: HostBatch,
    block_table: torch.Tensor,
    block_size: int,
    reqs: tuple[int, int],
    padded_reqs: int | None = None,
) -> PagedIndex:
    """The paged description of requests `[reqs[0], reqs[1])` of the step.

    Args:
        host: the step's CPU mirrors.
        block_table: int32 `[>= reqs[1], >= pages of the longest request]`, on the device.
        block_size: tokens per block (FlashInfer's `page_size`).
        reqs: the part's requests.
        padded_reqs: requests to describe in all (a CUDA-graph decode batch's captured size):
            those past the part's own have no pages and no query rows.
    """
    first, end = reqs
    seq_lens = host.seq_lens[first:end]
    num_reqs = end - first
    pad = 0 if padded_reqs is None else padded_reqs - num_reqs
    pages = (seq_lens + block_size - 1) // block_size
    kv_indptr = np.zeros(num_reqs + pad + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1 : num_reqs + 1])
    kv_indptr[num_reqs + 1 :] = kv_indptr[num_reqs]
    last = np.ones(num_reqs + pad, dtype=np.int32)
    last[:num_reqs] = seq_lens - (pages - 1) * block_size
    query_start = host.query_start_loc[first : end + 1]
    qo_indptr = np.empty(num_reqs + pad + 1, dtype=np.int32)
    qo_indptr[: num_reqs + 1] = query_start - query_start[0]
    qo_indptr[num_reqs + 1 :] = qo_indptr[num_reqs]
    num_pages = int(kv_indptr[num_reqs])
    indices = gather_pages(block_table, first, pages, kv_indptr[: num_reqs + 1], num_pages)
    return PagedIndex(
        torch.from_numpy(qo_indptr),
        torch.from_numpy(kv_indptr),
        indices,
        torch.from_numpy(last),
        num_pages,
    )


def gather_pages(
    block_table: torch.Tensor, first: int, pages: np.ndarray, indptr: np.ndarray, num_pages: int
) -> torch.Tensor:
    """int32 `[num_pages]`: row `first + i`'s first `pages[i]` ids, request after request,
    gathered on the table's device (`output_size` keeps `repeat_interleave` from reading the
    total back)."""
    device = block_table.device
    counts = to_device(np.stack([pages, indptr[:-1]]).astype(np.int64), device)
    num_reqs = pages.shape[0]
    rows = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), counts[0], output_size=num_pages
    )
    cols = torch.arange(num_pages, device=device) - counts[1][rows]
    return block_table[rows + first, cols]
