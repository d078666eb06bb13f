"""`mla_decode` (the absorbed MLA decode kernel) against its float64 reference.

Triton decides whether a kernel is interpreted when it is defined, so the CPU cases run in one
subprocess with `TRITON_INTERPRET=1` set before anything is imported: this file run as a
script. The interpreter computes bf16 wrongly (docs/semantics.md, "Tolerance"): float32 and
float16 there, bf16 in the `gpu` tests. Shapes are tiny (4 heads, latent 32+16 / 48+16 /
64+16, blocks of 16 over shuffled pools) with contexts spanning several blocks and split-KV
forced.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from case_runner import exit_with_report, failures_of

from anyattn.ops.mla_decode import (
    MLADecodeTiles,
    mla_decode,
    mla_decode_ref,
    mla_decode_tiles,
    mla_decode_workspace_shape,
    tma_unsupported_reason,
)
from anyattn.testing import assign_blocks, error_bound, max_abs_error

FP8_SCALE = 0.375


def make_decode(
    seq_lens: list[int], rank: int, rope: int, num_heads: int, dtype: torch.dtype,
    cache_dtype: torch.dtype, block_size: int = 16, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Queries and a latent cache over shuffled blocks (block 0 the null block, never used)."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = assign_blocks(seq_lens, block_size, generator=gen)
    rows = torch.randn(num_blocks, block_size, rank + rope, generator=gen)
    if cache_dtype.itemsize == 1:
        # Values the fp8 format holds, stored as value / scale: reading back is exact.
        rows = rows.to(cache_dtype).float()
        cache = (rows / FP8_SCALE).to(cache_dtype)
    else:
        cache = rows.to(cache_dtype)
    num_rows = len(seq_lens)
    return {
        "q_latent": torch.randn(num_rows, num_heads, rank, generator=gen).to(dtype),
        "q_pe": torch.randn(num_rows, num_heads, rope, generator=gen).to(dtype),
        "kv_cache": cache,
        "block_table": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "scale": 1.25 / math.sqrt(rank + rope),
        "k_scale": torch.tensor(FP8_SCALE) if cache_dtype.itemsize == 1 else None,
    }


def on(x: Any, device: str) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def check_against_reference(
    device: str, dtype: torch.dtype, rank: int, rope: int, splits: int,
    num_heads: int = 4, cache_dtype: torch.dtype | None = None,
    tiles: MLADecodeTiles | None = None, block_size: int = 16,
) -> None:  # fmt: skip
    """Output and LSE within the tolerance rule of the float64 reference (the 16-bit run of
    the same reference sets the bound); zero-length rows give zeros and -inf."""
    seq_lens = [1, 40, 97, 0, 16]
    case = make_decode(seq_lens, rank, rope, num_heads, dtype, cache_dtype or dtype,
                       block_size=block_size)  # fmt: skip
    args = {k: on(v, device) for k, v in case.items()}
    num_rows = len(seq_lens)
    output = torch.full((num_rows, num_heads, rank), math.nan, dtype=dtype, device=device)
    lse = torch.full((num_heads, num_rows + 2), 7.0, device=device)
    workspace = None
    if splits > 1:
        out_shape, lse_shape = mla_decode_workspace_shape(num_rows, num_heads, rank, splits)
        workspace = (torch.empty(out_shape, device=device), torch.empty(lse_shape, device=device))
    mla_decode(
        args["q_latent"], args["q_pe"], args["kv_cache"], output, args["block_table"],
        args["seq_lens"], args["scale"], k_scale=args["k_scale"], output_lse=lse,
        num_splits=splits, workspace=workspace, tiles=tiles,
    )  # fmt: skip
    ref_args = (case["q_latent"], case["q_pe"], case["kv_cache"], case["block_table"],
                case["seq_lens"], case["scale"])  # fmt: skip
    ref64, lse64 = mla_decode_ref(*ref_args, k_scale=case["k_scale"], compute_dtype=torch.float64)
    lowp, _ = mla_decode_ref(*ref_args, k_scale=case["k_scale"], compute_dtype=dtype)
    err = max_abs_error(output.cpu(), ref64)
    bound = error_bound(ref64, lowp, dtype)
    assert err <= bound, f"output error {err:.3g} > bound {bound:.3g}"
    assert max_abs_error(lse[:, :num_rows].cpu(), lse64) <= 1e-4, "lse"
    assert (lse[:, num_rows:] == 7.0).all(), "lse columns past the rows were written"
    assert (output[3] == 0).all() and (lse[:, 3] == -math.inf).all(), "empty row"


def check_splits_agree(device: str, dtype: torch.dtype) -> None:
    """Splits 1, 2 and 5 of one batch agree with each other (5 leaves some splits empty)."""
    case = make_decode([3, 70, 33], 32, 16, 4, dtype, dtype)
    args = {k: on(v, device) for k, v in case.items()}
    results = []
    for splits in (1, 2, 5):
        out_shape, lse_shape = mla_decode_workspace_shape(3, 4, 32, splits)
        workspace = (torch.empty(out_shape, device=device), torch.empty(lse_shape, device=device))
        out = torch.empty_like(args["q_latent"])
        mla_decode(
            args["q_latent"], args["q_pe"], args["kv_cache"], out, args["block_table"],
            args["seq_lens"], args["scale"], num_splits=splits,
            workspace=workspace if splits > 1 else None,
        )  # fmt: skip
        results.append(out.float())
    # Each split count rounds its probabilities to the model dtype over other key ranges, so
    # outputs agree to that dtype's rounding step (bf16: 2^-8 relative), exactly in fp32.
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-5)
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=tol, rtol=tol)


def check_strided_inputs_untouched(device: str, dtype: torch.dtype) -> None:
    """Queries that are views of wider tensors and an output inside a wider buffer: the
    result equals the contiguous run, the caller's inputs are unchanged and the output's
    neighbours are untouched."""
    case = make_decode([5, 33], 32, 16, 4, dtype, dtype)
    args = {k: on(v, device) for k, v in case.items()}
    wide_q = torch.cat([args["q_latent"], args["q_pe"]], dim=-1)  # [2, 4, 48]
    before = wide_q.clone()
    wide_out = torch.full((2, 4, 64), 3.0, dtype=dtype, device=device)
    mla_decode(wide_q[..., :32], wide_q[..., 32:], args["kv_cache"], wide_out[..., 16:48],
               args["block_table"], args["seq_lens"], args["scale"])  # fmt: skip
    plain = torch.empty_like(args["q_latent"])
    mla_decode(args["q_latent"], args["q_pe"], args["kv_cache"], plain, args["block_table"],
               args["seq_lens"], args["scale"])  # fmt: skip
    assert torch.equal(wide_out[..., 16:48], plain), "strided result differs"
    assert (wide_out[..., :16] == 3).all() and (wide_out[..., 48:] == 3).all(), "neighbours"
    assert torch.equal(wide_q, before), "inputs modified"


def cases(device: str) -> list[tuple[Callable[..., None], tuple[Any, ...]]]:
    dtypes = (torch.float32, torch.float16) if device == "cpu" else (torch.bfloat16, torch.float16)
    found: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
    for dtype, (rank, rope), splits in itertools.product(
        dtypes, ((32, 16), (48, 16), (64, 16)), (1, 3)
    ):
        found.append((check_against_reference, (device, dtype, rank, rope, splits)))
    for dtype in dtypes:
        # 20 heads in 16-head tiles (two programs per row, the second partly masked), block 5.
        found.append((check_against_reference, (device, dtype, 32, 16, 2, 20, None,
                                                MLADecodeTiles(16, 16, 4, 1), 5)))  # fmt: skip
        # The tile variants: one block-table entry per tile (tiles of 16 in blocks of 32, so
        # rows 40 and 97 end in partial tiles, 16 in a full one), TMA descriptors (rank 48:
        # the padded columns come from past the descriptor's edge), latent halves (rank 48:
        # the second half partly masked; 20 heads, block 5, gathered), both over fp8.
        for kv_load, splits in itertools.product(("block", "tma"), (1, 3)):
            tiles = MLADecodeTiles(16, 16, 4, 3, kv_load=kv_load)
            found.append((check_against_reference, (device, dtype, 48, 16, splits, 4, None,
                                                    tiles, 32)))  # fmt: skip
        halves = MLADecodeTiles(16, 16, 4, 1, latent_splits=2)
        found.append((check_against_reference, (device, dtype, 48, 16, 2, 20, None, halves, 5)))
        tma_halves = MLADecodeTiles(16, 16, 4, 3, latent_splits=2, kv_load="tma")
        found.append((check_against_reference, (device, dtype, 64, 16, 1, 4,
                                                torch.float8_e4m3fn, tma_halves)))  # fmt: skip
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            found.append((check_against_reference, (device, dtype, 32, 16, 2, 4, fp8)))
        found.append((check_splits_agree, (device, dtype)))
        found.append((check_strided_inputs_untouched, (device, dtype)))
    return found


def case_id(case: tuple[Callable[..., None], tuple[Any, ...]]) -> str:
    check, args = case
    return "-".join([check.__name__.removeprefix("check_"), *map(_short, args[1:])])


def _short(arg: object) -> str:
    if isinstance(arg, MLADecodeTiles):
        return f"tiles{arg.block_h}x{arg.tile_n}/{arg.latent_splits}/{arg.kv_load}"
    return str(arg)


@pytest.mark.slow  # about 12 s of interpreted kernels
def test_kernel_under_interpreter(triton_interpreter: Callable[..., str]) -> None:
    stdout = triton_interpreter(__file__)
    assert "ran" in stdout and " 0 failed" in stdout, stdout


def test_bad_arguments_are_refused_before_anything_is_written() -> None:
    case = make_decode([5, 9], 32, 16, 4, torch.float16, torch.float16)
    q, q_pe, cache = case["q_latent"], case["q_pe"], case["kv_cache"]
    table, lens = case["block_table"], case["seq_lens"]
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match=r"kv_cache must be a latent cache \[num_blocks, "):
        mla_decode(q, q_pe, cache[..., :40], out, table, lens, 0.1)
    with pytest.raises(ValueError, match="block_table must be int32"):
        mla_decode(q, q_pe, cache, out, table.long(), lens, 0.1)
    with pytest.raises(ValueError, match="q_pe must be"):
        mla_decode(q, q_pe.float(), cache, out, table, lens, 0.1)
    with pytest.raises(ValueError, match="needs a float32 workspace"):
        mla_decode(q, q_pe, cache, out, table, lens, 0.1, num_splits=2)
    with pytest.raises(ValueError, match="an fp8 kv_cache needs k_scale"):
        mla_decode(q, q_pe, cache.to(torch.float8_e4m3fn), out, table, lens, 0.1)
    with pytest.raises(ValueError, match=r"output_lse must be float32 \[4, >= 2\]"):
        mla_decode(q, q_pe, cache, out, table, lens, 0.1, output_lse=torch.zeros(4, 1))
    with pytest.raises(ValueError, match="kv_lora_rank not supported"):
        wide = torch.zeros(2, 4, 528, dtype=torch.float16)
        mla_decode(wide, q_pe, torch.zeros(3, 16, 544, dtype=torch.float16), wide, table, lens, 1)
    with pytest.raises(TypeError, match=r"seq_lens must be a torch\.Tensor"):
        mla_decode(q, q_pe, cache, out, table, [5, 9], 0.1)
    assert not out.any()


def test_tiles_and_their_conditions_are_checked_before_the_launch() -> None:
    with pytest.raises(ValueError, match=r"tile_n must be a power of two >= 16 \(got 24\)"):
        MLADecodeTiles(16, 24, 4, 2)
    with pytest.raises(ValueError, match=r"latent_splits must be 1 or 2 \(got 4\)"):
        MLADecodeTiles(16, 16, 4, 2, latent_splits=4)
    with pytest.raises(ValueError, match=r"kv_load must be one of \['block', 'gather', 'tma'\]"):
        MLADecodeTiles(16, 16, 4, 2, kv_load="ldg")
    assert MLADecodeTiles(64, 32, 8, 2, latent_splits=2).programs_per_row(128) == 4
    case = make_decode([5, 9], 32, 16, 4, torch.float16, torch.float16)
    q, q_pe, cache = case["q_latent"], case["q_pe"], case["kv_cache"]
    table, lens = case["block_table"], case["seq_lens"]
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match="kv_load='block' needs tile_n to divide the block size"):
        mla_decode(q, q_pe, cache, out, table, lens, 0.1,
                   tiles=MLADecodeTiles(16, 32, 4, 2, kv_load="block"))  # fmt: skip
    # Blocks that are not consecutive rows: a cache holding every other block of a wider one.
    strided = torch.cat([cache, cache], dim=1)[:, :16]
    with pytest.raises(ValueError, match="kv_load='tma' cannot read this cache: the cache's bl"):
        mla_decode(q, q_pe, strided, out, table, lens, 0.1,
                   tiles=MLADecodeTiles(16, 16, 4, 2, kv_load="tma"))  # fmt: skip
    with pytest.raises(ValueError, match="latent_splits=2 needs kv_lora_rank > 16"):
        narrow = make_decode([5, 9], 16, 16, 4, torch.float16, torch.float16)
        mla_decode(narrow["q_latent"], narrow["q_pe"], narrow["kv_cache"], out[..., :16], table,
                   lens, 0.1, tiles=MLADecodeTiles(16, 16, 4, 2, latent_splits=2))  # fmt: skip
    assert "rope at 72 B" in tma_unsupported_reason(torch.zeros(3, 16, 40, dtype=torch.half), 36)
    assert tma_unsupported_reason(cache, 32) is None
    assert not out.any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases("cuda"), ids=case_id)
def test_kernel_on_cuda(case: tuple[Callable[..., None], tuple[Any, ...]]) -> None:
    pytest.importorskip("triton")
    check, args = case
    check(*args)


if __name__ == "__main__":
    # Run by test_kernel_under_interpreter with TRITON_INTERPRET=1.
    exit_with_report(failures_of(cases("cpu"), lambda c: c[0](*c[1]), case_id), len(cases("cpu")))


def test_default_tiles_read_keys_by_block_table_entry_off_sm90() -> None:
    # TMA needs a CUDA cache on sm90+; a CPU cache (the interpreter) gets per-key gathers, with
    # the same head tiles (hence the builder's split plan) as on the GPU.
    cache = torch.zeros(3, 64, 576, dtype=torch.bfloat16)
    for heads, block_h in ((1, 16), (16, 16), (32, 32), (128, 64)):
        tiles = mla_decode_tiles(heads, cache, 512)
        assert tiles.kv_load == "gather"
        assert tiles.block_h == block_h
        assert mla_decode_tiles(heads) == tiles


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_tiles_use_tma_where_the_gpu_and_cache_allow() -> None:
    cache = torch.zeros(3, 64, 576, dtype=torch.bfloat16, device="cuda")
    tma = torch.cuda.get_device_capability()[0] >= 9
    for heads in (16, 128):
        assert (mla_decode_tiles(heads, cache, 512).kv_load == "tma") == tma
        assert mla_decode_tiles(heads, cache[:, :32], 512).kv_load == "gather"  # block 32
