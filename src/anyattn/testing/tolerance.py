"""The conformance kit's tolerance rule: an error bound derived from the reference's own rounding.

Pass when `max|out - ref64| <= k * max|ref_lowp - ref64| + floor`, where `ref_lowp` is the
oracle run in the input dtype and `floor = 2 * max|(ref64 + 0.3 - 0.3) - ref64|` computed in the
input dtype (that dtype's rounding noise at the reference's magnitudes).

`k` is 2 for 16-bit dtypes, where rounding the scores, probabilities and output to the dtype
dominates both errors. In float32 nothing is rounded that coarsely and the kernel's own
arithmetic shows: GPU kernels take exponentials as `exp2` on `s * log2(e)` with the hardware's
approximate `ex2.approx.f32` (up to 2 ulp, and the product adds its rounding), where the oracle's
`exp` is within 1 ulp, which can put a correct float32 kernel just past twice the oracle's own
error. So `k` is 4 for float32: still a few float32 ulps of the outputs. docs/semantics.md
("Tolerance") states the rule.
"""

from __future__ import annotations

import math

import torch

__all__ = ["error_bound", "max_abs_error"]


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """`max|out - ref|` over entries where `ref` is finite; NaN if `out` has a NaN, inf if an
    infinite `ref` entry (a fully masked row's LSE) is not matched exactly."""
    out, ref = out.double(), ref.double().to(out.device)
    if out.shape != ref.shape:
        raise ValueError(
            f"max_abs_error: shapes differ (got {tuple(out.shape)} and {tuple(ref.shape)})."
        )
    if out.numel() == 0:
        return 0.0
    if bool(torch.isnan(out).any()):
        return math.nan
    finite = torch.isfinite(ref)
    if bool(((~finite) & (out != ref)).any()):
        return math.inf
    if not bool(finite.any()):
        return 0.0
    return float((out - ref).abs()[finite].max())


def error_bound(ref64: torch.Tensor, ref_lowp: torch.Tensor, dtype: torch.dtype) -> float:
    """`k * max|ref_lowp - ref64| + floor` over the finite entries of `ref64` (k: 4 for
    float32, else 2; see the module docstring).

    Args:
        ref64: the oracle in float64.
        ref_lowp: the same oracle run in `dtype`.
        dtype: the input (model) dtype.
    """
    ref64 = ref64.double()
    finite = torch.isfinite(ref64)
    if not bool(finite.any()):
        return 0.0
    exact = ref64[finite]
    lowp_error = (ref_lowp.double().to(ref64.device)[finite] - exact).abs().max()
    rounded = exact.to(dtype)
    floor = 2 * (((rounded + 0.3) - 0.3).double() - exact).abs().max()
    factor = 4 if dtype == torch.float32 else 2
    return float(factor * lowp_error + floor)
