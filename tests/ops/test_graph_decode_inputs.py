"""copy_graph_decode_inputs against a plain-Python specification, exactly: the PyTorch path on
the CPU (a fixed case list and random ones), the Triton kernel under `TRITON_INTERPRET=1` (this
file run as a script in a subprocess) and, marked `gpu`, on CUDA (the cases, then a 256-request
decode batch through `GraphDecodeInputsLaunch`, no host-device sync). Also every
rejected input, each leaving the outputs as they were.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from case_runner import exit_with_report, failures_of
from hypothesis import given, settings
from hypothesis import strategies as st

from anyattn.ops.graph_decode_inputs import (
    GraphDecodeInputsLaunch,
    copy_graph_decode_inputs,
    copy_graph_decode_inputs_ref,
)

SENTINEL = -7  # what the outputs hold before a call: entries the op must not write keep it
INTERPRETED_RANDOM = 10


@dataclasses.dataclass(frozen=True)
class Case:
    """A step of `num_reqs` requests copied into buffers of `padded` rows: `num_cols` columns
    of a `cols`-wide step table into an `out_cols`-wide one."""

    num_reqs: int
    padded: int
    num_cols: int
    cols: int
    out_cols: int
    pad_len: int = 1
    extra_rows: int = 0  # step rows past num_reqs (a runner's larger buffer)
    is_strided: bool = False  # a column-sliced step table and strided seq_lens
    # "column-major": a transposed step table; "expanded": one row repeated (stride 0) and one
    # length for all; "graph": FLASH_ATTN's buffers, a table of more rows than the lengths (of
    # `padded`) in a wider allocation
    layout: str = "plain"


def case_id(case: Case) -> str:
    return (
        f"n{case.num_reqs}-pad{case.padded}-cols{case.num_cols}of{case.cols}to{case.out_cols}"
        f"-len{case.pad_len}{'-strided' if case.is_strided else ''}-{case.layout}"
    )


CASES = [
    Case(3, 5, 4, 4, 6),
    Case(3, 3, 2, 5, 5, pad_len=0),
    Case(1, 4, 1, 1, 1, pad_len=0, extra_rows=2),
    Case(0, 3, 0, 2, 2),
    Case(4, 4, 300, 310, 320, is_strided=True),  # two column tiles
    Case(2, 6, 600, 600, 700, pad_len=0, extra_rows=1, is_strided=True),  # three tiles
    Case(5, 5, 0, 3, 3),
    Case(3, 4, 3, 5, 6, layout="column-major"),
    Case(4, 6, 200, 300, 300, pad_len=0, layout="column-major"),
    Case(3, 5, 4, 4, 4, layout="expanded"),
    Case(2, 3, 3, 5, 8, pad_len=0, layout="graph"),
]
# (rows of a "graph" case's table past its lengths: never written)
GRAPH_EXTRA_ROWS = 2


def spec(table: list[list[int]], lens: list[int], case: Case) -> tuple[list[list[int]], list[int]]:
    """The specification over plain lists: the graph buffers after the call."""
    rows = case.padded + (GRAPH_EXTRA_ROWS if case.layout == "graph" else 0)
    out = [[SENTINEL] * case.out_cols for _ in range(rows)]
    for row in range(case.num_reqs):
        for col in range(case.num_cols):
            out[row][col] = table[row][col]
    out_lens = [lens[r] if r < case.num_reqs else case.pad_len for r in range(case.padded)]
    return out, out_lens


@dataclasses.dataclass
class Inputs:
    table: torch.Tensor
    seq_lens: torch.Tensor
    table_out: torch.Tensor
    lens_out: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.table, self.seq_lens, self.table_out, self.lens_out


def make_inputs(case: Case, device: str, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    rows = case.num_reqs + case.extra_rows
    table = torch.randint(1, 10_000, (rows, case.cols + 3), generator=gen, dtype=torch.int32)
    table = table[:, 1 : 1 + case.cols] if case.is_strided else table[:, : case.cols].clone()
    seq_lens = torch.randint(1, 5000, (2 * rows,), generator=gen, dtype=torch.int32)
    seq_lens = seq_lens[::2] if case.is_strided else seq_lens[:rows].clone()
    out_rows = case.padded + (GRAPH_EXTRA_ROWS if case.layout == "graph" else 0)
    table_out = torch.full((out_rows, case.out_cols + 2), SENTINEL, dtype=torch.int32)
    table_out = table_out[:, : case.out_cols]  # (rows of a wider allocation)
    lens_out = torch.full((case.padded,), SENTINEL, dtype=torch.int32)
    tensors = [x.to(device) for x in (table, seq_lens, table_out, lens_out)]
    if case.layout == "column-major":
        tensors[0] = tensors[0].t().contiguous().t()
    elif case.layout == "expanded":
        tensors[0] = tensors[0][:1].expand(rows, -1)
        tensors[1] = tensors[1][:1].expand(rows)
    return Inputs(*tensors)


def check_case(case: Case, device: str, impl: str, seed: int = 0) -> None:
    x = make_inputs(case, device, seed)
    want = spec(x.table.tolist(), x.seq_lens.tolist(), case)
    copy_graph_decode_inputs(
        *x.args(), num_reqs=case.num_reqs, num_cols=case.num_cols, pad_len=case.pad_len,
        impl=impl,
    )  # fmt: skip
    assert (x.table_out.tolist(), x.lens_out.tolist()) == want, case


def seeded_cases(count: int) -> list[Case]:
    gen = torch.Generator().manual_seed(1)
    cases = []
    for _ in range(count):
        n, extra, cols = (int(v) for v in torch.randint(0, 6, (3,), generator=gen))
        num_cols = int(torch.randint(0, cols + 1, (), generator=gen))
        cases.append(Case(n, n + extra, num_cols, cols, cols + 1, pad_len=extra % 2,
                          is_strided=bool(extra % 2)))  # fmt: skip
    return cases


def run_cases(device: str, impl: str, cases: list[Case] = CASES) -> list[str]:
    """Run every case, return the ids (and errors) of those that failed."""
    return failures_of(cases, lambda case: check_case(case, device, impl), case_id)


# --- on the CPU -------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "auto"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_path_matches_the_specification(case: Case, impl: str) -> None:
    check_case(case, "cpu", impl)


def test_kernel_under_interpreter(triton_interpreter: Any) -> None:
    stdout = triton_interpreter(__file__)
    assert f"ran {len(CASES) + INTERPRETED_RANDOM} cases, 0 failed" in stdout, stdout


@st.composite
def random_cases(draw: st.DrawFn) -> Case:
    num_reqs = draw(st.integers(0, 6))
    cols = draw(st.integers(0, 5))
    return Case(
        num_reqs,
        num_reqs + draw(st.integers(0, 3)),
        draw(st.integers(0, cols)),
        cols,
        cols + draw(st.integers(0, 2)),
        pad_len=draw(st.integers(0, 2)),
        extra_rows=draw(st.integers(0, 2)),
        is_strided=draw(st.booleans()),
    )


@settings(max_examples=100, deadline=None)
@given(case=random_cases())
def test_random_cases_torch_path(case: Case) -> None:
    check_case(case, "cpu", "torch")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_is_the_specification(case: Case) -> None:
    x = make_inputs(case, "cpu")
    want = spec(x.table.tolist(), x.seq_lens.tolist(), case)
    got = copy_graph_decode_inputs_ref(
        *x.args(), num_reqs=case.num_reqs, num_cols=case.num_cols, pad_len=case.pad_len
    )
    assert got == want
    assert x.lens_out.tolist() == [SENTINEL] * case.padded  # the reference writes nothing


def test_launcher_is_the_op_on_the_cpu() -> None:
    launcher = GraphDecodeInputsLaunch(torch.device("cpu"), "Builder.build")
    for case in CASES:
        x = make_inputs(case, "cpu")
        want = spec(x.table.tolist(), x.seq_lens.tolist(), case)
        launcher(*x.args(), case.num_reqs, case.num_cols, case.pad_len)
        assert (x.table_out.tolist(), x.lens_out.tolist()) == want


def test_launcher_checks_the_steps_tensors_before_writing() -> None:
    """What a raw-address launch reads of the step is checked, each failure named: both
    tensors int32 of their rank on the builder's device, with a row per request and the
    table the columns copied."""
    launcher = GraphDecodeInputsLaunch(torch.device("cpu"), "Builder.build")
    x = make_inputs(GOOD, "cpu")
    bad = [
        (x.table, x.seq_lens.long(), "seq_lens must be an int32 tensor of rank 1"),
        (x.table, x.seq_lens[None], "seq_lens must be an int32 tensor of rank 1"),
        (x.table.long(), x.seq_lens, "block_table_tensor must be an int32 tensor of rank 2"),
        (x.table[0], x.seq_lens, "block_table_tensor must be an int32 tensor of rank 2"),
        (x.table, x.seq_lens[:2], r"too small .* 3 requests and 2 table columns"),
        (x.table[:2], x.seq_lens, "too small"),
        (x.table[:, :1], x.seq_lens, r"block_table_tensor of shape \(3, 1\)"),
    ]
    for table, seq_lens, match in bad:
        with pytest.raises(ValueError, match=f"Builder\\.build: .*{match}"):
            launcher(table, seq_lens, x.table_out, x.lens_out, 3, 2, 1)
    # (a builder of another device: the CPU tensors are not on it)
    elsewhere = GraphDecodeInputsLaunch(torch.device("cuda", 0), "Builder.build")
    with pytest.raises(ValueError, match="on cpu, expected cuda:0"):
        elsewhere(x.table, x.seq_lens, x.table_out, x.lens_out, 3, 2, 1)
    assert x.table_out.tolist() == [[SENTINEL] * 3] * 4
    assert x.lens_out.tolist() == [SENTINEL] * 4


def test_a_launcher_for_cuda_is_made_without_touching_cuda(monkeypatch) -> None:
    """A builder is made before any step (on a machine whose CUDA may not be up yet): a
    launcher for "cuda" resolves the current device at its first call, not when made."""

    def fail() -> int:
        raise AssertionError("CUDA touched")

    monkeypatch.setattr(torch.cuda, "current_device", fail)
    launcher = GraphDecodeInputsLaunch(torch.device("cuda"), "Builder.build")
    assert launcher.device == torch.device("cuda")


GOOD = Case(3, 4, 2, 3, 3)
REJECTED = [
    ({"table": [[1]]}, TypeError, "block_table must be a torch.Tensor"),
    ({"seq_lens": "int64"}, TypeError, "seq_lens must be int32"),
    ({"table_out": "int64"}, TypeError, "table_out must be int32"),
    ({"table": "1-D"}, TypeError, "block_table and table_out must be"),
    ({"table_out": "column-major"}, TypeError, "table_out's rows must be contiguous"),
    ({"lens_out": "strided"}, TypeError, "lens_out contiguous"),
    ({"seq_lens": "2-D"}, TypeError, "seq_lens must be 1-D"),
    ({"num_reqs": 2.0}, TypeError, "num_reqs must be an int"),
    ({"pad_len": True}, TypeError, "pad_len must be an int"),
    ({"pad_len": -1}, ValueError, "must be >= 0"),
    ({"num_reqs": -1}, ValueError, "must be >= 0"),
    ({"num_cols": -2}, ValueError, "must be >= 0"),
    ({"lens_out": "short"}, ValueError, "too few rows for num_reqs=3"),
    ({"num_reqs": 0, "num_cols": 2**25}, ValueError, "too many columns for the kernel's grid"),
    ({"num_reqs": 5}, ValueError, "too few rows for num_reqs=5"),
    ({"num_cols": 4}, ValueError, "num_cols past a table's width"),
    ({"impl": "cuda"}, ValueError, "impl"),
]


def rejected_args(changes: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Inputs]:
    x = make_inputs(GOOD, "cpu")
    tensors = {"table": x.table, "seq_lens": x.seq_lens, "table_out": x.table_out,
               "lens_out": x.lens_out}  # fmt: skip
    remade = {
        "int64": lambda t: t.long(),
        "1-D": lambda t: t[0],
        "2-D": lambda t: t[None],
        "column-major": lambda t: t.t().contiguous().t(),
        "strided": lambda t: torch.full((2 * t.shape[0],), SENTINEL, dtype=t.dtype)[::2],
        "short": lambda t: t[:2],
    }
    for name in tensors:
        if name in changes:
            change = changes[name]
            tensors[name] = remade[change](tensors[name]) if isinstance(change, str) else change
    options = {"num_reqs": 3, "num_cols": 2, "pad_len": 1, "impl": "auto"}
    options.update({k: v for k, v in changes.items() if k in options})
    return tuple(tensors.values()), options, x


@pytest.mark.parametrize(("changes", "error", "match"), REJECTED, ids=[r[2] for r in REJECTED])
def test_rejected_inputs_leave_the_outputs_as_they_were(
    changes: dict[str, Any], error: type, match: str
) -> None:
    args, options, x = rejected_args(changes)
    with pytest.raises(error, match=match) as caught:
        copy_graph_decode_inputs(*args, **options)
    assert "copy_graph_decode_inputs" in str(caught.value)
    assert x.table_out.tolist() == [[SENTINEL] * 3] * 4
    assert x.lens_out.tolist() == [SENTINEL] * 4


def test_tensors_on_two_devices_are_rejected() -> None:
    x = make_inputs(GOOD, "cpu")
    with pytest.raises(ValueError, match="lens_out is on another device than block_table"):
        copy_graph_decode_inputs(
            x.table, x.seq_lens, x.table_out, x.lens_out.to("meta"), num_reqs=3, num_cols=2,
            pad_len=1,
        )  # fmt: skip
    assert x.table_out.tolist() == [[SENTINEL] * 3] * 4


# --- on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cases_on_cuda(impl: str) -> None:
    if impl == "triton":
        pytest.importorskip("triton")
    assert run_cases("cuda", impl, CASES + seeded_cases(INTERPRETED_RANDOM)) == []


@pytest.mark.gpu
def test_launcher_on_cuda_is_exact_and_never_waits() -> None:
    """`GraphDecodeInputsLaunch` on CUDA: a 256-request decode step in a 260-row graph, with
    fewer requests next, each exactly right and none waiting on the GPU."""
    pytest.importorskip("triton")
    launcher = GraphDecodeInputsLaunch(torch.device("cuda"), "Builder.build")
    first = Case(256, 260, 192, 256, 256, is_strided=True)
    x = make_inputs(first, "cuda")
    launcher(*x.args(), 256, 192, 1)  # compiles
    assert (x.table_out.tolist(), x.lens_out.tolist()) == spec(
        x.table.tolist(), x.seq_lens.tolist(), first
    )
    previous = torch.cuda.get_sync_debug_mode()
    for seed, case in enumerate([Case(200, 260, 130, 256, 256), Case(256, 260, 1, 256, 256)]):
        y = make_inputs(case, "cuda", seed + 1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launcher(*y.args(), case.num_reqs, case.num_cols, 0)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        case = dataclasses.replace(case, pad_len=0)
        assert (y.table_out.tolist(), y.lens_out.tolist()) == spec(
            y.table.tolist(), y.seq_lens.tolist(), case
        )


if __name__ == "__main__":
    # Run by test_kernel_under_interpreter with TRITON_INTERPRET=1.
    cases = CASES + seeded_cases(INTERPRETED_RANDOM)
    exit_with_report(run_cases("cpu", "triton", cases), len(cases))
