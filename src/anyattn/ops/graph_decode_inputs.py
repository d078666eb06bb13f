"""A CUDA-graph decode step's block table and sequence lengths copied into the buffers its graph
was captured over, in one kernel launch.

A graph captured for a batch of P single-token decodes reads the block table and `seq_lens` at
the addresses it was captured with. A replay step whose tensors live elsewhere (a runner that
does not keep them at fixed addresses) copies its own in: with torch, the table's rows, the
lengths and the padding rows' lengths are two or three device operations of several
microseconds of host time each. `copy_graph_decode_inputs` is one launch (`GraphDecodeInputsLaunch`
binds it to a builder's device and error messages).

Rows `0 .. num_reqs - 1` get the first `num_cols` columns of the step's table rows and their
lengths; rows `num_reqs .. P - 1` (padding) get the length `pad_len`, their table rows left as
they are (every id an earlier step wrote there is one of the cache's, and zeros are the null
block: a padding row of length 1 reads one page of its row, a row of length 0 none). Columns at
and past `num_cols` are left as they are: `num_cols` covers the pages of the step's longest
request, and no kernel reads a request's row past its pages. The step's tensors may be the
buffers themselves, but must not otherwise overlap them (the copy is not ordered: torch refuses
such a copy, the kernel would race).

On CUDA, when triton is importable, one Triton kernel, program (row, column tile); the PyTorch
path (three ops) serves the CPU and CUDA without triton; `impl=` forces either one (tests run
the kernel on the CPU under `TRITON_INTERPRET=1`). `copy_graph_decode_inputs_ref` is the
plain-Python reference.
"""

from __future__ import annotations

import contextlib

import torch

from anyattn.ops.impl_choice import use_triton
from anyattn.ops.tensor_checks import check_tensors_on_one_device

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = [
    "GraphDecodeInputsLaunch",
    "copy_graph_decode_inputs",
    "copy_graph_decode_inputs_ref",
]

_OP = "copy_graph_decode_inputs"
_TILE_COLS = 256
# (the one compiled configuration: nothing in it depends on the batch)
_OPTIONS = {"TILE_COLS": _TILE_COLS, "num_warps": 4}
# Column tiles go on the grid's second dimension, whose CUDA limit is 65535.
_MAX_COLS = 65535 * _TILE_COLS
_INT32_MAX = 2**31 - 1


def copy_graph_decode_inputs(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    table_out: torch.Tensor,
    lens_out: torch.Tensor,
    *,
    num_reqs: int,
    num_cols: int,
    pad_len: int,
    impl: str = "auto",
    is_trusted: bool = False,
) -> None:
    """Copy a step's decode inputs into a graph's buffers, in place (see the module docstring).

    Args:
        block_table: int32 `[>= num_reqs, >= num_cols]` the step's block table (any strides).
        seq_lens: int32 `[>= num_reqs]` the step's lengths (any stride).
        table_out: int32 `[>= num_reqs, >= num_cols]` the graph's table, rows contiguous
            (out).
        lens_out: int32 `[P]`, contiguous, P >= num_reqs: the graph's lengths (out), padding
            rows included.
        num_reqs: the step's requests.
        num_cols: the table columns to copy (the pages of the longest request, or more).
        pad_len: the length the padding rows get (>= 0).
        impl: "auto" (the Triton kernel on CUDA when triton is importable, else PyTorch),
            "torch" or "triton" (on the CPU it needs `TRITON_INTERPRET=1` set before triton is
            imported).
        is_trusted: skip the checks, for a caller that made the outputs itself and checks its
            inputs as they do (a builder, every step).

    Raises:
        TypeError: a non-tensor argument, a wrong dtype or rank, an output not laid out as
            above, a non-integer host value.
        ValueError: mixed devices, sizes that do not fit, a negative host integer, an unknown
            `impl`.
        RuntimeError: `impl="triton"` without triton installed.

    Reads no tensor value on the host: no synchronisation with the GPU.
    """
    if not is_trusted:
        _validate(block_table, seq_lens, table_out, lens_out, num_reqs, num_cols, pad_len)
    padded = lens_out.shape[0]
    if padded == 0:
        return
    if use_triton(_OP, impl, block_table.device):
        _graph_decode_inputs_kernel[_grid(padded, num_cols)](
            block_table, seq_lens, table_out, lens_out, num_reqs,
            num_cols, pad_len, *block_table.stride(), seq_lens.stride(0), table_out.stride(0),
            **_OPTIONS,
        )  # fmt: skip
        return
    if num_reqs and num_cols:
        table_out[:num_reqs, :num_cols].copy_(block_table[:num_reqs, :num_cols])
    lens_out[:num_reqs].copy_(seq_lens[:num_reqs])
    lens_out[num_reqs:].fill_(pad_len)


class GraphDecodeInputsLaunch:
    """`copy_graph_decode_inputs` for a builder that copies every replay step into buffers it
    owns. The step's tensors are checked (dtypes, ranks, sizes, device), the outputs and host
    integers are trusted; a call while another CUDA device is current launches on the
    builder's.

    Args:
        device: the builder's device (the step's tensors must be on it).
        api: what the errors name (the builder's call).
    """

    def __init__(self, device: torch.device, api: str) -> None:
        self.device = device
        self.api = api
        # (a CUDA device without an index is the current one, resolved at the first call, so
        # that making a builder never starts CUDA)
        self._device_index: int | None = device.index if device.type == "cuda" else -1

    def __call__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        table_out: torch.Tensor,
        lens_out: torch.Tensor,
        num_reqs: int,
        num_cols: int,
        pad_len: int,
        addresses: tuple[int, int] | None = None,
    ) -> None:
        """`copy_graph_decode_inputs(block_table, seq_lens, table_out, lens_out, ...)`;
        `addresses`: accepted for callers that keep the outputs' `data_ptr()`s; unused.

        Args:
            block_table: int32 `[>= num_reqs, >= num_cols]` on the builder's device.
            seq_lens: int32 `[>= num_reqs]` on the builder's device.
            table_out, lens_out: the builder's buffers, as `copy_graph_decode_inputs` takes
                them, with room for `num_reqs` rows and `num_cols` columns (not checked).

        Raises:
            ValueError: a step tensor of another dtype, rank, size or device (nothing written).
        """
        index = self._device_index
        if index is None:
            index = self._device_index = torch.cuda.current_device()
        if (
            seq_lens.dtype != torch.int32
            or block_table.dtype != torch.int32
            or seq_lens.dim() != 1
            or block_table.dim() != 2
            or seq_lens.shape[0] < num_reqs
            or block_table.shape[0] < num_reqs
            or block_table.shape[1] < num_cols
            or seq_lens.get_device() != index
            or block_table.get_device() != index
        ):
            self._refuse(block_table, seq_lens, num_reqs, num_cols)
        # (Triton compiles for and launches on the current device: the builder's is made
        # current where another is)
        elsewhere = index >= 0 and torch.cuda.current_device() != index
        with torch.cuda.device(index) if elsewhere else contextlib.nullcontext():
            copy_graph_decode_inputs(
                block_table, seq_lens, table_out, lens_out, num_reqs=num_reqs,
                num_cols=num_cols, pad_len=pad_len, is_trusted=True,
            )  # fmt: skip

    def _refuse(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int, num_cols: int
    ) -> None:
        """Raises for the first step tensor `__call__` found unfit."""
        expected = self.device if self._device_index < 0 else f"cuda:{self._device_index}"
        for name, x, dim in (("block_table_tensor", block_table, 2), ("seq_lens", seq_lens, 1)):
            if x.dtype != torch.int32 or x.dim() != dim or x.get_device() != self._device_index:
                raise ValueError(
                    f"{self.api}: {name} must be an int32 tensor of rank {dim} on the builder's "
                    f"device (got {x.dtype} of shape {tuple(x.shape)} on {x.device}, expected "
                    f"{expected})."
                )
        raise ValueError(
            f"{self.api}: the step's tensors are too small for a CUDA-graph copy of {num_reqs} "
            f"requests and {num_cols} table columns (got block_table_tensor of shape "
            f"{tuple(block_table.shape)}, seq_lens of shape {tuple(seq_lens.shape)})."
        )


def _grid(padded: int, num_cols: int) -> tuple[int, int, int]:
    """One program per row and column tile (plain arithmetic: see paged_kv_layout)."""
    return (padded, -(-max(num_cols, 1) // _TILE_COLS), 1)


if triton is not None:
    # (no specialisation on the batch's sizes: one compiled kernel serves every step)
    @triton.jit(
        do_not_specialize=[
            "num_reqs", "num_cols", "pad_len", "stride_t_row", "stride_t_col", "stride_seq",
            "stride_out_row",
        ],
    )  # fmt: skip
    def _graph_decode_inputs_kernel(
        table_ptr,
        seq_ptr,
        table_out_ptr,
        lens_out_ptr,
        num_reqs,
        num_cols,
        pad_len,
        stride_t_row,
        stride_t_col,
        stride_seq,
        stride_out_row,
        TILE_COLS: tl.constexpr,
    ):
        row = tl.program_id(0)
        tile = tl.program_id(1)
        if row < num_reqs:
            if tile == 0:
                tl.store(lens_out_ptr + row, tl.load(seq_ptr + row.to(tl.int64) * stride_seq))
            cols = tile.to(tl.int64) * TILE_COLS + tl.arange(0, TILE_COLS)
            is_col = cols < num_cols
            pages = tl.load(
                table_ptr + row.to(tl.int64) * stride_t_row + cols * stride_t_col, mask=is_col
            )
            tl.store(table_out_ptr + row.to(tl.int64) * stride_out_row + cols, pages, mask=is_col)
        elif tile == 0:
            tl.store(lens_out_ptr + row, pad_len)


def copy_graph_decode_inputs_ref(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    table_out: torch.Tensor,
    lens_out: torch.Tensor,
    *,
    num_reqs: int,
    num_cols: int,
    pad_len: int,
) -> tuple[list[list[int]], list[int]]:
    """Reference for `copy_graph_decode_inputs`, row by row over the tensors' values as Python
    lists: the `(table_out, lens_out)` it leaves, as lists. No validation; writes nothing."""
    table, out = block_table.tolist(), table_out.tolist()
    lens = seq_lens.tolist()
    for row in range(num_reqs):
        out[row][:num_cols] = table[row][:num_cols]
    padded = len(lens_out)
    return out, lens[:num_reqs] + [pad_len] * (padded - num_reqs)


def _validate(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    table_out: torch.Tensor,
    lens_out: torch.Tensor,
    num_reqs: int,
    num_cols: int,
    pad_len: int,
) -> None:
    """Shapes, dtypes, devices and host integers; never tensor values (no sync)."""
    tensors = (
        ("block_table", block_table), ("seq_lens", seq_lens), ("table_out", table_out),
        ("lens_out", lens_out),
    )  # fmt: skip
    check_tensors_on_one_device(_OP, tensors, torch.int32)
    for name, value in (("num_reqs", num_reqs), ("num_cols", num_cols), ("pad_len", pad_len)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{_OP}: {name} must be an int (got {type(value).__name__}).")
    if block_table.dim() != 2 or table_out.dim() != 2:
        raise TypeError(
            f"{_OP}: block_table and table_out must be [rows, columns] (got shapes "
            f"{list(block_table.shape)} and {list(table_out.shape)})."
        )
    if table_out.shape[1] > 1 and table_out.stride(1) != 1:
        raise TypeError(
            f"{_OP}: table_out's rows must be contiguous (got strides {table_out.stride()})."
        )
    if seq_lens.dim() != 1 or lens_out.dim() != 1 or not lens_out.is_contiguous():
        raise TypeError(
            f"{_OP}: seq_lens must be 1-D and lens_out contiguous 1-D (got shapes "
            f"{list(seq_lens.shape)} and {list(lens_out.shape)}, lens_out contiguous="
            f"{lens_out.is_contiguous()})."
        )
    if min(num_reqs, num_cols, pad_len) < 0 or max(num_cols, pad_len) > _INT32_MAX:
        raise ValueError(
            f"{_OP}: num_reqs, num_cols and pad_len must be >= 0, below 2**31 (got num_reqs="
            f"{num_reqs}, num_cols={num_cols}, pad_len={pad_len})."
        )
    rows = (block_table.shape[0], seq_lens.shape[0], table_out.shape[0], lens_out.shape[0])
    if num_reqs > min(rows):
        raise ValueError(
            f"{_OP}: too few rows for num_reqs={num_reqs} (got block_table {rows[0]}, seq_lens "
            f"{rows[1]}, table_out {rows[2]}, lens_out {rows[3]})."
        )
    if num_reqs and num_cols > min(block_table.shape[1], table_out.shape[1]):
        raise ValueError(
            f"{_OP}: num_cols past a table's width (got num_cols={num_cols}, block_table "
            f"{block_table.shape[1]} and table_out {table_out.shape[1]} columns)."
        )
    if num_cols > _MAX_COLS:
        raise ValueError(
            f"{_OP}: too many columns for the kernel's grid (got num_cols={num_cols}, expected "
            f"<= {_MAX_COLS})."
        )
    # (the kernel takes its integers as int32)
    strides = (*block_table.stride(), seq_lens.stride(0), table_out.stride(0))
    if max(strides) > _INT32_MAX or min(strides) < 0:
        raise ValueError(f"{_OP}: strides must be in [0, 2**31) (got {strides}).")
