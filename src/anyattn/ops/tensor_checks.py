"""The argument checks the small index ops share: each argument a tensor, all on one device."""

from __future__ import annotations

import torch

__all__ = ["check_tensors_on_one_device"]


def check_tensors_on_one_device(
    op: str, tensors: tuple[tuple[str, object], ...], dtype: torch.dtype | None = None
) -> None:
    """Raise unless every `(name, value)` of `tensors` is a tensor on the first one's device
    (and, given `dtype`, of that dtype); the errors name `op` and the argument.

    Raises:
        TypeError: a value that is not a tensor, or of another dtype.
        ValueError: a tensor on another device than the first.
    """
    device = None
    first = tensors[0][0]
    for name, x in tensors:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor (got {type(x).__name__}).")
        if device is None:
            device = x.device
        elif x.device != device:
            raise ValueError(
                f"{op}: {name} is on another device than {first} (got {x.device}, expected "
                f"{device}). Put every tensor on one device."
            )
        if dtype is not None and x.dtype != dtype:
            wanted = str(dtype).removeprefix("torch.")
            raise TypeError(f"{op}: {name} must be {wanted} (got {x.dtype}).")
