"""How the kit judges a result (`CaseResult`): exact bit comparisons, and the tolerance rule,
an error bound derived from the reference's own rounding (docs/semantics.md, "Tolerance").

Pass when `max|out - ref64| <= k * max|ref_lowp - ref64| + floor`, where `ref_lowp` is the
oracle run in the input dtype and `floor = 2 * max|(ref64 + 0.3 - 0.3) - ref64|` computed in the
input dtype. `k` is 2 for 16-bit dtypes, where rounding to the dtype dominates both errors, and
4 for float32, where a kernel's `exp2` (hardware `ex2.approx.f32`, up to 2 ulp, on a rounded
`s * log2(e)`) can put a correct kernel just past twice the oracle's `exp` error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "CaseResult", "cache_problems", "error_bound", "judge_against_oracle", "judge_lse",
    "max_abs_error", "num_changed",
]  # fmt: skip

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class CaseResult:
    """The outcome of one check.

    Attributes:
        name: the case ("mixed", "fp8/fp8_e5m2", ...); LSE checks end in ".lse".
        max_error: `max|out - ref64|` (NaN when the backend raised or wrote NaN; 0 for checks
            that are exact, such as a constructor rejecting an undeclared head size).
        bound: the tolerance the error must not exceed.
        passed: the error is within bound and every exact check (cache contents, padding rows
            untouched, null block unused) held; detail: why it failed, or what was run.
        feature: the case's feature (`anyattn.testing.FEATURES`); seconds: its wall time.
    """

    name: str
    max_error: float
    bound: float
    passed: bool
    detail: str = ""
    feature: str = ""
    seconds: float = 0.0


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


def num_changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (NaN-safe, -0.0 != 0.0, any layout)."""
    as_int = _INT_OF_SIZE[a.element_size()]
    return int((a.view(as_int) != b.view(as_int)).sum())


def cache_problems(kv_cache: torch.Tensor, expected: torch.Tensor) -> list[str]:
    """The exact check of a cache after a step: bit for bit the expected writes."""
    changed = num_changed(kv_cache, expected)
    return [f"KV cache differs from the expected writes in {changed} elements"] if changed else []


def judge_against_oracle(
    name: str, out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, dtype: torch.dtype,
    problems: list[str], feature: str,
) -> CaseResult:  # fmt: skip
    """One result: passed when `out` is within `error_bound` of `ref64` and `problems` (exact
    checks that failed) is empty. `dtype` sets the floor: the model dtype for outputs, float32
    for LSEs (always float32)."""
    error = max_abs_error(out, ref64)
    bound = error_bound(ref64, ref_lowp, dtype)
    problems = list(problems)
    if not error <= bound:
        problems.insert(0, "NaN in the result" if math.isnan(error) else "error above bound")
    return CaseResult(name, error, bound, not problems, "; ".join(problems), feature)


def judge_lse(
    name: str, lse: torch.Tensor, base_on_e: bool, lse64: torch.Tensor, lse_lowp: torch.Tensor,
    feature: str,
) -> CaseResult:  # fmt: skip
    """The result `<name>.lse`: an impl's LSE (log2 when `base_on_e` is False, converted) against
    the oracle's natural-log LSE, with a float32 floor."""
    lse = lse.double() if base_on_e else lse.double() * math.log(2.0)
    return judge_against_oracle(f"{name}.lse", lse, lse64, lse_lowp, torch.float32, [], feature)
