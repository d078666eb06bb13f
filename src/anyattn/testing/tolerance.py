"""The tolerance rule of STYLE.md: an error bound derived from the reference's own rounding.

Pass when `max|out - ref64| <= 2 * max|ref_lowp - ref64| + floor`, where `ref_lowp` is the
oracle run in the input dtype and `floor = 2 * max|(ref64 + 0.3 - 0.3) - ref64|` computed in the
input dtype (that dtype's rounding noise at the reference's magnitudes).
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
    """`2 * max|ref_lowp - ref64| + floor` over the finite entries of `ref64`.

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
    return float(2 * lowp_error + floor)
