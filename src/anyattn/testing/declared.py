"""What a backend declares, read the way the kit's planners (standard and MLA) both need it,
and the planning loop they share: features -> cases, with every undeclared part listed."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from anyattn.backend import AttentionBackend
from anyattn.types import DeviceInfo

__all__ = [
    "ENGINE_BLOCK_SIZES", "FP8_CACHE_DTYPES", "block_size_cases", "declared_fp8", "feature_names",
    "global_reasons", "plan_features",
]  # fmt: skip

FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""The fp8 KV-cache dtype names the kit runs when declared."""

ENGINE_BLOCK_SIZES = (16, 32)


def global_reasons(
    backend: type[AttentionBackend], device: DeviceInfo, dtype: torch.dtype
) -> list[str]:
    """Reasons nothing can run at all: device, compute capability, dtype, availability."""
    reasons = []
    if not backend.supports_device(device):
        reasons.append(f"device {device.type} not in supported_device_types")
    elif (cap := device.capability) is not None and not backend.supports_compute_capability(cap):
        reasons.append(f"compute capability {device} below min_compute_capability")
    if not backend.supports_dtype(dtype):
        reasons.append(f"dtype {dtype} not in supported_dtypes")
    unavailable = backend.get_unavailable_reason()
    if unavailable is not None:
        reasons.append(f"unavailable on this machine: {unavailable}")
    return reasons


def declared_fp8(backend: type[AttentionBackend]) -> list[str]:
    """The fp8 cache dtypes of `FP8_CACHE_DTYPES` the backend declares, in that order."""
    return [d for d in FP8_CACHE_DTYPES if backend.supports_kv_cache_dtype(d)]


def block_size_cases(
    backend: type[AttentionBackend], base_block_size: int, make: Callable[[int], Any]
) -> tuple[list[Any], list[str]]:
    """The "block_sizes" feature: `make(b)` for each of `ENGINE_BLOCK_SIZES` (and 5 when
    declared) other than the base case's, and the sizes the backend does not declare."""
    wanted = (*ENGINE_BLOCK_SIZES, 5) if backend.supports_block_size(5) else ENGINE_BLOCK_SIZES
    cases = [make(b) for b in wanted if b != base_block_size and backend.supports_block_size(b)]
    return cases, [f"block_size {b}" for b in wanted if not backend.supports_block_size(b)]


def feature_names(
    api: str, features: Mapping[str, str], requested: Iterable[str] | None
) -> list[str]:
    """The `requested` names (default: all of `features`); any other raises a ValueError whose
    message begins with `api`."""
    names = list(features) if requested is None else list(requested)
    unknown = [n for n in names if n not in features]
    if unknown:
        raise ValueError(
            f"{api} (got {', '.join(unknown)}, expected names from {', '.join(features)})."
        )
    return names


def plan_features(
    backend: type[AttentionBackend], names: list[str], not_declared: Callable[[str], str | None],
    feature_cases: Callable[[str], tuple[list[Any], list[str]]], info: DeviceInfo,
    dtype: torch.dtype,
) -> tuple[list[Any], list[str]]:  # fmt: skip
    """The cases of the features `names`, and "<feature>: <reason>" for each part the backend
    does not declare: a whole feature (`not_declared(feature)`), part of one
    (`feature_cases(feature)` gives its cases and missing parts), or a case its joint rules
    refuse (`validate_configuration`; a case expecting its impl to be rejected is not asked)."""
    cases: list[Any] = []
    skipped: list[str] = []
    for feature in names:
        reason = not_declared(feature)
        if reason is not None:
            skipped.append(f"{feature}: {reason}")
            continue
        planned, missing = feature_cases(feature)
        skipped.extend(f"{feature}: {m} not declared" for m in missing)
        for c in planned:
            reasons = []
            if not getattr(c, "expect_rejection", False):
                reasons = backend.validate_configuration(c.selector_config(dtype), info)
            if reasons:
                skipped.append(f"{feature}: case {c.name}: {'; '.join(reasons)}")
            else:
                cases.append(c)
    return cases, skipped
