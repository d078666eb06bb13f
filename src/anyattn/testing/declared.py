"""What a backend declares, read the way the kit's planners (standard and MLA) both need it."""

from __future__ import annotations

import torch

from anyattn.backend import AttentionBackend
from anyattn.types import DeviceInfo

__all__ = ["FP8_CACHE_DTYPES", "declared_fp8", "global_reasons"]

FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""The fp8 KV-cache dtype names the kit runs when declared."""


def global_reasons(
    backend: type[AttentionBackend], device: DeviceInfo, dtype: torch.dtype
) -> list[str]:
    """Reasons nothing can run at all: device, compute capability, dtype, availability."""
    reasons = []
    if not backend.supports_device(device):
        reasons.append(f"device {device.type} not in supported_device_types")
    elif device.capability is not None and not backend.supports_compute_capability(
        device.capability
    ):
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
