"""What an op's `impl=` argument selects: its Triton kernel or its PyTorch path."""

from __future__ import annotations

import torch

try:
    import triton
except ImportError:  # triton is an optional extra
    triton = None

__all__ = ["use_triton"]


def use_triton(op: str, impl: str, device: torch.device) -> bool:
    """Whether `op` (its name, for messages) runs its Triton kernel on `device`: `impl`
    "triton" or "torch" forces one path; "auto" takes Triton on CUDA when triton is importable
    (on the CPU, "triton" needs `TRITON_INTERPRET=1` set before import).

    Raises:
        ValueError: an unknown `impl`.
        RuntimeError: `impl="triton"` without triton installed.
    """
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(
            f"{op}: unknown impl (got {impl!r}, expected 'auto', 'torch' or 'triton')."
        )
    if impl == "triton" and triton is None:
        raise RuntimeError(
            f"{op}: impl='triton' needs triton (got no importable triton). Install the "
            "'triton' extra or pass impl='auto'."
        )
    if impl != "auto":
        return impl == "triton"
    return triton is not None and device.type == "cuda"
