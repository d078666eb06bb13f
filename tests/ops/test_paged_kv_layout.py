"""paged_kv_layout against a plain-Python specification, exactly: the PyTorch path on the CPU
(a fixed case list and random batches), the Triton kernel under `TRITON_INTERPRET=1` (this
file run as a script in a subprocess) and, marked `gpu`, on CUDA (the cases, a 256-request
decode batch through the compiled-kernel launch, no host-device sync). Also every rejected
input, each leaving the outputs as they were.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
from case_runner import exit_with_report, failures_of
from hypothesis import given, settings
from hypothesis import strategies as st

from anyattn.ops import paged_kv_layout as module
from anyattn.ops.paged_kv_layout import (
    MAX_PAGES_PER_REQUEST,
    PagedKvLayoutLaunch,
    paged_kv_layout,
    paged_kv_layout_ref,
)

SENTINEL = -7  # what the outputs hold before a call: entries the op must not write keep it
INTERPRETED_RANDOM = 12  # seeded random batches the interpreter runs beside the fixed cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One batch: request i holds `seq_lens[i]` tokens, its pages in table row `first_row + i`;
    `padding` more requests without pages (a CUDA-graph batch)."""

    seq_lens: tuple[int, ...]
    block_size: int
    padding: int = 0
    first_row: int = 0
    extra_width: int = 1  # table columns past the longest request's pages
    indices_extra: int = 3  # entries of `indices` past num_reqs * max_pages, never written
    max_pages_extra: int = 0  # a looser host bound than the longest request's pages
    is_strided: bool = False  # a column-sliced table and strided seq_lens


def case_id(case: Case) -> str:
    lens = ",".join(map(str, case.seq_lens)) or "none"
    parts = [f"lens={lens}", f"bs{case.block_size}", f"pad{case.padding}", f"row{case.first_row}"]
    if case.max_pages_extra:
        parts.append(f"bound+{case.max_pages_extra}")
    if case.is_strided:
        parts.append("strided")
    return "-".join(parts)


def spec(table: list[list[int]], case: Case) -> tuple[list[int], list[int], list[int]]:
    """The specification over plain lists: (indptr, last_page_len, pages)."""
    indptr, last, pages = [0], [], []
    for i in range(len(case.seq_lens) + case.padding):
        seq = case.seq_lens[i] if i < len(case.seq_lens) else 0
        count = (seq + case.block_size - 1) // case.block_size
        pages += table[case.first_row + i][:count]
        indptr.append(indptr[-1] + count)
        last.append(seq - (count - 1) * case.block_size if count else 1)
    return indptr, last, pages


def max_pages_of(case: Case) -> int:
    most = max(((s + case.block_size - 1) // case.block_size for s in case.seq_lens), default=0)
    return most + case.max_pages_extra


@dataclasses.dataclass
class Inputs:
    table: torch.Tensor
    seq_lens: torch.Tensor
    indptr: torch.Tensor
    last_page_len: torch.Tensor
    indices: torch.Tensor
    max_pages: int


def make_inputs(case: Case, device: str) -> Inputs:
    """Distinct shuffled block ids (block 0, the null block, unused) in a table with a spare row
    past the batch, so a page read from the wrong row or column shows."""
    num_reqs = len(case.seq_lens)
    rows = case.first_row + num_reqs + case.padding + 1
    max_pages = max_pages_of(case)
    width = max_pages + case.extra_width
    gen = torch.Generator().manual_seed(rows * 100 + width)
    values = (torch.randperm(2 * rows * width + 8, generator=gen)[: rows * width] + 1).int()
    table = values.view(rows, width).to(device)
    seq = torch.zeros(case.first_row + num_reqs + 2, dtype=torch.int32)
    seq[case.first_row : case.first_row + num_reqs] = torch.tensor(case.seq_lens, dtype=torch.int32)
    seq[case.first_row + num_reqs :] = 10**6  # past the batch: never read
    seq = seq.to(device)
    if case.is_strided:
        wide = torch.zeros(rows, width + 3, dtype=torch.int32, device=device)
        wide[:, :width] = table
        table = wide[:, :width]
        spaced = torch.full((2 * seq.shape[0],), -1, dtype=torch.int32, device=device)
        spaced[::2] = seq
        seq = spaced[::2]
    padded = num_reqs + case.padding

    def sentinels(n: int) -> torch.Tensor:
        return torch.full((n,), SENTINEL, dtype=torch.int32, device=device)

    indices = sentinels(num_reqs * max_pages + case.indices_extra)
    return Inputs(table, seq, sentinels(padded + 1), sentinels(padded), indices, max_pages)


def check_case(case: Case, device: str, impl: str) -> None:
    """`impl` writes exactly the specified layout, the pages' tail of `indices` untouched; the
    reference agrees."""
    x = make_inputs(case, device)
    num_reqs = len(case.seq_lens)
    want_indptr, want_last, want_pages = spec(x.table.cpu().tolist(), case)
    ref = paged_kv_layout_ref(
        x.table.cpu(), x.seq_lens.cpu(), num_reqs + case.padding, block_size=case.block_size,
        num_reqs=num_reqs, first_row=case.first_row,
    )  # fmt: skip
    assert ref == (want_indptr, want_last, want_pages), "the reference disagrees with the spec"
    paged_kv_layout(
        x.table, x.seq_lens, x.indptr, x.last_page_len, x.indices, block_size=case.block_size,
        num_reqs=num_reqs, max_pages=x.max_pages, first_row=case.first_row, impl=impl,
    )  # fmt: skip
    assert x.indptr.tolist() == want_indptr
    assert x.last_page_len.tolist() == want_last
    tail = [SENTINEL] * (x.indices.shape[0] - len(want_pages))
    assert x.indices.tolist() == want_pages + tail


# Requests with no tokens, with a full last page, across column tiles (with the tile shrunk to
# 2 columns below), padding, a looser page bound, strided inputs.
CASES = [
    Case((40, 3, 0, 70, 17, 16), 16),
    Case((40, 3, 0, 70, 17, 16), 16, padding=3, first_row=2),
    Case((5, 9, 1, 12), 4, first_row=1, max_pages_extra=2, is_strided=True),
    Case((1,) * 9, 1, padding=1, indices_extra=0),
    Case((7,), 7, indices_extra=0),
    Case((0, 0, 0), 16, padding=2),
    Case((), 16, padding=4, first_row=1),
    Case((), 16),
    Case(tuple(range(1, 70, 7)), 2, first_row=3, is_strided=True),
]


def seeded_cases(count: int, seed: int = 0) -> list[Case]:
    """Random batches from a fixed seed (the interpreter runs these, beside `CASES`): up to 80
    requests, so that the kernel's request vector is 64 and 128 entries wide."""
    gen = torch.Generator().manual_seed(seed)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    cases = []
    for _ in range(count):
        lens = tuple(draw(0, 40) for _ in range(draw(0, 80)))
        cases.append(Case(lens, draw(1, 16), padding=draw(0, 3), first_row=draw(0, 2),
                          max_pages_extra=draw(0, 1), is_strided=bool(draw(0, 1))))  # fmt: skip
    return cases


def run_cases(device: str, impl: str, cases: list[Case] = CASES) -> list[str]:
    """Run every case with two-column tiles (several tiles per request), return the ids (and
    errors) of those that failed."""
    saved = module._TILE_COLS
    module._TILE_COLS = 2
    try:
        return failures_of(cases, lambda case: check_case(case, device, impl), case_id)
    finally:
        module._TILE_COLS = saved


# --- on the CPU -------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "auto"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_path_matches_the_specification(case: Case, impl: str) -> None:
    check_case(case, "cpu", impl)


def test_kernel_under_interpreter(triton_interpreter: Any) -> None:
    stdout = triton_interpreter(__file__)
    assert f"ran {len(CASES) + INTERPRETED_RANDOM + 1} cases, 0 failed" in stdout, stdout


@st.composite
def random_cases(draw: st.DrawFn) -> Case:
    return Case(
        tuple(draw(st.lists(st.integers(0, 50), max_size=8))),
        draw(st.sampled_from([1, 4, 16])),
        padding=draw(st.integers(0, 3)),
        first_row=draw(st.integers(0, 3)),
        extra_width=draw(st.integers(0, 2)),
        indices_extra=draw(st.integers(0, 3)),
        max_pages_extra=draw(st.integers(0, 2)),
        is_strided=draw(st.booleans()),
    )


@settings(max_examples=100, deadline=None)
@given(case=random_cases())
def test_random_batches_torch_path(case: Case) -> None:
    check_case(case, "cpu", "torch")


def check_bound_below_the_lengths(impl: str) -> None:
    """`max_pages` caps each request's pages: device lengths longer than the host mirrors said
    (an engine bug) cannot write past `num_reqs * max_pages` entries of `indices`, and the
    capped requests' last page is a full one (never more than `block_size` tokens, which the
    kernels would read past the page)."""
    case = Case((40, 70, 3), 16)
    x = make_inputs(case, "cpu")
    paged_kv_layout(
        x.table, x.seq_lens, x.indptr, x.last_page_len, x.indices[:6], block_size=16,
        num_reqs=3, max_pages=2, impl=impl,
    )  # fmt: skip
    ref = paged_kv_layout_ref(x.table, x.seq_lens, 3, block_size=16, num_reqs=3, max_pages=2)
    table = x.table.tolist()
    assert ref == ([0, 2, 4, 5], [16, 16, 3], table[0][:2] + table[1][:2] + table[2][:1])
    assert (x.indptr.tolist(), x.last_page_len.tolist()) == ref[:2]
    assert x.indices[:5].tolist() == ref[2]
    assert x.indices[6:].tolist() == [SENTINEL] * (x.indices.shape[0] - 6)


def test_a_bound_below_the_device_lengths_never_writes_past_it() -> None:
    check_bound_below_the_lengths("torch")


def test_trusted_calls_skip_the_checks_and_compute_the_same() -> None:
    """`is_trusted=True` (no checks, for a caller that made the outputs itself) writes what
    the checked call writes."""
    case = Case((40, 3, 70), 16, padding=1, first_row=1)
    checked, trusted = make_inputs(case, "cpu"), make_inputs(case, "cpu")
    for x, is_trusted in ((checked, False), (trusted, True)):
        paged_kv_layout(
            x.table, x.seq_lens, x.indptr, x.last_page_len, x.indices, block_size=16,
            num_reqs=3, max_pages=x.max_pages, first_row=1, is_trusted=is_trusted,
        )  # fmt: skip
    for name in ("indptr", "last_page_len", "indices"):
        assert getattr(trusted, name).tolist() == getattr(checked, name).tolist()


def _valid_args() -> dict[str, Any]:
    """Three requests (40, 3, 70 tokens, 16-token blocks: 3, 1, 5 pages) padded to four."""
    x = make_inputs(Case((40, 3, 70), 16, padding=1), "cpu")
    return {
        "block_table": x.table, "seq_lens": x.seq_lens, "indptr": x.indptr,
        "last_page_len": x.last_page_len, "indices": x.indices, "block_size": 16,
        "num_reqs": 3, "max_pages": 5,
    }  # fmt: skip


def _call(args: dict[str, Any]) -> None:
    names = ("block_table", "seq_lens", "indptr", "last_page_len", "indices")
    positional = [args.pop(name) for name in names]
    paged_kv_layout(*positional, **args)


def test_valid_args_are_accepted() -> None:
    args = _valid_args()
    indptr = args["indptr"]
    _call(args)
    assert indptr.tolist() == [0, 3, 4, 9, 9]


def _i32(*shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.full(shape, SENTINEL, dtype=torch.int32, device=device)


REJECTED = [
    ({"block_table": [[1, 2]]}, TypeError, "block_table must be a torch.Tensor"),
    ({"seq_lens": [40, 3, 70]}, TypeError, "seq_lens must be a torch.Tensor"),
    ({"indices": [0] * 20}, TypeError, "indices must be a torch.Tensor"),
    ({"block_table": torch.zeros(5, 6, dtype=torch.int64)}, TypeError, "block_table must be int32"),
    ({"seq_lens": torch.tensor([40, 3, 70])}, TypeError, "seq_lens must be int32 (got torch.int64"),
    ({"indptr": torch.zeros(5, dtype=torch.int64)}, TypeError, "indptr must be int32"),
    ({"block_table": torch.zeros(30, dtype=torch.int32)}, TypeError, "[rows, max_blocks]"),
    ({"seq_lens": torch.zeros(3, 1, dtype=torch.int32)}, TypeError, "seq_lens must be 1-D"),
    ({"indices": _i32(40)[::2]}, TypeError, "indices must be a contiguous 1-D tensor"),
    ({"last_page_len": _i32(4, 1)}, TypeError, "last_page_len must be a contiguous 1-D"),
    ({"indptr": _i32(5, device="meta")}, ValueError, "indptr is on another device"),
    ({"block_size": 16.0}, TypeError, "block_size must be an int (got float)"),
    ({"num_reqs": True}, TypeError, "num_reqs must be an int (got bool)"),
    ({"block_size": 0}, ValueError, "block_size must be >= 1"),
    ({"max_pages": -1}, ValueError, "max_pages=-1"),
    ({"first_row": -1}, ValueError, "first_row=-1"),
    ({"max_num_reqs": -1}, ValueError, "max_num_reqs=-1"),
    ({"max_num_reqs": 2.0}, TypeError, "max_num_reqs must be an int (got float)"),
    ({"num_reqs": 5}, ValueError, "with R >= num_reqs (got 5 and 4 for num_reqs=5)"),
    ({"last_page_len": _i32(3)}, ValueError, "(got 5 and 3 for num_reqs=3)"),
    ({"max_pages": MAX_PAGES_PER_REQUEST + 1}, ValueError, "too many pages for the kernel's grid"),
    ({"first_row": 3}, ValueError, "has too few rows (got 5 and 5, expected >= first_row"),
    ({"seq_lens": torch.tensor([40, 3], dtype=torch.int32)}, ValueError, "too few rows"),
    ({"max_pages": 7}, ValueError, "block_table too narrow for max_pages (got 6 columns"),
    ({"indices": _i32(14)}, ValueError, "indices too small for num_reqs * max_pages pages (got 14"),
    ({"impl": "cuda"}, ValueError, "unknown impl (got 'cuda'"),
]


@pytest.mark.parametrize(("changes", "error", "match"), REJECTED, ids=[r[2] for r in REJECTED])
def test_rejected_inputs(changes: dict[str, Any], error: type, match: str) -> None:
    args = {**_valid_args(), **changes}
    outputs = [args[name] for name in ("indptr", "last_page_len", "indices")]
    before = [x.clone() if isinstance(x, torch.Tensor) else list(x) for x in outputs]
    with pytest.raises(error, match=r"^paged_kv_layout: .*" + re.escape(match)):
        _call(args)
    for x, saved in zip(outputs, before, strict=True):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            assert torch.equal(x, saved)


# --- on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cases_on_cuda(impl: str) -> None:
    if impl == "triton":
        pytest.importorskip("triton")
    assert run_cases("cuda", impl) == []


def decode_batch(seed: int) -> Case:
    """256 decodes of 1024..3071 keys in 16-token blocks (64..192 pages, past the kernel's
    128-column tile), padded to 260 rows, in a column-sliced table."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = tuple(torch.randint(1024, 3072, (256,), generator=gen).tolist())
    return Case(seq_lens, 16, padding=4, first_row=1, is_strided=True)


@pytest.mark.gpu
def test_decode_batches_on_cuda_through_the_compiled_launch() -> None:
    """The first call compiles through Triton's JIT, the next ones launch the kept compiled
    kernel: each batch (other lengths, other tensors) is still exactly right, and no call
    waits on the GPU."""
    pytest.importorskip("triton")
    check_case(decode_batch(0), "cuda", "triton")
    assert module._launch._compiled, "the compiled kernel was not kept"
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    for seed in (1, 2):
        case = decode_batch(seed)
        x = make_inputs(case, "cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            paged_kv_layout(
                x.table, x.seq_lens, x.indptr, x.last_page_len, x.indices, block_size=16,
                num_reqs=256, max_pages=x.max_pages, first_row=1,
            )  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        want_indptr, want_last, want_pages = spec(x.table.cpu().tolist(), case)
        assert x.indptr.tolist() == want_indptr and x.last_page_len.tolist() == want_last
        assert x.indices[: len(want_pages)].tolist() == want_pages


def check_launcher_batch(
    launcher: PagedKvLayoutLaunch, case: Case, device: str, no_sync: bool = False
) -> None:
    """`launcher` (first_row 0) writes `case`'s specified layout, given the outputs' addresses
    or not; `no_sync`: the call runs under sync-debug mode "error" (a host wait raises)."""
    x = make_inputs(case, device)
    addresses = None
    if device == "cuda" and case.padding % 2:  # both ways of passing the outputs
        addresses = (x.indptr.data_ptr(), x.last_page_len.data_ptr(), x.indices.data_ptr())
    if no_sync:
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
    try:
        launcher(
            x.table, x.seq_lens, x.indptr, x.last_page_len, x.indices,
            num_reqs=len(case.seq_lens), max_pages=x.max_pages, addresses=addresses,
        )  # fmt: skip
    finally:
        if no_sync:
            torch.cuda.set_sync_debug_mode(previous)
    want_indptr, want_last, want_pages = spec(x.table.cpu().tolist(), case)
    assert x.indptr.tolist() == want_indptr and x.last_page_len.tolist() == want_last
    assert x.indices[: len(want_pages)].tolist() == want_pages
    untouched = x.indices[len(want_pages) :].tolist()
    assert untouched == [SENTINEL] * len(untouched)


LAUNCHER_CASES = [
    Case((5, 16, 17, 1), 16, padding=2),
    Case((300, 1, 129 * 16 + 3), 16, padding=1, is_strided=True),
    Case((7,), 4),
    Case((), 16, padding=3),
]


def test_launcher_is_the_op_on_the_cpu() -> None:
    for case in LAUNCHER_CASES:
        check_launcher_batch(PagedKvLayoutLaunch(case.block_size, 8), case, "cpu")


@pytest.mark.gpu
def test_launcher_takes_the_bound_kernel_on_cuda() -> None:
    """After its first call, `PagedKvLayoutLaunch` launches the bound compiled kernel with raw
    addresses: every batch exactly right, no call waiting on the GPU; a batch past its
    `max_num_reqs` takes the op itself."""
    pytest.importorskip("triton")
    launcher = PagedKvLayoutLaunch(16, 260)
    check_launcher_batch(launcher, dataclasses.replace(decode_batch(3), first_row=0), "cuda")
    assert launcher._bound is not None, "the compiled kernel was not bound"
    cases = [dataclasses.replace(decode_batch(s), first_row=0, padding=s) for s in (4, 5)]
    for case in cases + [c for c in LAUNCHER_CASES if c.block_size == 16]:
        check_launcher_batch(launcher, case, "cuda", no_sync=True)
    small = PagedKvLayoutLaunch(16, 2)
    for case in LAUNCHER_CASES[:2]:  # 6 and 4 rows: past max_num_reqs
        check_launcher_batch(small, case, "cuda")


if __name__ == "__main__":
    # Run by test_kernel_under_interpreter with TRITON_INTERPRET=1.
    cases = CASES + seeded_cases(INTERPRETED_RANDOM)
    failures = run_cases("cpu", "triton", cases)
    failures += failures_of(
        ["triton"], check_bound_below_the_lengths, lambda _: "bound below the lengths"
    )
    exit_with_report(failures, len(cases) + 1)
