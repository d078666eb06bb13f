"""Copy each request's pages out of a block table into one flat list (FlashInfer's
`paged_kv_indices`).

`gather_pages` is the launcher (validates, then copies), `gather_pages_ref` the plain-PyTorch
reference. Request i reads `page_indptr[i + 1] - page_indptr[i]` pages, the first columns of
block-table row `first_row + i`; they go, in order, to `out[page_indptr[i] ...]`. Entries of
`out` past `page_indptr[-1]` are untouched.

Everything per page happens on the device: the launcher reads only tensor shapes and the host
integers it is given (`num_pages`, `max_pages`, known to a builder from the CPU mirrors), never
tensor values, so it does not synchronise with the GPU, and no per-page index crosses from the
host (a 256-request decode batch of 2048 keys has 32768 pages: building that index and copying
it cost the host more than this whole launch).

On CUDA, when triton is importable, the copy is one Triton kernel launch: program (i, t) copies
column tile t of request i. The vectorised PyTorch path (a handful of ops) serves the CPU and CUDA
without triton; `impl=` forces either one (tests run the kernel on the CPU under
`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch

from anyattn.ops.impl_choice import use_triton
from anyattn.ops.tensor_checks import check_tensors_on_one_device

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = ["MAX_PAGES_PER_REQUEST", "gather_pages", "gather_pages_ref"]

_OP = "gather_pages"
_TILE_COLS = 128
# Requests go on the grid's first dimension (2**31 - 1 programs); column tiles on the second,
# whose CUDA limit (65535) bounds one request's pages.
MAX_PAGES_PER_REQUEST = 65535 * _TILE_COLS


def gather_pages(
    block_table: torch.Tensor,
    page_indptr: torch.Tensor,
    out: torch.Tensor,
    *,
    num_pages: int,
    max_pages: int,
    first_row: int = 0,
    impl: str = "auto",
) -> None:
    """Write every request's pages into `out`, in place.

    Args:
        block_table: int32 `[rows, max_blocks]` physical block ids per request (any strides).
        page_indptr: int32 or int64 `[num_reqs + 1]`, on the table's device: request i's pages
            go to `out[page_indptr[i] : page_indptr[i + 1]]`; starts at 0, never decreases.
        out: int32 `[>= num_pages]` on the table's device, contiguous.
        num_pages: `page_indptr[-1]`, as a host integer (the caller knows it from CPU mirrors).
        max_pages: the most pages of one request (0 without requests), as a host integer.
        first_row: the block-table row of request 0.
        impl: "auto" (the Triton kernel on CUDA when triton is importable, else PyTorch),
            "torch" or "triton" (on the CPU it needs `TRITON_INTERPRET=1` set before triton is
            imported).

    Raises:
        TypeError: a non-tensor argument, a wrong dtype or rank, a non-contiguous `out`.
        ValueError: mixed devices, `max_pages` past `MAX_PAGES_PER_REQUEST` (CUDA's grid
            limit, on every path), `out` or the table too small, an unknown `impl`.
        RuntimeError: `impl="triton"` without triton installed.

    `num_pages` and `max_pages` must match `page_indptr`: they are not checked against its
    values (that would synchronise with the GPU).
    """
    _validate(block_table, page_indptr, out, num_pages, max_pages, first_row)
    chosen = use_triton(_OP, impl, block_table.device)
    num_reqs = page_indptr.shape[0] - 1
    if num_pages == 0 or num_reqs == 0:
        return
    if chosen:
        grid = (num_reqs, triton.cdiv(max_pages, _TILE_COLS))
        _gather_pages_kernel[grid](
            block_table, page_indptr, out, first_row, *block_table.stride(),
            page_indptr.stride(0), TILE_COLS=_TILE_COLS, num_warps=4,
        )  # fmt: skip
        return
    table = block_table[first_row : first_row + num_reqs]
    device = block_table.device
    counts = page_indptr[1:] - page_indptr[:-1]
    # request and column of every page: int64 [num_pages]
    request = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), counts, output_size=num_pages
    )
    column = torch.arange(num_pages, device=device) - page_indptr[:-1].long()[request]
    out[:num_pages] = table[request, column]


if triton is not None:
    # first_row is not specialised on: the paged-prefill part's varies from step to step, and
    # each value Triton specialises on (1, multiples of 16) would be a compile mid-serving.
    @triton.jit(do_not_specialize=["first_row"])
    def _gather_pages_kernel(
        table_ptr,
        indptr_ptr,
        out_ptr,
        first_row,
        stride_t_req,
        stride_t_col,
        stride_indptr,
        TILE_COLS: tl.constexpr,
    ):
        req = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        start = tl.load(indptr_ptr + req * stride_indptr).to(tl.int64)
        count = tl.load(indptr_ptr + (req + 1) * stride_indptr).to(tl.int64) - start
        # Requests with fewer pages than the most have empty tiles: they stop here.
        if tile * TILE_COLS < count:
            # int64: a column times a transposed table's row count may pass 2**31
            cols = tile.to(tl.int64) * TILE_COLS + tl.arange(0, TILE_COLS)
            is_page = cols < count
            pages = tl.load(
                table_ptr + (first_row + req) * stride_t_req + cols * stride_t_col,
                mask=is_page,
            )
            tl.store(out_ptr + start + cols, pages, mask=is_page)


def gather_pages_ref(
    block_table: torch.Tensor, page_indptr: torch.Tensor, out: torch.Tensor, *, first_row: int = 0
) -> None:
    """Reference for `gather_pages`: same result, one page at a time. No validation."""
    bounds = page_indptr.tolist()
    for i in range(len(bounds) - 1):
        for j in range(bounds[i + 1] - bounds[i]):
            out[bounds[i] + j] = block_table[first_row + i, j]


def _validate(
    block_table: torch.Tensor,
    page_indptr: torch.Tensor,
    out: torch.Tensor,
    num_pages: int,
    max_pages: int,
    first_row: int,
) -> None:
    """Shapes, dtypes, devices and host integers; never tensor values (no sync)."""
    check_tensors_on_one_device(
        _OP, (("block_table", block_table), ("page_indptr", page_indptr), ("out", out))
    )
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise TypeError(
            f"{_OP}: block_table must be int32 [rows, max_blocks] (got {block_table.dtype} of "
            f"rank {block_table.dim()})."
        )
    if page_indptr.dtype not in (torch.int32, torch.int64) or page_indptr.dim() != 1:
        raise TypeError(
            f"{_OP}: page_indptr must be int32 or int64 [num_reqs + 1] (got "
            f"{page_indptr.dtype} of rank {page_indptr.dim()})."
        )
    if out.dtype != torch.int32 or out.dim() != 1 or not out.is_contiguous():
        raise TypeError(
            f"{_OP}: out must be a contiguous int32 [num_pages] tensor (got {out.dtype} of "
            f"shape {list(out.shape)}, contiguous={out.is_contiguous()})."
        )
    num_reqs = page_indptr.shape[0] - 1
    if num_reqs < 0 or first_row < 0:
        raise ValueError(
            f"{_OP}: page_indptr must have at least 1 entry and first_row must be >= 0 (got "
            f"{page_indptr.shape[0]} entries, first_row={first_row})."
        )
    if max_pages > MAX_PAGES_PER_REQUEST:
        raise ValueError(
            f"{_OP}: a request has too many pages for the kernel's grid (got max_pages="
            f"{max_pages}, expected <= {MAX_PAGES_PER_REQUEST}). Use a larger block size."
        )
    if first_row + num_reqs > block_table.shape[0]:
        raise ValueError(
            f"{_OP}: block_table has too few rows (got {block_table.shape[0]}, expected >= "
            f"first_row + num_reqs = {first_row + num_reqs})."
        )
    if min(num_pages, max_pages) < 0 or num_pages > out.shape[0]:
        raise ValueError(
            f"{_OP}: the pages do not fit out (got num_pages={num_pages}, max_pages="
            f"{max_pages} for {out.shape[0]} entries, expected 0 <= num_pages <= entries, "
            "max_pages >= 0). Grow out."
        )
    if max_pages > block_table.shape[1]:
        raise ValueError(
            f"{_OP}: block_table too narrow for the longest request (got "
            f"{block_table.shape[1]} columns, expected >= max_pages {max_pages})."
        )
