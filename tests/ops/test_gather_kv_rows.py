"""gather_kv_rows against its reference, bit for bit: the PyTorch path on the CPU, the Triton
kernel under `TRITON_INTERPRET=1` (this file run as a script in a subprocess, since Triton
decides at import whether kernels are interpreted) and, marked `gpu`, on CUDA (bf16 too, a
256-request decode batch, and no host-device sync). The interpreter rounds to bf16 wrongly
(../shared/STYLE.md), so there fp32 and fp16 rows are checked; fp8 caches are read exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from case_runner import exit_with_report, failures_of

from anyattn.ops import gather_kv_rows as module
from anyattn.ops.gather_kv_rows import gather_kv_rows, gather_kv_rows_ref

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# A request with no keys, lengths across block boundaries, the longest filling its table row.
KEY_LENS = (5, 0, 9, 1, 16, 4)
BLOCK_SIZE, WIDTH, NUM_KV_HEADS = 4, 4, 3


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


@contextlib.contextmanager
def small_tiles(tile_elements: int | None, block_r: int | None) -> Iterator[None]:
    """Shrink the kernel's tiles so tiny inputs take several key tiles and request chunks."""
    saved = module._TILE_ELEMENTS, module._BLOCK_R
    module._TILE_ELEMENTS = tile_elements or saved[0]
    module._BLOCK_R = block_r or saved[1]
    try:
        yield
    finally:
        module._TILE_ELEMENTS, module._BLOCK_R = saved


def make_inputs(
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    layout: str,
    per_head: bool,
    head_size: int = 12,
    key_lens_dtype: torch.dtype = torch.int32,
) -> dict[str, Any]:
    """CPU inputs: a shuffled paged cache with a null block 0, a padded, non-contiguous block
    table, rows that are a strided view of random values (so stray writes show)."""
    gen = torch.Generator().manual_seed(0)
    num_reqs = len(KEY_LENS)
    num_blocks = (num_reqs + 2) * WIDTH + 5  # a pool larger than the table needs
    shape = (num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, head_size)
    if layout == "NHD":
        cache = torch.randn(shape, generator=gen)
    else:
        physical = torch.randn(num_blocks, 2, NUM_KV_HEADS, BLOCK_SIZE, head_size, generator=gen)
        cache = physical.permute(0, 1, 3, 2, 4)
    cache = cache.to(cache_dtype)
    blocks = torch.randperm(num_blocks - 1, generator=gen)[: (num_reqs + 2) * WIDTH] + 1
    wide_table = torch.zeros(num_reqs + 2, WIDTH + 3, dtype=torch.int32)
    wide_table[:, :WIDTH] = blocks.view(num_reqs + 2, WIDTH).int()
    k_scale = v_scale = None
    if cache_dtype in FP8:
        # Powers of two: products are exact in every dtype.
        k_scale = torch.tensor([0.5, 2.0, 4.0]) if per_head else torch.tensor(0.25)
        v_scale = torch.tensor([4.0, 0.5, 2.0]) if per_head else torch.tensor([2.0])
    num_keys = sum(KEY_LENS)
    first_row = 2
    rows = torch.randn(2, NUM_KV_HEADS, first_row + num_keys + 5, 2 * head_size, generator=gen)
    return {
        "kv_cache": cache,
        "block_table": wide_table[:, :WIDTH],
        "key_lens": torch.tensor(KEY_LENS, dtype=key_lens_dtype),
        "rows": rows[..., :head_size].to(dtype),
        "first_row": first_row,
        "k_scale": k_scale,
        "v_scale": v_scale,
    }


def on(x: Any, device: str) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def check_gather(
    device: str,
    impl: str,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    layout: str,
    per_head: bool = False,
    tiles: tuple[int | None, int | None] = (None, None),
    key_lens_dtype: torch.dtype = torch.int32,
) -> None:
    """`impl` on `device` == the reference on the CPU, every row compared bit for bit."""
    inputs = make_inputs(dtype, cache_dtype, layout, per_head, key_lens_dtype=key_lens_dtype)
    expected = inputs["rows"].clone()
    gather_kv_rows_ref(
        inputs["kv_cache"], inputs["block_table"], inputs["key_lens"], expected[0], expected[1],
        first_row=inputs["first_row"], k_scale=inputs["k_scale"], v_scale=inputs["v_scale"],
    )  # fmt: skip
    rows = inputs["rows"].to(device)
    with small_tiles(*tiles):
        gather_kv_rows(
            on(inputs["kv_cache"], device), on(inputs["block_table"], device),
            on(inputs["key_lens"], device), rows[0], rows[1],
            num_keys=sum(KEY_LENS), max_key_len=max(KEY_LENS), first_row=inputs["first_row"],
            k_scale=on(inputs["k_scale"], device), v_scale=on(inputs["v_scale"], device),
            impl=impl,
        )  # fmt: skip
    assert torch.equal(bits(rows.cpu()), bits(expected))


def cases(device: str, impl: str) -> list[tuple[Callable[..., None], tuple[Any, ...]]]:
    dtypes = [torch.float32, torch.float16]
    if device == "cuda" or impl == "torch":
        dtypes.append(torch.bfloat16)
    found: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
    for dtype in dtypes:
        for layout in ("NHD", "HND"):
            found.append((check_gather, (device, impl, dtype, dtype, layout)))
            # Several key tiles per request, requests summed two at a time.
            found.append((check_gather, (device, impl, dtype, dtype, layout, False, (64, 2))))
        other = torch.float16 if dtype != torch.float16 else torch.float32
        found.append((check_gather, (device, impl, dtype, other, "HND")))
        for fp8 in FP8:
            for per_head in (False, True):
                found.append((check_gather, (device, impl, dtype, fp8, "NHD", per_head)))
    int64_lens = (device, impl, torch.float32, torch.float32, "NHD", False, (64, 4), torch.int64)
    found.append((check_gather, int64_lens))
    return found


def case_id(case: tuple[Callable[..., None], tuple[Any, ...]]) -> str:
    _, args = case
    return "-".join(map(str, args[1:]))


def run_cases(device: str, impl: str) -> list[str]:
    """Run every case, return the ids (and errors) of those that failed."""
    return failures_of(cases(device, impl), lambda case: case[0](*case[1]), case_id)


# --- on the CPU -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", cases("cpu", "torch"), ids=case_id)
def test_torch_path_matches_ref(case: tuple[Callable[..., None], tuple[Any, ...]]) -> None:
    check, args = case
    check(*args)


def test_kernel_under_interpreter(triton_interpreter: Callable[..., str]) -> None:
    stdout = triton_interpreter(__file__)
    assert "ran" in stdout, stdout


def test_no_keys_writes_nothing() -> None:
    inputs = make_inputs(torch.float32, torch.float32, "NHD", False)
    rows = inputs["rows"]
    before = rows.clone()
    gather_kv_rows(
        inputs["kv_cache"], inputs["block_table"], torch.zeros(3, dtype=torch.int32), rows[0],
        rows[1], num_keys=0, max_key_len=0,
    )  # fmt: skip
    gather_kv_rows(
        inputs["kv_cache"], inputs["block_table"], torch.zeros(0, dtype=torch.int32), rows[0],
        rows[1], num_keys=0, max_key_len=0,
    )  # fmt: skip
    assert torch.equal(rows, before)


def _call(**changes: Any) -> None:
    inputs = make_inputs(torch.float32, torch.float8_e4m3fn, "NHD", True)
    rows = inputs.pop("rows")
    args = {
        **inputs,
        "k_rows": rows[0],
        "v_rows": rows[1],
        "num_keys": sum(KEY_LENS),
        "max_key_len": max(KEY_LENS),
        **changes,
    }
    positional = [args.pop(k) for k in ("kv_cache", "block_table", "key_lens", "k_rows", "v_rows")]
    gather_kv_rows(*positional, **args)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"block_table": torch.zeros(6, 4, dtype=torch.int64)}, TypeError, "block_table must"),
        ({"block_table": torch.zeros(2, 4, dtype=torch.int32)}, ValueError, "too few rows"),
        ({"key_lens": torch.zeros(6)}, TypeError, "key_lens must"),
        ({"kv_cache": torch.zeros(4, 3, 4, 3, 12)}, ValueError, "kv_cache must"),
        ({"k_rows": torch.zeros(3, 50, 12, dtype=torch.int32)}, TypeError, "unsupported dtype"),
        ({"k_rows": torch.zeros(2, 50, 12)}, ValueError, "num_kv_heads, rows"),
        ({"v_rows": torch.zeros(3, 50, 12)}, ValueError, "v_rows differs"),
        ({"num_keys": 500}, ValueError, "do not fit the rows"),
        ({"first_row": -1}, ValueError, "do not fit the rows"),
        ({"max_key_len": 17}, ValueError, "block_table too narrow"),
        ({"k_scale": None}, ValueError, "k_scale is required"),
        ({"v_scale": torch.tensor([1.0, 2.0])}, ValueError, "v_scale has the wrong shape"),
        ({"k_scale": torch.tensor(1.0, dtype=torch.float64)}, TypeError, "wrong dtype"),
        (
            {"kv_cache": torch.zeros(4 * 8 + 5, 2, 4, 3, 12), "v_scale": None},
            ValueError,
            "go together",
        ),
        ({"key_lens": torch.zeros(6, dtype=torch.int32, device="meta")}, ValueError, "device"),
        ({"impl": "cuda"}, ValueError, "unknown impl"),
    ],
)
def test_rejected_inputs(changes: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _call(**changes)


# --- on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases("cuda", "triton"), ids=case_id)
def test_kernel_on_cuda(case: tuple[Callable[..., None], tuple[Any, ...]]) -> None:
    pytest.importorskip("triton")
    check, args = case
    check(*args)


@pytest.mark.gpu
def test_auto_takes_triton_on_cuda_without_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 256-request decode batch (2048 keys each, block size 16, 8 KV heads, bf16): the auto
    path launches the kernel, never syncs, and matches the PyTorch path bit for bit."""
    pytest.importorskip("triton")
    calls: list[int] = []
    real = module._gather_with_triton

    def spy(*args: Any) -> None:
        calls.append(1)
        real(*args)

    monkeypatch.setattr(module, "_gather_with_triton", spy)
    gen = torch.Generator().manual_seed(5)
    num_reqs, key_len, block_size, num_kv_heads, head_size = 256, 2048, 16, 8, 128
    width = key_len // block_size
    num_blocks = num_reqs * width + 1
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).int().view(num_reqs, width)
    cache = torch.randn(
        num_blocks, 2, block_size, num_kv_heads, head_size, device="cuda", dtype=torch.bfloat16
    )
    table, key_lens = table.cuda(), torch.full((num_reqs,), key_len, device="cuda").int()
    num_keys = num_reqs * key_len
    rows = torch.zeros(2, num_kv_heads, 1 + num_keys, head_size, device="cuda", dtype=cache.dtype)
    expected = torch.zeros_like(rows)
    args = (cache, table, key_lens)
    sizes = {"num_keys": num_keys, "max_key_len": key_len, "first_row": 1}
    gather_kv_rows(*args, expected[0], expected[1], **sizes, impl="torch")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather_kv_rows(*args, rows[0], rows[1], **sizes)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls == [1]
    assert torch.equal(bits(rows), bits(expected))


if __name__ == "__main__":
    # Run by test_kernel_under_interpreter with TRITON_INTERPRET=1.
    exit_with_report(run_cases("cpu", "triton"), len(cases("cpu", "triton")))
