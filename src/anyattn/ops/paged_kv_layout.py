"""A batch's paged-KV layout in FlashInfer's CSR form, made on the device from its `seq_lens`
and block table in one kernel launch.

FlashInfer's paged wrappers read a batch as three arrays (`flashinfer_plan` explains the form):
`indptr [R + 1]` (request i's pages are `indices[indptr[i] : indptr[i + 1]]`),
`last_page_len [R]` (tokens in its last page) and `indices` (the flat page list). A builder that
derives the first two on the host has to copy them to the device and then gather the pages
there: two device operations, each several microseconds of host time. `paged_kv_layout` computes
all three from the device's `seq_lens` and block table, so a step costs one launch and nothing
crosses from the host but a few integers.

Request i (of `num_reqs`) holds `ceil(seq_lens[first_row + i] / block_size)` pages, the first
columns of block-table row `first_row + i`. Requests `num_reqs .. R - 1` are padding (a CUDA-graph
batch padded to its captured size): no pages, last-page length 1, as FlashInfer plans them. A
request without tokens gets no pages and last-page length 1 too. Entries of `indices` past the
last page are untouched.

On CUDA, when triton is importable, one Triton kernel: program (i, t) sums the pages of the
requests before i (its offset), writes request i's offset and last-page length (t = 0) and copies
its column tile t. The PyTorch path (a handful of ops, no synchronisation) serves the CPU and
CUDA without triton; `impl=` forces either one (tests run the kernel on the CPU under
`TRITON_INTERPRET=1`). `paged_kv_layout_ref` is the plain-Python reference.
"""

from __future__ import annotations

import torch

from anyattn.ops.compiled_launch import CompiledLaunch
from anyattn.ops.impl_choice import use_triton
from anyattn.ops.tensor_checks import check_tensors_on_one_device

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = [
    "MAX_PAGES_PER_REQUEST",
    "PagedKvLayoutLaunch",
    "paged_kv_layout",
    "paged_kv_layout_ref",
]

_OP = "paged_kv_layout"
_TILE_COLS = 128
# Each program sums the pages of every request before its own, in one vector of the batch's
# size rounded up to a power of two, at least this (few compiled variants: one per power).
_MIN_TILE_REQS = 64
# Column tiles go on the grid's second dimension, whose CUDA limit (65535) bounds one request's
# pages; requests on the first (2**31 - 1).
MAX_PAGES_PER_REQUEST = 65535 * _TILE_COLS
_INT32_MAX = 2**31 - 1


def paged_kv_layout(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    indptr: torch.Tensor,
    last_page_len: torch.Tensor,
    indices: torch.Tensor,
    *,
    block_size: int,
    num_reqs: int,
    max_pages: int,
    first_row: int = 0,
    max_num_reqs: int = 0,
    impl: str = "auto",
    is_trusted: bool = False,
) -> None:
    """Write the layout of requests `first_row .. first_row + num_reqs - 1`, in place.

    Args:
        block_table: int32 `[rows, max_blocks]` physical block ids per request (any strides).
        seq_lens: int32 `[>= first_row + num_reqs]` tokens per request, on the table's device
            (any stride).
        indptr: int32 `[R + 1]`, contiguous, R >= num_reqs: the page offsets (out).
        last_page_len: int32 `[R]`, contiguous: tokens in each request's last page (out).
        indices: int32 `[>= num_reqs * max_pages]`, contiguous: the pages, request by request
            (out).
        block_size: tokens per page (KV-cache block), >= 1.
        num_reqs: the real requests; the other R - num_reqs are padding.
        max_pages: a host bound on one request's pages, `ceil(max_seq_len / block_size)` from
            the CPU mirrors. The kernel copies at most this many pages of a request, so `indices`
            is never written past `num_reqs * max_pages`, whatever the device's `seq_lens` hold.
        first_row: the block-table row and `seq_lens` entry of request 0.
        max_num_reqs: the most requests the caller will pass (a builder's
            `BatchLimits.max_num_reqs`): the kernel is compiled for batches up to the next power
            of two of the larger of it and `num_reqs`, so that a caller whose batches vary gets
            one compiled kernel, not one per power of two met while serving.
        impl: "auto" (the Triton kernel on CUDA when triton is importable, else PyTorch),
            "torch" or "triton" (on the CPU it needs `TRITON_INTERPRET=1` set before triton is
            imported).
        is_trusted: skip the checks, for a caller that made the outputs itself and has
            checked its inputs as they do (a builder's call every step, where the checks would
            cost about as much host time as the launch).

    Raises:
        TypeError: a non-tensor argument, a wrong dtype or rank, a non-contiguous output.
        ValueError: mixed devices, sizes that do not fit, a bad host integer, an unknown `impl`.
        RuntimeError: `impl="triton"` without triton installed.

    Reads no tensor value on the host: no synchronisation with the GPU.
    """
    if not is_trusted:
        _validate(
            block_table, seq_lens, indptr, last_page_len, indices,
            block_size, num_reqs, max_pages, first_row, max_num_reqs,
        )  # fmt: skip
    chosen = use_triton(_OP, impl, block_table.device)
    padded = indptr.shape[0] - 1
    if padded == 0:
        indptr.zero_()
        return
    if chosen:
        _launch(
            _grid(padded, max_pages), block_table, seq_lens, indptr, last_page_len, indices,
            block_size, num_reqs, max_pages, first_row, *block_table.stride(), seq_lens.stride(0),
            **_launch_options(max(num_reqs, max_num_reqs)),
        )  # fmt: skip
        return
    _torch_path(
        block_table, seq_lens, indptr, last_page_len, indices, block_size, num_reqs, max_pages,
        first_row,
    )  # fmt: skip


class PagedKvLayoutLaunch:
    """`paged_kv_layout(..., is_trusted=True)` for a caller that launches it every step (a
    builder), at a fraction of its host time: once the kernel has compiled on the current
    device, it is launched through `CompiledLaunch.bound` with raw device addresses, which
    the caller may keep for outputs it reuses. The caller checks what `is_trusted` skips.

    Args:
        block_size: tokens per page.
        max_num_reqs: as `paged_kv_layout` takes it (the most requests of one call, padding
            included, that the compiled kernel is sized for).
    """

    def __init__(self, block_size: int, max_num_reqs: int) -> None:
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        # (the options `paged_kv_layout` compiles batches up to max_num_reqs with)
        self._options = _launch_options(max_num_reqs)
        self._bound: object | None = None

    def __call__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        indptr: torch.Tensor,
        last_page_len: torch.Tensor,
        indices: torch.Tensor,
        num_reqs: int,
        max_pages: int,
        addresses: tuple[int, int, int] | None = None,
        padded: int | None = None,
    ) -> None:
        """`paged_kv_layout(block_table, seq_lens, indptr, last_page_len, indices, ...)` of
        requests `0 .. num_reqs - 1` (`first_row` 0), trusted; `addresses`: the three outputs'
        `data_ptr()`s, and `padded`: `indptr`'s length less one, where the caller keeps them.
        Padded batches up to `max_num_reqs` requests take the kept kernel; larger ones
        `paged_kv_layout` itself."""
        if padded is None:
            padded = indptr.shape[0] - 1
        bound = self._bound
        if (
            bound is not None
            and 0 < padded <= self.max_num_reqs
            and bound.device == torch.cuda.current_device()
        ):
            if addresses is None:
                addresses = (indptr.data_ptr(), last_page_len.data_ptr(), indices.data_ptr())
            bound(
                _grid(padded, max_pages), block_table.data_ptr(), seq_lens.data_ptr(), *addresses,
                self.block_size, num_reqs, max_pages, 0, *block_table.stride(), *seq_lens.stride(),
            )  # fmt: skip
            return
        paged_kv_layout(
            block_table, seq_lens, indptr, last_page_len, indices, block_size=self.block_size,
            num_reqs=num_reqs, max_pages=max_pages, max_num_reqs=self.max_num_reqs,
            is_trusted=True,
        )  # fmt: skip
        if bound is None and triton is not None and block_table.is_cuda:
            self._bound = _launch.bound(**self._options)


def _tile_reqs(num_reqs: int) -> int:
    """The kernel's request vector: `num_reqs` rounded up to a power of two, at least
    `_MIN_TILE_REQS`."""
    return max(1 << (num_reqs - 1).bit_length(), _MIN_TILE_REQS)


def _launch_options(num_reqs: int) -> dict[str, int]:
    """The constexprs and launch options of the kernel for batches of up to `num_reqs`
    requests, padding included: one set for `paged_kv_layout` and `PagedKvLayoutLaunch`, so
    that the compiled kernel the one keeps is the one the other binds."""
    return dict(TILE_COLS=_TILE_COLS, TILE_REQS=_tile_reqs(num_reqs), num_warps=4)


def _grid(padded_num_reqs: int, max_pages: int) -> tuple[int, int, int]:
    """One program per request and column tile. (Plain arithmetic: triton.cdiv is a
    constexpr-function wrapper, microseconds when called from the host.)"""
    return (padded_num_reqs, -(-max(max_pages, 1) // _TILE_COLS), 1)


def _torch_path(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    indptr: torch.Tensor,
    last_page_len: torch.Tensor,
    indices: torch.Tensor,
    block_size: int,
    num_reqs: int,
    max_pages: int,
    first_row: int,
) -> None:
    """The kernel's result with whole-batch PyTorch ops (no host read of device values)."""
    device = block_table.device
    seq = seq_lens[first_row : first_row + num_reqs].long()
    counts = ((seq + block_size - 1) // block_size).clamp(0, max_pages)
    indptr[0] = 0
    if num_reqs:
        indptr[1 : num_reqs + 1] = counts.cumsum(0)
    indptr[num_reqs + 1 :] = indptr[num_reqs]
    # (at most a page: where `max_pages` cut a request short, its last page is full)
    last = (seq - (counts - 1) * block_size).clamp(max=block_size)
    last_page_len[:num_reqs] = torch.where(counts > 0, last, torch.ones_like(last))
    last_page_len[num_reqs:] = 1
    if not num_reqs or not max_pages:
        return
    # Every (request, column) below the bound, written to its place in the list or, past the
    # request's pages, to one spare slot: no count of the pages is read back.
    cols = torch.arange(max_pages, device=device)
    is_page = cols[None, :] < counts[:, None]
    spare = indices.shape[0]
    target = torch.where(is_page, indptr[:num_reqs, None].long() + cols[None, :], spare)
    rows = block_table[first_row : first_row + num_reqs, :max_pages]
    staged = torch.cat([indices, indices.new_zeros(1)])
    staged.scatter_(0, target.reshape(-1), rows.reshape(-1))
    indices.copy_(staged[:spare])


if triton is not None:
    # Nothing is specialised on, so that `CompiledLaunch` may launch the compiled kernel with
    # any values (see compiled_launch); first_row varies from step to step as well.
    @triton.jit(
        do_not_specialize=[
            "block_size", "num_reqs", "max_pages", "first_row", "stride_t_req", "stride_t_col",
            "stride_seq",
        ],
        do_not_specialize_on_alignment=[
            "table_ptr", "seq_ptr", "indptr_ptr", "last_ptr", "indices_ptr",
        ],
    )  # fmt: skip
    def _paged_kv_layout_kernel(
        table_ptr,
        seq_ptr,
        indptr_ptr,
        last_ptr,
        indices_ptr,
        block_size,
        num_reqs,
        max_pages,
        first_row,
        stride_t_req,
        stride_t_col,
        stride_seq,
        TILE_COLS: tl.constexpr,
        TILE_REQS: tl.constexpr,
    ):
        req = tl.program_id(0)
        tile = tl.program_id(1)
        # The pages of the requests before this one (all of them, for a padding request).
        # (one load of every request's length: a loop with a runtime bound does not run
        # under the interpreter)
        others = tl.arange(0, TILE_REQS)
        seqs = tl.load(
            seq_ptr + (first_row + others).to(tl.int64) * stride_seq,
            mask=(others < req) & (others < num_reqs),
            other=0,
        ).to(tl.int64)
        start = tl.sum(tl.minimum(tl.maximum((seqs + block_size - 1) // block_size, 0), max_pages))
        count = tl.zeros([], dtype=tl.int64)
        last = tl.full([], 1, dtype=tl.int64)
        if req < num_reqs:
            seq = tl.load(seq_ptr + (first_row + req).to(tl.int64) * stride_seq).to(tl.int64)
            count = tl.minimum(tl.maximum((seq + block_size - 1) // block_size, 0), max_pages)
            if count > 0:
                last = tl.minimum(seq - (count - 1) * block_size, block_size)
        if tile == 0:
            tl.store(indptr_ptr + req + 1, (start + count).to(tl.int32))
            tl.store(last_ptr + req, last.to(tl.int32))
            if req == 0:
                tl.store(indptr_ptr, 0)
        # Requests with fewer pages than the most have empty tiles: they stop here.
        if tile * TILE_COLS < count:
            cols = tile.to(tl.int64) * TILE_COLS + tl.arange(0, TILE_COLS)
            is_page = cols < count
            pages = tl.load(
                table_ptr + (first_row + req).to(tl.int64) * stride_t_req + cols * stride_t_col,
                mask=is_page,
            )
            tl.store(indices_ptr + start + cols, pages, mask=is_page)

    # (a cache of compiled kernels, as Triton keeps one per jitted function: the same values
    # for every caller, made from the kernel and its launch options alone)
    _launch = CompiledLaunch(
        _paged_kv_layout_kernel,
        pointers=("table_ptr", "seq_ptr", "indptr_ptr", "last_ptr", "indices_ptr"),
    )


def paged_kv_layout_ref(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    padded_num_reqs: int,
    *,
    block_size: int,
    num_reqs: int,
    max_pages: int | None = None,
    first_row: int = 0,
) -> tuple[list[int], list[int], list[int]]:
    """Reference for `paged_kv_layout`, one request at a time over the tensors' values as
    Python lists: `(indptr, last_page_len, indices)` of `padded_num_reqs` requests, each of at
    most `max_pages` pages (None: no bound). No validation."""
    table = block_table.tolist()
    lens = seq_lens.tolist()
    indptr, last, indices = [0], [], []
    for i in range(padded_num_reqs):
        seq = lens[first_row + i] if i < num_reqs else 0
        count = max(-(-seq // block_size), 0)
        if max_pages is not None:
            count = min(count, max_pages)
        indices += table[first_row + i][:count]
        indptr.append(indptr[-1] + count)
        last.append(min(seq - (count - 1) * block_size, block_size) if count else 1)
    return indptr, last, indices


def _validate(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    indptr: torch.Tensor,
    last_page_len: torch.Tensor,
    indices: torch.Tensor,
    block_size: int,
    num_reqs: int,
    max_pages: int,
    first_row: int,
    max_num_reqs: int,
) -> None:
    """Shapes, dtypes, devices and host integers; never tensor values (no sync)."""
    tensors = (
        ("block_table", block_table), ("seq_lens", seq_lens), ("indptr", indptr),
        ("last_page_len", last_page_len), ("indices", indices),
    )  # fmt: skip
    check_tensors_on_one_device(_OP, tensors, torch.int32)
    if block_table.dim() != 2:
        raise TypeError(
            f"{_OP}: block_table must be [rows, max_blocks] (got shape {list(block_table.shape)})."
        )
    if seq_lens.dim() != 1:
        raise TypeError(f"{_OP}: seq_lens must be 1-D (got shape {list(seq_lens.shape)}).")
    for name, x in tensors[2:]:
        if x.dim() != 1 or not x.is_contiguous():
            raise TypeError(
                f"{_OP}: {name} must be a contiguous 1-D tensor (got shape {list(x.shape)}, "
                f"contiguous={x.is_contiguous()})."
            )
    for name, value in (
        ("block_size", block_size), ("num_reqs", num_reqs), ("max_pages", max_pages),
        ("first_row", first_row), ("max_num_reqs", max_num_reqs),
    ):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{_OP}: {name} must be an int (got {type(value).__name__}).")
    if block_size < 1 or min(num_reqs, max_pages, first_row, max_num_reqs) < 0:
        raise ValueError(
            f"{_OP}: block_size must be >= 1 and num_reqs, max_pages, first_row, max_num_reqs "
            f">= 0 (got block_size={block_size}, num_reqs={num_reqs}, max_pages={max_pages}, "
            f"first_row={first_row}, max_num_reqs={max_num_reqs})."
        )
    padded = indptr.shape[0] - 1
    if padded < num_reqs or last_page_len.shape[0] != padded:
        raise ValueError(
            f"{_OP}: indptr must have R + 1 entries and last_page_len R, with R >= num_reqs "
            f"(got {indptr.shape[0]} and {last_page_len.shape[0]} for num_reqs={num_reqs})."
        )
    if max_pages > MAX_PAGES_PER_REQUEST:
        raise ValueError(
            f"{_OP}: a request has too many pages for the kernel's grid (got max_pages="
            f"{max_pages}, expected <= {MAX_PAGES_PER_REQUEST}). Use a larger block size."
        )
    if first_row + num_reqs > min(block_table.shape[0], seq_lens.shape[0]):
        raise ValueError(
            f"{_OP}: block_table or seq_lens has too few rows (got {block_table.shape[0]} and "
            f"{seq_lens.shape[0]}, expected >= first_row + num_reqs = {first_row + num_reqs})."
        )
    if max_pages > block_table.shape[1] and num_reqs:
        raise ValueError(
            f"{_OP}: block_table too narrow for max_pages (got {block_table.shape[1]} columns, "
            f"expected >= {max_pages})."
        )
    bound = num_reqs * max_pages
    if bound > indices.shape[0] or bound > _INT32_MAX:
        raise ValueError(
            f"{_OP}: indices too small for num_reqs * max_pages pages (got {indices.shape[0]} "
            f"entries, expected >= {bound}, and int32 offsets: <= {_INT32_MAX})."
        )
    # (the kernel takes its integers as int32, see compiled_launch)
    strides = (*block_table.stride(), seq_lens.stride(0))
    if max(*strides, block_size, first_row) > _INT32_MAX:
        raise ValueError(
            f"{_OP}: strides and host integers must be below 2**31 (got strides {strides}, "
            f"block_size={block_size}, first_row={first_row})."
        )
