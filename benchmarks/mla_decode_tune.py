"""Tile, key-load and split sweep of TRITON_MLA's decode kernel on a CUDA GPU, beside FlashInfer.

    python benchmarks/mla_decode_tune.py [--quick] [--device cuda] [--heads 16,128]
        [--shapes 8x32768,64x4096,256x2048] [--block-size 64] [--no-flashinfer]
        [--kv-loads gather,block,tma]

For each decode shape of `benchmarks/mla_decode.py` (bf16, latent 512 + 64, shuffled pages,
block 64) and head count, `anyattn.ops.mla_decode` runs with each `MLADecodeTiles` of a small
grid (today's default `mla_decode_tiles` first) and each of a few split counts around the
builder's `choose_num_splits` (half, same, double). Every (tiles, splits) pair is first checked
on two rows against the float64 reference (`check_decode`: a pair that fails or cannot launch is
reported, not timed); before that, each tiles is checked the same way on a batch whose checked
rows end in partial key tiles (`RAGGED`; one that fails is reported and left out). FlashInfer's
MLA kernel runs on the same pages when importable. The yardsticks (device copy rate, bf16
matmul rate) are measured in the same run.

Per shape a table: the tiles, the fastest of its split counts (programs = rows x programs per
row x splits) and its median µs, TB/s of latent bytes, TFLOP/s (`2 H (2L + R)` per key), the
share of the yardstick, the ratio to FlashInfer (> 1: faster), the compiled kernel's registers
/ spilled registers / shared memory and the resident programs per SM they allow, and the other
split counts' µs. For the best tiles at 8 x 32768 with 16 heads and at 64 x 4096 with 128 heads
(these two run first) a profile follows: device time per kernel (decode and split merge) from
`torch.profiler`, the compiled kernel's resources, the occupancy and waves they give, and the
achieved rates. Tables are printed as each case ends, so a run cut short keeps what it did.

Why this grid (registers and shared memory from compiling for sm_90 with Triton 3.6's ptxas):
at 16 heads the query tile is an `mma.sync` operand kept in registers, so 4 warps with 64-key
tiles spill (today's default: 255 registers and 352 bytes of stack) while 8 warps do not;
at 64+ heads `wgmma` reads the queries from shared memory. Triton's pipeliner splits
`num_stages - 1` over the two load levels (block table, then the cache rows it addresses):
`num_stages` 2 to 4 give the cache tile one shared-memory buffer (the next tile's copy starts
once the current tile has left shared memory), 5 two buffers, 7 three. With 8 warps and
64-head tiles the score `tl.dot` is laid out over all 8 warps along the heads, so both warp
groups compute the same scores; `latent_splits=2` with 4 warps (or 128-head tiles with 8)
avoids that inside a program, at the cost of computing the scores once per latent half.

`--device cpu --quick` runs one tiny float16 shape with `TRITON_INTERPRET=1`, for the test
that keeps this script working.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

import torch
from _timing import markdown_table, synchronize
from mla_decode import (
    FULL,
    TINY,
    Setting,
    Step,
    check_decode,
    decode_work,
    flashinfer_runner,
    measure,
)
from mla_decode import yardsticks as measure_yardsticks

from anyattn.backends.triton_mla_builder import choose_num_splits
from anyattn.ops.mla_decode import (
    MLADecodeTiles,
    mla_decode,
    mla_decode_tiles,
    mla_decode_workspace_shape,
)
from anyattn.ops.mla_decode_kernel import KV_BLOCK, KV_GATHER, KV_TMA, mla_decode_kernel

_T = MLADecodeTiles
GRID_FEW_HEADS = (  # 16 heads: memory-bound, mma.sync
    _T(16, 32, 8, 3),
    _T(16, 64, 8, 5),
    _T(16, 32, 8, 5, kv_load="block"),
    _T(16, 32, 8, 5, kv_load="tma"),
    _T(16, 32, 4, 5, kv_load="tma"),
    _T(16, 64, 8, 5, kv_load="tma"),
    _T(16, 32, 8, 7, kv_load="tma"),
)
GRID_MANY_HEADS = (  # 128 heads: compute-bound, wgmma
    _T(64, 32, 8, 5),
    _T(64, 32, 8, 3, kv_load="tma"),
    _T(64, 32, 8, 5, kv_load="tma"),
    _T(64, 64, 8, 2, kv_load="tma"),
    _T(64, 16, 8, 5, kv_load="tma"),
    _T(64, 32, 4, 3, latent_splits=2, kv_load="tma"),
    _T(128, 32, 8, 3, latent_splits=2, kv_load="tma"),
)
GRID_CPU = (  # interpreted: one of each variant, tiles that fit blocks of 16
    _T(16, 16, 4, 3, kv_load="block"),
    _T(16, 16, 4, 3, kv_load="tma"),
    _T(16, 16, 4, 1, latent_splits=2),
)
PROFILED = {(16, 8, 32768), (128, 64, 4096)}  # (heads, rows, context) whose best is profiled
# Contexts of the ragged check: the first two (the checked rows) end in a partial tile for
# every tile_n, which the timed contexts (multiples of 2048) never do. The longest keeps the
# block table 64 wide, so the check reuses the 4-split kernels the sweep compiles.
RAGGED = (1000, 97, 4096, 33)
RAGGED_CPU = (45, 23, 9, 70)
_KV_LOAD_IDS = {"gather": KV_GATHER, "block": KV_BLOCK, "tma": KV_TMA}


def label(tiles: MLADecodeTiles) -> str:
    halves = ", latent/2" if tiles.latent_splits == 2 else ""
    return (f"{tiles.block_h}h x {tiles.tile_n}k, {tiles.num_warps}w, {tiles.num_stages}s, "
            f"{tiles.kv_load}{halves}")  # fmt: skip


def triton_runner(step: Step, tiles: MLADecodeTiles | None, splits: int) -> Callable[[], object]:
    """`mla_decode` over the step's pages with these tiles and splits (buffers made once)."""
    rank, device = step.s.rank, step.device
    q_latent, q_pe = step.q[..., :rank], step.q[..., rank:]
    out = torch.empty_like(q_latent)
    table = step.table.to(device)
    lens = torch.tensor(step.seq_lens, dtype=torch.int32, device=device)
    workspace = None
    if splits > 1:
        shapes = mla_decode_workspace_shape(len(step.seq_lens), step.heads, rank, splits)
        workspace = tuple(torch.empty(s, device=device) for s in shapes)
    return lambda: mla_decode(q_latent, q_pe, step.kv_cache, out, table, lens, step.scale,
                              num_splits=splits, workspace=workspace, tiles=tiles)  # fmt: skip


def compiled_kernel(tiles: MLADecodeTiles, block_size: int, is_split: bool) -> object | None:
    """The compiled `mla_decode_kernel` for these tiles (with `.n_regs`, `.n_spills`,
    `.metadata.shared`), from Triton's JIT cache: `JITFunction.device_caches` is not a public
    API, so None when its shape differs (or nothing was compiled, as under the interpreter)."""
    want = {"BLOCK_H": tiles.block_h, "TILE_N": tiles.tile_n, "BLOCK_SIZE": block_size,
            "LATENT_SPLITS": tiles.latent_splits, "KV_LOAD": _KV_LOAD_IDS[tiles.kv_load],
            "IS_SPLIT_KV": is_split}  # fmt: skip
    names = mla_decode_kernel.arg_names
    try:
        for cache in mla_decode_kernel.device_caches.values():
            for kernel in cache[0].values():
                consts = {names[k[0]]: v for k, v in kernel.src.constants.items() if len(k) == 1}
                launch = (kernel.metadata.num_warps, kernel.metadata.num_stages)
                same = all(consts.get(n) == v for n, v in want.items())
                if same and launch == (tiles.num_warps, tiles.num_stages):
                    return kernel
    except (AttributeError, TypeError, IndexError, KeyError):
        return None
    return None


def resources(kernel: object | None, num_warps: int, device: torch.device) -> tuple[str, str]:
    """('registers / spilled registers / shared KiB', resident programs per SM) of a kernel."""
    if kernel is None or device.type != "cuda":
        return "n/a", "n/a"
    regs, spills, shared = kernel.n_regs, kernel.n_spills, kernel.metadata.shared
    props = torch.cuda.get_device_properties(device)
    sm_regs = getattr(props, "regs_per_multiprocessor", 65536)
    sm_smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    sm_warps = getattr(props, "max_threads_per_multi_processor", 2048) // 32
    per_warp = -(-regs * 32 // 256) * 256  # registers are granted per warp in units of 256
    fits = min(sm_regs // (per_warp * num_warps), sm_smem // (shared + 1024), sm_warps // num_warps)
    return f"{regs} / {spills} / {shared / 1024:.0f}", str(fits)


def ragged_check(
    setting: Setting, heads: int, block_size: int, grid: Sequence[MLADecodeTiles],
    device: torch.device,
) -> dict[MLADecodeTiles, str]:  # fmt: skip
    """Each tiles' verdict ('ok' or the error) on a batch of `RAGGED` contexts, 4 splits."""
    lens = list(RAGGED_CPU if device.type == "cpu" else RAGGED)
    step = Step(setting, heads, block_size, [1] * len(lens), lens, device)
    verdicts = {}
    for tiles in (mla_decode_tiles(heads, step.kv_cache, setting.rank), *grid):
        try:
            verdicts[tiles] = check_decode(step, triton_runner(step, tiles, 4)())
        except Exception as error:  # a config that cannot launch is reported, not fatal
            verdicts[tiles] = f"failed: {type(error).__name__}: {error}"[:140]
    return verdicts


def split_candidates(default: int) -> list[int]:
    return sorted({max(1, default // 2), default, min(64, default * 2)})


def sweep_shape(
    step: Step,
    grid: Sequence[MLADecodeTiles],
    flashinfer_us: float | None,
    rates: tuple[float, float],
    reps: int,
) -> tuple[list[list[object]], tuple[MLADecodeTiles, int, float] | None]:
    """The shape's table rows and its fastest (tiles, splits, µs)."""
    rows_n, heads, device = len(step.seq_lens), step.heads, step.device
    bytes_, flops = decode_work(step)
    memory_bound = heads <= 16
    default_tiles = mla_decode_tiles(heads, step.kv_cache, step.s.rank)
    table, best = [], None
    for tiles in (None, *grid):
        shown = tiles or default_tiles
        ppr = shown.programs_per_row(heads)
        policy = choose_num_splits(rows_n, ppr, max(step.seq_lens))
        times: dict[int, float] = {}
        verdict = "ok"
        for splits in [policy] if tiles is None else split_candidates(policy):
            try:
                run = triton_runner(step, tiles, splits)
                verdict = check_decode(step, run())
            except Exception as error:  # a config that cannot launch is reported, not fatal
                verdict = f"failed: {type(error).__name__}: {error}"[:140]
            if verdict != "ok":
                break
            times[splits] = measure(run, device, reps)
        name = f"default: {label(shown)}" if tiles is None else label(shown)
        if verdict != "ok":
            table.append([name, verdict, "", "", "", "", "", "", "", ""])
            continue
        splits, us = min(times.items(), key=lambda item: item[1])
        if best is None or us < best[2]:
            best = (shown, splits, us)
        res, fits = resources(compiled_kernel(shown, step.block_size, splits > 1),
                              shown.num_warps, device)  # fmt: skip
        share = (f"{100 * bytes_ / us / 1e6 / rates[0]:.0f}% copy" if memory_bound
                 else f"{100 * flops / us / 1e6 / rates[1]:.0f}% matmul")  # fmt: skip
        ratio = f"{flashinfer_us / us:.2f}" if flashinfer_us else ""
        others = ", ".join(f"{s}: {t:.1f}" for s, t in times.items() if s != splits)
        table.append([name, f"{splits} ({rows_n * ppr * splits})", f"{us:.1f}",
                      f"{bytes_ / us / 1e6:.3f}", f"{flops / us / 1e6:.1f}", share, ratio, res,
                      fits, others])  # fmt: skip
    return table, best


def profile(step: Step, tiles: MLADecodeTiles, splits: int, rates: tuple[float, float]) -> None:
    """Where the best configuration's time goes: device time per kernel, resources, waves."""
    device, heads, rows_n = step.device, step.heads, len(step.seq_lens)
    run = triton_runner(step, tiles, splits)
    print(f"\nProfile: decode {rows_n} x {max(step.seq_lens)}, H={heads}, {label(tiles)}, "
          f"{splits} splits")  # fmt: skip
    if device.type != "cuda":
        print("(kernel times, resources and occupancy need a CUDA device)")
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    calls = 20
    run()
    synchronize(device)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        synchronize(device)
    kernels = []
    for event in prof.key_averages():
        self_us = getattr(event, "self_device_time_total", 0) or 0
        if self_us > 0:
            kernels.append([event.key[:60], event.count // calls, f"{self_us / calls:.1f}"])
    total = sum(float(k[2]) for k in kernels) or float("nan")
    for k in kernels:
        k.append(f"{100 * float(k[2]) / total:.0f}%")
    print(markdown_table(["kernel", "launches per call", "device µs per call", "share"], kernels))
    kernel = compiled_kernel(tiles, step.block_size, splits > 1)
    res, fits = resources(kernel, tiles.num_warps, device)
    programs = rows_n * tiles.programs_per_row(heads) * splits
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    slots = sms * int(fits) if fits.isdigit() else 0
    waves = f"{programs / slots:.2f}" if slots else "n/a"
    decode_us = next((float(k[2]) for k in kernels if "mla_decode_kernel" in k[0]), total)
    bytes_, flops = decode_work(step)
    print(f"registers / spilled registers / shared KiB: {res}; programs {programs} on {sms} SMs "
          f"x {fits} "
          f"resident = {waves} waves; decode kernel alone: {bytes_ / decode_us / 1e6:.3f} TB/s "
          f"({100 * bytes_ / decode_us / 1e6 / rates[0]:.0f}% copy), "
          f"{flops / decode_us / 1e6:.1f} TFLOP/s ({100 * flops / decode_us / 1e6 / rates[1]:.0f}% "
          "matmul)")  # fmt: skip


def flashinfer_time(step: Step, reps: int) -> tuple[float | None, str]:
    try:
        run = flashinfer_runner(step)
        verdict = check_decode(step, run())
    except Exception as error:  # a peer that cannot run is reported, not fatal
        return None, f"failed: {type(error).__name__}: {error}"[:140]
    if verdict != "ok":
        return None, verdict
    us = measure(run, step.device, reps)
    return us, f"{us:.1f} µs"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions")
    parser.add_argument("--heads", default=None, help="comma-separated (default 16,128)")
    parser.add_argument("--shapes", default=None, help="rows x context, comma-separated")
    parser.add_argument("--block-size", type=int, default=None, help="default 64 (cpu: 16)")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer peer")
    loads_help = "grid tiles with these kv_load values (the default tiles always run)"
    parser.add_argument("--kv-loads", default="gather,block,tma", help=loads_help)
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # each table survives a run cut short
    device = torch.device(args.device)
    on_cpu = device.type == "cpu"
    setting = TINY if on_cpu else FULL
    reps = 3 if args.quick else 20
    heads = [int(h) for h in (args.heads or ("4" if on_cpu else "16,128")).split(",")]
    block_size = args.block_size or (16 if on_cpu else 64)
    if args.shapes:
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    else:
        shapes = list(setting.decode[:1] if on_cpu else setting.decode)
    use_flashinfer = not args.no_flashinfer
    if use_flashinfer:
        try:
            import flashinfer.mla  # noqa: F401
        except ImportError:
            print("FlashInfer: not importable, skipped")
            use_flashinfer = False
    start = time.perf_counter()
    rates = measure_yardsticks(device, reps)
    print(f"device copy rate {rates[0]:.3f} TB/s (read + written); matmul {rates[1]:.1f} "
          f"TFLOP/s ({'float32' if on_cpu else 'bf16'}); torch {torch.__version__}")  # fmt: skip
    headers = ["tiles", "best splits (programs)", "µs", "TB/s", "TFLOP/s", "of yardstick",
               "FlashInfer / this", "regs / spilled regs / smem KiB", "programs per SM",
               "other splits: µs"]  # fmt: skip
    # The profiled cases first, so that a run cut short still has them.
    cases = [(h, rows_n, length) for h in heads for rows_n, length in shapes]
    cases.sort(key=lambda case: case not in PROFILED)
    grids: dict[int, list[MLADecodeTiles]] = {}
    for h, rows_n, length in cases:
        if h not in grids:  # the ragged check of this head count's grid; failures are dropped
            grid = GRID_CPU if on_cpu else (GRID_FEW_HEADS if h <= 16 else GRID_MANY_HEADS)
            grid = [t for t in grid if t.kv_load in args.kv_loads.split(",")]
            verdicts = ragged_check(setting, h, block_size, grid, device)
            bad = {label(t): v for t, v in verdicts.items() if v != "ok"}
            print(f"\nragged check, H={h}, contexts {RAGGED_CPU if on_cpu else RAGGED}, 4 "
                  f"splits: {bad or 'every tiles ok'}")  # fmt: skip
            grids[h] = [t for t in grid if verdicts[t] == "ok"]
        grid = grids[h]
        step = Step(setting, h, block_size, [1] * rows_n, [length] * rows_n, device)
        peer_us, peer = flashinfer_time(step, reps) if use_flashinfer else (None, "skipped")
        table, best = sweep_shape(step, grid, peer_us, rates, reps)
        elapsed = time.perf_counter() - start
        print(f"\n### decode {rows_n} x {length}, H={h}, block {block_size} "
              f"({elapsed:.0f} s in); FlashInfer MLA: {peer}\n")  # fmt: skip
        print(markdown_table(headers, table))
        if best is not None:
            tiles, splits, us = best
            print(f"best: {label(tiles)}, {splits} splits, {us:.1f} µs")
            if (h, rows_n, length) in PROFILED or on_cpu:
                profile(step, tiles, splits, rates)
        del step
        if not on_cpu:
            torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
