"""Copies between host and device that never wait for work already queued on the device.

On CUDA a copy from pageable host memory to the device may first wait for every kernel queued
on the stream (CUDA's "API synchronization behavior"), and `tensor.tolist()` of a device tensor
waits for them all. An engine that prepares step N+1 while step N runs (the engine's
asynchronous scheduling) needs neither: `to_device` stages host values in pinned memory and
copies without blocking (PyTorch's pinned-memory cache keeps the staging block until the copy
has run), which builders use for every per-step upload; `HostCopy` starts a device-to-host copy
at a point of the stream and later waits for that point only. On the CPU both are plain
tensors. Events are recorded on the tensor's own device's current stream.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["HostCopy", "to_device"]


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` (a numpy array or CPU tensor) on `device`, without waiting for queued work; on
    the CPU, a numpy array's own memory (made contiguous). The result starts at storage offset
    0 (compiled kernels may assume aligned inputs)."""
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(np.ascontiguousarray(values))
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values as they are at this point of its stream, readable on the host
    once the device gets there (`tolist`), whatever was queued after."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(tensor.device))

    def tolist(self) -> list:
        """The values (waits for the copy, not for work queued after it)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
