"""How the kit judges one result: exact bit comparisons, and the oracle's tolerance rule."""

from __future__ import annotations

import math

import torch

from anyattn.testing.report import CaseResult
from anyattn.testing.tolerance import error_bound, max_abs_error

__all__ = ["judge_against_oracle", "num_changed"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def num_changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (NaN-safe, -0.0 != 0.0, any layout)."""
    as_int = _INT_OF_SIZE[a.element_size()]
    return int((a.view(as_int) != b.view(as_int)).sum())


def judge_against_oracle(
    name: str,
    out: torch.Tensor,
    ref64: torch.Tensor,
    ref_lowp: torch.Tensor,
    dtype: torch.dtype,
    problems: list[str],
    feature: str,
) -> CaseResult:
    """One result: passed when `out` is within `error_bound` of `ref64` and `problems` (exact
    checks that failed) is empty. `dtype` sets the floor: the model dtype for outputs, float32
    for LSEs (always float32)."""
    error = max_abs_error(out, ref64)
    bound = error_bound(ref64, ref_lowp, dtype)
    problems = list(problems)
    if not error <= bound:
        problems.insert(0, "NaN in the result" if math.isnan(error) else "error above bound")
    return CaseResult(name, error, bound, not problems, "; ".join(problems), feature)
