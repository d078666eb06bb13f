"""gather_pages against a plain-Python reference, exactly: the PyTorch path on the CPU (a fixed
case list and random batches), the Triton kernel under `TRITON_INTERPRET=1` (this file run as a
script in a subprocess, since Triton decides at import whether kernels are interpreted) and,
marked `gpu`, on CUDA (a 256-request decode batch, and no host-device sync). Also every rejected
input, each leaving `out` as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from case_runner import exit_with_report, failures_of
from hypothesis import given, settings
from hypothesis import strategies as st

from anyattn.ops import gather_pages as module
from anyattn.ops import impl_choice
from anyattn.ops.gather_pages import MAX_PAGES_PER_REQUEST, gather_pages, gather_pages_ref

SENTINEL = -7  # what `out` holds before a call: entries the op must not write keep it
LAYOUTS = ("contiguous", "column_slice", "transposed", "strided")


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch: request i has `lens[i]` pages, read from table row `first_row + i`."""

    lens: tuple[int, ...]
    width: int  # block-table columns, >= max(lens)
    first_row: int = 0
    spare_rows: int = 1  # table rows after the last request's, never read
    out_extra: int = 3  # entries of `out` past num_pages, never written
    indptr_dtype: torch.dtype = torch.int32
    layout: str = "contiguous"  # the block table's memory layout, one of LAYOUTS
    is_indptr_strided: bool = False
    block_cols: int | None = None  # shrink the kernel's column tile to this


def case_id(case: Case) -> str:
    lens = ",".join(map(str, case.lens)) or "none"
    parts = [f"lens={lens}", f"w{case.width}", f"row{case.first_row}", f"+{case.out_extra}"]
    parts += [str(case.indptr_dtype).removeprefix("torch."), case.layout]
    if case.is_indptr_strided:
        parts.append("strided_indptr")
    if case.block_cols:
        parts.append(f"cols{case.block_cols}")
    return "-".join(parts)


def make_table(rows: int, width: int, layout: str, device: str = "cpu") -> torch.Tensor:
    """int32 [rows, width] of distinct shuffled block ids (block 0, the null block, unused), so
    a page read from the wrong row or column shows; laid out as `layout` says."""
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    pool = 2 * rows * width + 8  # more blocks than the table holds
    values = (torch.randperm(pool, generator=gen)[: rows * width] + 1).int().view(rows, width)
    values = values.to(device)
    if layout == "contiguous":
        return values
    if layout == "column_slice":  # strides (width + 3, 1)
        wide = torch.zeros(rows, width + 3, dtype=torch.int32, device=device)
        wide[:, :width] = values
        return wide[:, :width]
    if layout == "transposed":  # column-major, strides (1, rows)
        return values.t().contiguous().t()
    assert layout == "strided", layout  # strides (2 * (2 * width + 1), 2)
    big = torch.zeros(2 * rows, 2 * width + 1, dtype=torch.int32, device=device)
    big[::2, 1::2] = values
    return big[::2, 1::2]


def make_indptr(
    lens: tuple[int, ...], dtype: torch.dtype, is_strided: bool, device: str = "cpu"
) -> torch.Tensor:
    bounds = [0]
    for count in lens:
        bounds.append(bounds[-1] + count)
    indptr = torch.tensor(bounds, dtype=dtype, device=device)
    if not is_strided:
        return indptr
    spaced = torch.full((2 * len(bounds),), -1, dtype=dtype, device=device)
    spaced[::2] = indptr
    return spaced[::2]


def expected_out(
    table: list[list[int]], lens: tuple[int, ...], first_row: int, out_len: int
) -> list[int]:
    """The specification, one page at a time over plain lists."""
    out = [SENTINEL] * out_len
    position = 0
    for i, count in enumerate(lens):
        for column in range(count):
            out[position] = table[first_row + i][column]
            position += 1
    return out


@contextlib.contextmanager
def small_block_cols(block_cols: int | None) -> Iterator[None]:
    """Shrink the kernel's column tile so tiny requests span several tiles."""
    saved = module._TILE_COLS
    module._TILE_COLS = block_cols or saved
    try:
        yield
    finally:
        module._TILE_COLS = saved


@contextlib.contextmanager
def kernel_launches() -> Iterator[list[tuple[int, ...]]]:
    """Record the grid of every launch of the Triton kernel (none when triton is missing)."""
    grids: list[tuple[int, ...]] = []
    real = getattr(module, "_gather_pages_kernel", None)
    if real is None:
        yield grids
        return

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            grids.append(tuple(grid))
            return real[grid]

    module._gather_pages_kernel = Spy()
    try:
        yield grids
    finally:
        module._gather_pages_kernel = real


def check_case(case: Case, device: str, impl: str) -> None:
    """`impl` on `device` writes exactly the expected pages and nothing else; so does the ref;
    the Triton kernel is launched once, on the grid the tile size implies (never for no pages)."""
    num_reqs = len(case.lens)
    rows = case.first_row + num_reqs + case.spare_rows
    table = make_table(rows, case.width, case.layout, device)
    indptr = make_indptr(case.lens, case.indptr_dtype, case.is_indptr_strided, device)
    num_pages, max_pages = sum(case.lens), max(case.lens, default=0)
    out = torch.full((num_pages + case.out_extra,), SENTINEL, dtype=torch.int32, device=device)
    want = expected_out(table.cpu().tolist(), case.lens, case.first_row, out.shape[0])

    ref_out = out.cpu()
    gather_pages_ref(table.cpu(), indptr.cpu(), ref_out, first_row=case.first_row)
    assert ref_out.tolist() == want, "gather_pages_ref disagrees with the plain reference"

    with small_block_cols(case.block_cols), kernel_launches() as grids:
        gather_pages(
            table, indptr, out, num_pages=num_pages, max_pages=max_pages,
            first_row=case.first_row, impl=impl,
        )  # fmt: skip
        block_cols = module._TILE_COLS
    assert out.cpu().tolist() == want
    is_launched = impl == "triton" or (
        impl == "auto" and device == "cuda" and module.triton is not None
    )
    if is_launched and num_pages > 0:
        assert grids == [(num_reqs, -(-max_pages // block_cols))]
    else:
        assert grids == []


# A request with no pages, one filling its table row (7 of 7), several across column tiles.
LENS = (3, 0, 5, 1, 7, 0)
CASES = [
    Case(LENS, 7),
    Case(LENS, 7, indptr_dtype=torch.int64),
    Case(LENS, 9, first_row=2, spare_rows=2),
    *(Case(LENS, 7, first_row=1, layout=layout) for layout in LAYOUTS[1:]),
    Case(LENS, 8, first_row=1, indptr_dtype=torch.int64, is_indptr_strided=True),
    Case(LENS, 7, is_indptr_strided=True, layout="strided"),
    # More pages per request than a column tile: 7 pages over 2-column tiles, 8 over 4 exactly.
    Case(LENS, 7, first_row=1, block_cols=2),
    Case(LENS, 7, indptr_dtype=torch.int64, layout="transposed", block_cols=2),
    Case((8, 4, 3, 0, 8), 8, first_row=2, layout="column_slice", block_cols=4),
    Case((6,), 6, out_extra=0),  # one request, `out` exactly num_pages long
    Case((1,) * 9, 1, first_row=3, out_extra=0),  # decode-like: one page each
    Case((0, 0, 0), 2),  # requests, but no pages
    Case((), 3, first_row=2),  # no requests
]


def run_cases(device: str, impl: str) -> list[str]:
    """Run every case, return the ids (and errors) of those that failed."""
    return failures_of(CASES, lambda case: check_case(case, device, impl), case_id)


# --- on the CPU -------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "auto"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_path_matches_reference(case: Case, impl: str) -> None:
    check_case(case, "cpu", impl)


def test_kernel_under_interpreter(triton_interpreter: Any) -> None:
    stdout = triton_interpreter(__file__)
    assert f"ran {len(CASES)} cases, 0 failed" in stdout, stdout


def test_layouts_have_the_intended_strides() -> None:
    """The non-contiguous layouts really are: non-unit strides (so a kernel assuming a dense
    row-major table would fail the cases above)."""
    strides = {layout: make_table(5, 4, layout).stride() for layout in LAYOUTS}
    assert strides == {
        "contiguous": (4, 1),
        "column_slice": (7, 1),
        "transposed": (1, 5),
        "strided": (18, 2),
    }
    assert make_indptr((1, 2), torch.int32, True).stride() == (2,)


@st.composite
def random_cases(draw: st.DrawFn) -> Case:
    lens = tuple(draw(st.lists(st.integers(0, 9), max_size=8)))
    return Case(
        lens,
        max(lens, default=0) + draw(st.integers(0, 3)),
        first_row=draw(st.integers(0, 3)),
        spare_rows=draw(st.integers(0, 2)),
        out_extra=draw(st.integers(0, 3)),
        indptr_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        layout=draw(st.sampled_from(LAYOUTS)),
        is_indptr_strided=draw(st.booleans()),
    )


@settings(max_examples=100, deadline=None)
@given(case=random_cases())
def test_random_batches_torch_path(case: Case) -> None:
    check_case(case, "cpu", "torch")


@pytest.mark.parametrize("impl", ["auto", "torch", "triton"])
def test_nothing_to_copy_leaves_out_untouched(impl: str) -> None:
    """No requests, or requests without pages: no write and (for the kernel) no launch, so
    `impl="triton"` is fine on the CPU even without the interpreter."""
    if impl == "triton":
        pytest.importorskip("triton")
    table = make_table(3, 4, "contiguous")
    out = torch.full((5,), SENTINEL, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    calls = [
        (table, torch.zeros(1, dtype=torch.int32), out, 0),
        (table, torch.zeros(1, dtype=torch.int64), out, 3),  # first_row at the table's end
        (table, torch.zeros(4, dtype=torch.int32), out, 0),  # three requests with no pages
        (torch.zeros(0, 0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), empty, 0),
    ]
    with kernel_launches() as grids:
        for block_table, page_indptr, target, first_row in calls:
            gather_pages(
                block_table, page_indptr, target, num_pages=0, max_pages=0,
                first_row=first_row, impl=impl,
            )  # fmt: skip
    assert grids == []
    assert out.tolist() == [SENTINEL] * 5


def _valid_args() -> dict[str, Any]:
    """Four requests of (3, 0, 5, 1) pages from rows 1.. of a [6, 6] table, `out` of 12."""
    return {
        "block_table": make_table(6, 6, "contiguous"),
        "page_indptr": torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32),
        "out": torch.full((12,), SENTINEL, dtype=torch.int32),
        "num_pages": 9,
        "max_pages": 5,
        "first_row": 1,
    }


def _call(args: dict[str, Any]) -> None:
    positional = [args.pop(name) for name in ("block_table", "page_indptr", "out")]
    gather_pages(*positional, **args)


def test_valid_args_are_accepted() -> None:
    """The base of the rejection cases below is itself valid (so each case tests its change)."""
    args = _valid_args()
    out = args["out"]
    _call(args)
    assert out[9:].tolist() == [SENTINEL] * 3 and SENTINEL not in out[:9].tolist()


def _sentinels(n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.full((n,), SENTINEL, dtype=dtype)


REJECTED = [
    ({"block_table": [[1, 2]]}, TypeError, "block_table must be a torch.Tensor"),
    ({"page_indptr": [0, 3, 3, 8, 9]}, TypeError, "page_indptr must be a torch.Tensor"),
    ({"out": [SENTINEL] * 12}, TypeError, "out must be a torch.Tensor"),
    ({"block_table": torch.zeros(6, 6, dtype=torch.int64)}, TypeError, "block_table must be int32"),
    ({"block_table": torch.zeros(36, dtype=torch.int32)}, TypeError, "of rank 1"),
    ({"page_indptr": torch.tensor([0.0, 3, 3, 8, 9])}, TypeError, "page_indptr must be int32 or"),
    ({"page_indptr": torch.zeros(5, 1, dtype=torch.int32)}, TypeError, "of rank 2"),
    ({"out": _sentinels(12, torch.int64)}, TypeError, "out must be a contiguous int32"),
    ({"out": _sentinels(24)[::2]}, TypeError, "contiguous=False"),
    ({"out": _sentinels(12).view(12, 1)}, TypeError, "shape [12, 1]"),
    ({"page_indptr": torch.zeros(5, dtype=torch.int32, device="meta")}, ValueError, "device"),
    ({"out": torch.zeros(12, dtype=torch.int32, device="meta")}, ValueError, "another device"),
    ({"page_indptr": torch.zeros(0, dtype=torch.int32)}, ValueError, "got 0 entries"),
    (
        {"max_pages": MAX_PAGES_PER_REQUEST + 1},
        ValueError,
        f"too many pages for the kernel's grid (got max_pages={MAX_PAGES_PER_REQUEST + 1}",
    ),
    ({"first_row": -1}, ValueError, "first_row must be >= 0"),
    ({"first_row": 3}, ValueError, "too few rows (got 6, expected >= first_row + num_reqs = 7)"),
    ({"block_table": torch.zeros(4, 6, dtype=torch.int32)}, ValueError, "too few rows"),
    ({"num_pages": 13}, ValueError, "do not fit out (got num_pages=13"),
    ({"out": _sentinels(8)}, ValueError, "for 8 entries"),
    ({"num_pages": -1}, ValueError, "do not fit out"),
    ({"max_pages": -1}, ValueError, "max_pages=-1"),
    ({"max_pages": 7}, ValueError, "block_table too narrow for the longest request (got 6"),
    ({"impl": "cuda"}, ValueError, "unknown impl (got 'cuda'"),
    ({"impl": "Torch"}, ValueError, "unknown impl"),
]


@pytest.mark.parametrize(("changes", "error", "match"), REJECTED, ids=[r[2] for r in REJECTED])
def test_rejected_inputs(changes: dict[str, Any], error: type, match: str) -> None:
    args = {**_valid_args(), **changes}
    out = args["out"]
    # A copy for the cases that reuse one `out` across runs (the list is built once).
    before = out.clone() if isinstance(out, torch.Tensor) else list(out)
    with pytest.raises(error, match=r"^gather_pages: .*" + re.escape(match)):
        _call(args)
    if isinstance(out, torch.Tensor) and out.device.type == "cpu":
        assert torch.equal(out, before) and bool((out == SENTINEL).all())


def test_triton_without_triton_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(impl_choice, "triton", None)
    args = {**_valid_args(), "impl": "triton"}
    out = args["out"]
    with pytest.raises(RuntimeError, match=r"^gather_pages: impl='triton' needs triton"):
        _call(args)
    assert out.tolist() == [SENTINEL] * 12


# --- on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cases_on_cuda(case: Case, impl: str) -> None:
    if impl == "triton":
        pytest.importorskip("triton")
    check_case(case, "cuda", impl)


def decode_batch(num_reqs: int = 256, block_size: int = 16) -> Case:
    """Decode-like: 1024..3071 keys per request, so 64..192 pages, the longest over the kernel's
    128-column tile; the table padded past the longest request and column-sliced."""
    gen = torch.Generator().manual_seed(7)
    seq_lens = torch.randint(1024, 3072, (num_reqs,), generator=gen).tolist()
    lens = tuple(-(-seq_len // block_size) for seq_len in seq_lens)
    assert max(lens) > module._TILE_COLS
    return Case(lens, max(lens) + 5, first_row=3, out_extra=17, layout="column_slice")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_decode_batch_on_cuda(impl: str) -> None:
    if impl == "triton":
        pytest.importorskip("triton")
    check_case(decode_batch(), "cuda", impl)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_no_sync_on_cuda(impl: str) -> None:
    """The launcher reads no tensor value: on the decode batch, under sync-debug "error", the
    call raises nothing (and "auto" launches the kernel when triton is importable)."""
    case = decode_batch()
    num_reqs = len(case.lens)
    table = make_table(case.first_row + num_reqs + case.spare_rows, case.width, case.layout, "cuda")
    indptr = make_indptr(case.lens, case.indptr_dtype, False, "cuda")
    num_pages = sum(case.lens)
    out = torch.full((num_pages + case.out_extra,), SENTINEL, dtype=torch.int32, device="cuda")
    want = expected_out(table.cpu().tolist(), case.lens, case.first_row, out.shape[0])
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with kernel_launches() as grids:
        torch.cuda.set_sync_debug_mode("error")
        try:
            gather_pages(
                table, indptr, out, num_pages=num_pages, max_pages=max(case.lens),
                first_row=case.first_row, impl=impl,
            )  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    assert len(grids) == (1 if impl == "auto" and module.triton is not None else 0)
    assert out.cpu().tolist() == want


if __name__ == "__main__":
    # Run by test_kernel_under_interpreter with TRITON_INTERPRET=1.
    exit_with_report(run_cases("cpu", "triton"), len(CASES))
