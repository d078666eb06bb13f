"""`ops.gather_kv_rows` against the device's own copy of the same bytes.

FLEX_ATTENTION copies the keys and values its rows kernel reads out of the paged cache into
contiguous rows (`ops.gather_kv_rows`) every layer: a prefill step's copy is part of its wrapper
cost against FlexAttention called directly on keys already laid out (issue 6's 3% target). The
copy moves a fixed number of bytes (every key's K and V read once, written once), so its floor
is a contiguous device-to-device copy of that many bytes, timed in the same run: the ratio
printed is the op's time over that copy's.

Cases: the keys FLEX_ATTENTION copies in `benchmarks/kernels.py`'s wrapper cases (8 KV heads of
128, bf16, NHD, shuffled blocks of a pool 1.5x the need): the mixed step's two chunked prefills
(2 x 2048 keys; its decodes read the cache in place) and the 4 x 4096 prefill. Each timed call
reads one of several input sets in turn, together larger than the L2 cache. Before timing, the
op's rows are checked bit for bit against its PyTorch path on the same inputs (rows poisoned
with NaN first, so an unwritten row shows).

`--tile-elements` and `--num-warps` (comma lists) sweep the Triton kernel's launch settings
(module constants `_TILE_ELEMENTS`, `_NUM_WARPS`), one row per setting.

Run on the GPU machine: `PYTHONPATH=src python3 benchmarks/gather_kv_rows.py [--block-size 16]
[--reps 50]`. On the CPU (`--device cpu`) a tiny float32 case runs the PyTorch path, to check
that the script works.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from _timing import markdown_table, median_us, synchronize

from anyattn.ops import gather_kv_rows as op
from anyattn.testing import assign_blocks


@dataclass(frozen=True)
class Case:
    label: str
    key_lens: tuple[int, ...]
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: torch.dtype = torch.bfloat16


CASES = {
    "mixed": Case("mixed step's 2 chunked prefills, 2 x 2048 keys", (2048, 2048)),
    "prefill": Case("prefill 4 x 4096 keys", (4096,) * 4),
}
TINY = {"tiny": Case("tiny", (40, 7, 33), num_kv_heads=2, head_size=16, dtype=torch.float32)}
# Input sets timed in turn: together past the H200's 60 MB L2 for the smallest case.
NUM_SLOTS = 4
FIRST_ROW = 128  # FLEX_ATTENTION's FIRST_KEY_ROW


@dataclass
class Inputs:
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    key_lens: torch.Tensor
    k_rows: torch.Tensor
    v_rows: torch.Tensor


def make_inputs(case: Case, block_size: int, device: torch.device, seed: int) -> Inputs:
    """One input set: a shuffled paged cache of random values and rows to copy into."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = assign_blocks(case.key_lens, block_size, generator=gen)
    shape = (num_blocks, 2, block_size, case.num_kv_heads, case.head_size)
    cache = torch.randn(shape, generator=gen).to(case.dtype)
    rows = FIRST_ROW + sum(case.key_lens)
    k_rows, v_rows = torch.empty(2, case.num_kv_heads, rows, case.head_size, dtype=case.dtype)
    return Inputs(
        cache.to(device),
        table.to(device),
        torch.tensor(case.key_lens, dtype=torch.int32, device=device),
        k_rows.to(device),
        v_rows.to(device),
    )


def gather(x: Inputs, case: Case, impl: str) -> None:
    op.gather_kv_rows(
        x.kv_cache, x.block_table, x.key_lens, x.k_rows, x.v_rows,
        num_keys=sum(case.key_lens), max_key_len=max(case.key_lens), first_row=FIRST_ROW,
        impl=impl,
    )  # fmt: skip


def check(x: Inputs, case: Case, impl: str) -> None:
    """The op's rows equal its PyTorch path's, bit for bit, every copied row written."""
    rows = slice(FIRST_ROW, FIRST_ROW + sum(case.key_lens))
    x.k_rows.fill_(float("nan"))
    x.v_rows.fill_(float("nan"))
    gather(x, case, "torch")
    expected = x.k_rows[:, rows].clone(), x.v_rows[:, rows].clone()
    x.k_rows.fill_(float("nan"))
    x.v_rows.fill_(float("nan"))
    gather(x, case, impl)
    for got, want in zip((x.k_rows[:, rows], x.v_rows[:, rows]), expected, strict=True):
        if not torch.equal(_bits(got), _bits(want)):  # (NaN != NaN: compare the bits)
            raise AssertionError(f"gather_kv_rows ({impl}) differs from its PyTorch path")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def time_case(
    case: Case,
    block_size: int,
    device: torch.device,
    reps: int,
    settings: Sequence[tuple[int, int]],
) -> list[list[str]]:
    """Rows: the yardstick copy, then the op at each `(tile_elements, num_warps)` setting."""
    sets = [make_inputs(case, block_size, device, seed) for seed in range(NUM_SLOTS)]
    num_bytes = 2 * 2 * sum(case.key_lens) * case.num_kv_heads * case.head_size
    num_bytes *= sets[0].k_rows.element_size()  # K and V, each read once and written once
    # The yardstick: the same bytes (K and V of every key) copied between contiguous tensors.
    sources = [torch.randn(num_bytes // 4 // 2, device=device) for _ in sets]
    targets = [torch.empty_like(s) for s in sources]

    def copy(slot: int) -> None:
        targets[slot].copy_(sources[slot])

    impl = "triton" if device.type == "cuda" else "torch"
    runs: list[tuple[str, Callable[[int], object]]] = [("contiguous copy (floor)", copy)]
    for tile_elements, num_warps in settings:
        name = f"gather_kv_rows ({impl})"
        if impl == "triton":
            name += f", tile {tile_elements} elements, {num_warps} warps"

        def run(slot: int, tile_elements=tile_elements, num_warps=num_warps) -> None:
            op._TILE_ELEMENTS, op._NUM_WARPS = tile_elements, num_warps
            gather(sets[slot], case, impl)

        runs.append((name, run))
    saved = op._TILE_ELEMENTS, op._NUM_WARPS
    try:
        for _, run in runs[1:]:
            run(0)  # sets the launch setting, compiles it
            check(sets[0], case, impl)
        synchronize(device)
        times = [(name, median_us(run, NUM_SLOTS, 3, reps, device)) for name, run in runs]
    finally:
        op._TILE_ELEMENTS, op._NUM_WARPS = saved
    floor = times[0][1]
    return [
        [name, f"{us:.1f}", f"{num_bytes / us / 1e3:.0f}", f"{us / floor:.2f}"]
        for name, us in times
    ]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="mixed,prefill")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--tile-elements", type=_ints, default=[op._TILE_ELEMENTS])
    parser.add_argument("--num-warps", type=_ints, default=[op._NUM_WARPS])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gather_kv_rows.py: no CUDA device; nothing to time (--device cpu to check it).")
        return 0
    cases = CASES if device.type == "cuda" else TINY
    names = args.cases.split(",") if device.type == "cuda" else list(TINY)
    settings = list(itertools.product(args.tile_elements, args.num_warps))
    if device.type != "cuda":
        settings = settings[:1]  # the PyTorch path has no launch settings
    headers = ["version", "us", "GB/s", "x floor"]
    for name in names:
        case = cases[name]
        print(f"### gather_kv_rows, {case.label} ({device.type}, {args.block_size}-token blocks)\n")
        print(markdown_table(headers, time_case(case, args.block_size, device, args.reps,
                                                settings)))  # fmt: skip
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
