"""apply_soft_cap against float64 `cap * tanh(s / cap)`, through a one-line kernel.

The accurate form (float32 inputs) must be within 2 float32 ulps of the correctly rounded
value for s in [-10 cap, 10 cap], caps 1, 20 and 50; the fast form (16-bit inputs) within
2^-20 * cap. Sweeps: an even grid over the range, values down to 1e-30 * cap, and the 4,096
float32 values on each side of the accurate form's switch at |s| = 0.75 cap. On the CPU the
kernel runs under TRITON_INTERPRET=1, in a subprocess running this file as a script; the `gpu`
test runs it on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from case_runner import exit_with_report, failures_of

try:
    import triton
    import triton.language as tl

    from anyattn.ops.soft_cap import apply_soft_cap
except ImportError:  # triton is an optional extra
    triton = None

CAPS = (1.0, 20.0, 50.0)
BLOCK = 1 << 16

if triton is not None:

    @triton.jit
    def _soft_cap_kernel(s_ptr, out_ptr, n, cap, ACCURATE: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        is_in = offsets < n
        s = tl.load(s_ptr + offsets, mask=is_in, other=0.0)
        tl.store(out_ptr + offsets, apply_soft_cap(s, cap, ACCURATE), mask=is_in)


def soft_capped(s: torch.Tensor, cap: float, accurate: bool) -> torch.Tensor:
    """The helper applied to float32 `s` (1-D), on `s`'s device."""
    out = torch.empty_like(s)
    _soft_cap_kernel[(triton.cdiv(s.numel(), BLOCK),)](s, out, s.numel(), cap, accurate, BLOCK)
    return out


def scores(cap: float) -> torch.Tensor:
    """float32 scores in [-10 cap, 10 cap] (see the module docstring), both signs."""
    grid = torch.linspace(-10 * cap, 10 * cap, 3 * BLOCK + 1, dtype=torch.float64)
    tiny = cap * torch.logspace(-30, 0, 4096, dtype=torch.float64)
    switch = torch.tensor(0.75 * cap, dtype=torch.float32).view(torch.int32)
    near_switch = (switch + torch.arange(-4096, 4096, dtype=torch.int32)).view(torch.float32)
    positive = torch.cat([tiny.float(), near_switch, torch.tensor([10 * cap])])
    return torch.cat([grid.float(), positive, -positive])


def ulps_from_reference(out: torch.Tensor, s: torch.Tensor, cap: float) -> torch.Tensor:
    """|out - ref| in float32 ulps of ref, ref = float64 `cap * tanh(s / cap)` rounded to
    float32."""
    ref = (cap * torch.tanh(s.double() / cap)).float()
    ulp = (torch.nextafter(ref.abs(), torch.tensor(math.inf)) - ref.abs()).double()
    return (out.double() - ref.double()).abs() / ulp


def check_accurate(device: str, cap: float) -> None:
    s = scores(cap)
    out = soft_capped(s.to(device), cap, accurate=True).cpu()
    error = ulps_from_reference(out, s, cap)
    worst = int(error.argmax())
    assert error.max() <= 2, (
        f"cap {cap}: {float(error.max())} ulps at s = {float(s[worst])!r} (got "
        f"{float(out[worst])!r})"
    )


def check_fast(device: str, cap: float) -> None:
    s = scores(cap)
    out = soft_capped(s.to(device), cap, accurate=False).cpu()
    error = (out.double() - cap * torch.tanh(s.double() / cap)).abs()
    worst = int(error.argmax())
    assert error.max() <= 2**-20 * cap, (
        f"cap {cap}: error {float(error.max()):.3g} at s = {float(s[worst])!r}"
    )


def check_special_values(device: str, cap: float) -> None:
    s = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0], device=device)
    for accurate in (True, False):
        out = soft_capped(s, cap, accurate).cpu()
        assert out[:2].tolist() == [cap, -cap], (accurate, out)
        assert out[2].isnan(), (accurate, out)
        assert out[3:].abs().max() == 0, (accurate, out)


CHECKS = (check_accurate, check_fast, check_special_values)
CASES = [(check, cap) for check in CHECKS for cap in CAPS]


def case_id(case: tuple[Callable[[str, float], None], float]) -> str:
    return f"{case[0].__name__.removeprefix('check_')}-cap{case[1]:g}"


def test_soft_cap_under_interpreter(triton_interpreter: Callable[..., str]) -> None:
    stdout = triton_interpreter(__file__)
    assert f"ran {len(CASES)} cases, 0 failed" in stdout, stdout


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_soft_cap_on_cuda(case: tuple[Callable[[str, float], None], float]) -> None:
    pytest.importorskip("triton")
    check, cap = case
    check("cuda", cap)


if __name__ == "__main__":
    # Run by test_soft_cap_under_interpreter with TRITON_INTERPRET=1.
    exit_with_report(failures_of(CASES, lambda case: case[0]("cpu", case[1]), case_id), len(CASES))
