"""fp8 KV-cache bytes, on every write path, against an independent float64 rounding.

The expected bytes are worked out here in float64, without calling the code under test: the
float32 quotient `x / scale` (a float64 division of two float32 values rounded once to float32
is the correctly rounded float32 quotient, since 53 >= 2 * 24 + 2), then the nearest value of
the fp8 grid decoded from the format's bit layout, ties to the even byte, saturation at the
largest finite value, NaN as the byte 0x7F, the sign kept on zeros.

Inputs: all 65,536 fp16 bit patterns, all 65,536 bf16 bit patterns (NaN, inf, -0.0 and
subnormals included) and float32 values within 3 ulps of every fp8 rounding midpoint times each
scale; three scales (0.05604162812232971 is the regression case's, 1.0 divides exactly, 37.7
sends values into the fp8 subnormals), per tensor and per KV head; e4m3 and e5m2.

Paths: reshape_and_cache's PyTorch path, its Triton kernel (on the CPU under TRITON_INTERPRET=1,
in a subprocess that runs this file as a script, and on the GPU), reshape_and_cache_ref and the
kit's write_kv. The interpreter converts bf16 subnormals to float32 wrongly, so there the bf16
patterns go in as float32 (the same values, converted exactly); the GPU reads real bf16.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from case_runner import exit_with_report, failures_of

from anyattn.ops.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from anyattn.testing import write_kv

SCALES = (0.05604162812232971, 1.0, 37.7)
FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Sweeps: "float16"/"bfloat16" are all bit patterns in that dtype; "bfloat16_as_float32" the
# bf16 patterns as float32 inputs; "float32" values around the rounding midpoints.
SWEEPS = ("float16", "bfloat16", "bfloat16_as_float32", "float32")
HEAD_SIZE, NUM_KV_HEADS, BLOCK_SIZE = 4096, len(SCALES), 16
# The regression case: CPU and PyTorch stored -13.0, the Triton store on the GPU -12.0.
REGRESSION_X, REGRESSION_SCALE, REGRESSION_BYTE = -0.700520396232605, 0.05604162812232971, 0xD5


# --- the independent reference ----------------------------------------------------------------


def fp8_grid(fp8: torch.dtype) -> np.ndarray:
    """The values of the bytes 0, 1, ... up to the largest finite one, decoded from the bit
    layout (1 sign, 4 or 5 exponent, 3 or 2 mantissa bits); increasing."""
    mant_bits, bias, num_finite = (3, 7, 0x7F) if fp8 == torch.float8_e4m3fn else (2, 15, 0x7C)
    codes = np.arange(num_finite)
    exponent, mantissa = codes >> mant_bits, codes & ((1 << mant_bits) - 1)
    fraction = mantissa / 2.0**mant_bits
    return np.where(
        exponent == 0, fraction * 2.0 ** (1 - bias), (1 + fraction) * 2.0 ** (exponent - bias)
    )


def expected_fp8_bytes(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> np.ndarray:
    """uint8 bytes of `x / scale` (`scale` broadcast to `x`) by float64 arithmetic."""
    with np.errstate(all="ignore"):
        y = (x.double().numpy() / scale.double().numpy()).astype(np.float32).astype(np.float64)
    grid = fp8_grid(fp8)
    magnitude = np.abs(y)
    # grid[above - 1] < magnitude <= grid[above]; past the largest value both ends are the top.
    above = np.clip(np.searchsorted(grid, magnitude), 1, len(grid) - 1)
    below = above - 1
    to_above, to_below = grid[above] - magnitude, magnitude - grid[below]
    take_above = (to_above < to_below) | ((to_above == to_below) & (above % 2 == 0))
    code = np.where(take_above, above, below) | (np.signbit(y).astype(np.int64) << 7)
    return np.where(np.isnan(y), 0x7F, code).astype(np.uint8)


def test_reference_on_known_values() -> None:
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    x = torch.tensor([12.5, 13.5, -0.0, 1e-9, -1e-9, 464.0, 1e30, -np.inf, np.nan, 2.0**-10])
    # 12.5 and 13.5 are ties (to 12 and 14, even mantissas); 464 is the tie past 448 and
    # saturates; 2^-10 is half of e4m3's smallest subnormal 2^-9, a tie to 0.
    expected = [0x54, 0x56, 0x80, 0x00, 0x80, 0x7E, 0x7E, 0xFE, 0x7F, 0x00]
    assert expected_fp8_bytes(x, torch.tensor(1.0), e4m3).tolist() == expected
    # e5m2 around 12: 12 and 14 (step 2), 13 a tie to 12; 61440 the tie past 57344.
    x = torch.tensor([13.0, 15.0, 61440.0, 2.0**-17, 3 * 2.0**-17, np.inf])
    assert expected_fp8_bytes(x, torch.tensor(1.0), e5m2).tolist() == [
        0x4A, 0x4C, 0x7B, 0x00, 0x02, 0x7B,
    ]  # fmt: skip
    regression = expected_fp8_bytes(
        torch.tensor(REGRESSION_X), torch.tensor(REGRESSION_SCALE), e4m3
    )
    assert int(regression) == REGRESSION_BYTE  # -13.0: the float32 quotient is 12.500000954


# --- the sweeps -------------------------------------------------------------------------------


def sweep_values(sweep: str) -> torch.Tensor:
    """The inputs of a sweep, flat, in the dtype the op receives."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    if sweep == "float16":
        return patterns.view(torch.float16)
    if sweep in ("bfloat16", "bfloat16_as_float32"):
        values = patterns.view(torch.bfloat16)
        return values if sweep == "bfloat16" else values.float()
    assert sweep == "float32"
    midpoints = []
    for fp8 in FORMATS.values():
        grid = fp8_grid(fp8)
        half_way = (grid[:-1] + grid[1:]) / 2
        midpoints += [half_way * s for s in SCALES]
    centre = torch.from_numpy(np.concatenate(midpoints)).float()
    centre = torch.cat([centre, -centre, torch.tensor([REGRESSION_X])])
    ulp = torch.nextafter(centre.abs(), torch.tensor(np.inf)) - centre.abs()
    return torch.cat([centre + k * ulp * centre.sign() for k in range(-3, 4)])


def keys_of(sweep: str, head_size: int = HEAD_SIZE) -> torch.Tensor:
    """`[num_tokens, NUM_KV_HEADS, head_size]`: the sweep (zero-padded) on every KV head."""
    values = sweep_values(sweep)
    padded = torch.zeros(-(-values.numel() // head_size) * head_size, dtype=values.dtype)
    padded[: values.numel()] = values
    return padded.view(-1, 1, head_size).repeat(1, NUM_KV_HEADS, 1)


def scale_pairs(is_per_head: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k_scale, v_scale): per head, every scale on one head (V's rotated); per tensor, each
    scale once for K and once for V."""
    scales = torch.tensor(SCALES, dtype=torch.float32)
    if is_per_head:
        return [(scales, scales.roll(1))]
    return [(scales[i], scales[(i + 1) % len(SCALES)]) for i in range(len(SCALES))]


def check_cache_bytes(
    device: str, impl: str, sweep: str, kv_cache_dtype: str, per_head: bool
) -> None:
    """reshape_and_cache's cache bytes == the reference, for K and V, one launch per scale
    pair; tokens in shuffled slots of a pool with a null block 0."""
    fp8 = FORMATS[kv_cache_dtype]
    key = keys_of(sweep)
    value = key.flip(0)
    num_tokens = key.shape[0]
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 2
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm((num_blocks - 1) * BLOCK_SIZE, generator=gen)[:num_tokens] + BLOCK_SIZE
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    for k_scale, v_scale in scale_pairs(per_head):
        cache = torch.zeros(num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=fp8)
        cache = cache.to(device)
        args = (key, value, cache, slots, kv_cache_dtype, k_scale, v_scale)
        reshape_and_cache(
            *(x.to(device) if isinstance(x, torch.Tensor) else x for x in args), impl=impl
        )
        written = cache.cpu()[block, :, offset].view(torch.uint8)  # [num_tokens, 2, heads, dim]
        for index, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
            expected = expected_fp8_bytes(x, scale.view(-1, 1) if per_head else scale, fp8)
            got = written[:, index].numpy()
            bad = np.argwhere(got != expected)
            assert bad.size == 0, (
                f"{'KV'[index]}: {len(bad)} bytes differ, first at {bad[0].tolist()}: x = "
                f"{float(x[tuple(bad[0])])!r}, got {got[tuple(bad[0])]:#04x}, expected "
                f"{expected[tuple(bad[0])]:#04x}"
            )


CASES = [
    (sweep, kv_cache_dtype, per_head)
    for sweep in SWEEPS
    for kv_cache_dtype in FORMATS
    for per_head in (False, True)
]


def case_id(case: tuple[str, str, bool]) -> str:
    sweep, kv_cache_dtype, per_head = case
    return f"{sweep}-{kv_cache_dtype}-{'per_head' if per_head else 'per_tensor'}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_path_bytes(case: tuple[str, str, bool]) -> None:
    check_cache_bytes("cpu", "torch", *case)


def interpreter_cases() -> list[tuple[str, str, bool]]:
    # bf16 inputs go in as float32 there (see the module docstring).
    return [case for case in CASES if case[0] != "bfloat16"]


def test_triton_path_bytes_under_interpreter(triton_interpreter: Callable[..., str]) -> None:
    stdout = triton_interpreter(__file__)
    assert f"ran {len(interpreter_cases()) + 1} cases, 0 failed" in stdout, stdout


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_ref_and_kit_writer_bytes(kv_cache_dtype: str) -> None:
    """reshape_and_cache_ref and the kit's write_kv, on the fp16 patterns, per-head scales."""
    fp8 = FORMATS[kv_cache_dtype]
    key, value = keys_of("float16", head_size=64), -keys_of("float16", head_size=64)
    (k_scale, v_scale), *_ = scale_pairs(is_per_head=True)
    slots = torch.arange(key.shape[0]) + BLOCK_SIZE  # in order, after the null block
    for name in ("reshape_and_cache_ref", "write_kv"):
        cache = torch.zeros(key.shape[0] // BLOCK_SIZE + 1, 2, BLOCK_SIZE, *key.shape[1:])
        cache = cache.to(fp8)
        if name == "write_kv":
            write_kv(cache, key, value, slots, kv_cache_dtype, k_scale, v_scale)
        else:
            reshape_and_cache_ref(key, value, cache, slots, kv_cache_dtype, k_scale, v_scale)
        # written: [num_tokens, 2, NUM_KV_HEADS, 64]
        written = cache[1:].transpose(1, 2).reshape(-1, 2, *key.shape[1:]).view(torch.uint8)
        for index, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
            expected = expected_fp8_bytes(x, scale.view(-1, 1), fp8)
            assert np.array_equal(written[:, index].numpy(), expected), name


def check_regression_case(device: str, impl: str) -> None:
    """x = -0.700520396232605 / 0.05604162812232971 is stored as -13.0 in e4m3: the float32
    quotient is 12.500000954, one ulp past the tie that an approximate division lands on."""
    cache = torch.zeros(2, 2, BLOCK_SIZE, 1, 1, dtype=torch.float8_e4m3fn, device=device)
    x = torch.tensor(REGRESSION_X, device=device).view(1, 1, 1)
    scale = torch.tensor(REGRESSION_SCALE, device=device)
    slots = torch.tensor([BLOCK_SIZE + 3], device=device)
    if impl == "ref":
        reshape_and_cache_ref(x, x, cache, slots, "fp8_e4m3", scale, scale)
    else:
        reshape_and_cache(x, x, cache, slots, "fp8_e4m3", scale, scale, impl=impl)
    assert cache[1, :, 3].view(torch.uint8).flatten().tolist() == [REGRESSION_BYTE] * 2
    assert cache[1, 0, 3].item() == -13.0


@pytest.mark.parametrize("impl", ["torch", "ref"])
def test_regression_case_on_cpu(impl: str) -> None:
    check_regression_case("cpu", impl)


# --- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cache_bytes_on_cuda(impl: str, case: tuple[str, str, bool]) -> None:
    if impl == "triton":
        pytest.importorskip("triton")
        if case[1] == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("Triton has e4m3 only from sm89 on")
    check_cache_bytes("cuda", impl, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch", "ref"])
def test_regression_case_on_cuda(impl: str) -> None:
    if impl == "triton":
        pytest.importorskip("triton")
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("Triton has e4m3 only from sm89 on")
    check_regression_case("cuda", impl)


if __name__ == "__main__":
    # Run by test_triton_path_bytes_under_interpreter with TRITON_INTERPRET=1.
    cases = interpreter_cases()
    failures = failures_of(cases, lambda case: check_cache_bytes("cpu", "triton", *case), case_id)
    failures += failures_of(["triton"], lambda impl: check_regression_case("cpu", impl), str)
    exit_with_report(failures, len(cases) + 1)
