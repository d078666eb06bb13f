"""Copies between host and device that never wait for work already queued on the device.

On CUDA a copy from pageable host memory may first wait for every queued kernel, and
`tensor.tolist()` waits for them all; an engine that prepares step N+1 while step N runs needs
neither. `to_device` copies through pinned memory without blocking (PyTorch's pinned-memory
cache keeps the staging block until the copy has run); `to_device_all` uploads many small
arrays through one staging buffer and one copy; `HostCopy` starts a device-to-host copy at a
point of the stream (its device's current stream) and later waits for that point only. On the
CPU all are plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["HostCopy", "to_device", "to_device_all"]

# Each array of a packed upload starts at a multiple of this many bytes, so that every result
# is as aligned as a tensor of its own (compiled kernels specialise on 16-byte alignment).
_ALIGN = 64


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` (a numpy array or CPU tensor) on `device`, without waiting for queued work; on
    the CPU, a numpy array's own memory (made contiguous). The result starts at storage offset
    0 (compiled kernels may assume aligned inputs)."""
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(np.ascontiguousarray(values))
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def to_device_all(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """`to_device` of each of `arrays` (numpy arrays of any shapes and dtypes): on CUDA through
    one pinned staging buffer and one copy, the results being views of one device buffer, each
    starting at a 64-byte boundary; elsewhere as `to_device` (on the CPU each array's own
    memory, made contiguous)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(a).to(device) for a in arrays]
    staging, offsets = _pack(arrays, pin_memory=True)
    return _unpack(staging.to(device, non_blocking=True), arrays, offsets)


def _pack(arrays: Sequence[np.ndarray], *, pin_memory: bool) -> tuple[torch.Tensor, list[int]]:
    """The bytes of contiguous `arrays` in one uint8 host tensor, and each one's byte offset."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    staging = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin_memory)
    host = staging.numpy()
    for a, at in zip(arrays, offsets, strict=True):
        host[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
    return staging, offsets


def _unpack(
    buffer: torch.Tensor, arrays: Sequence[np.ndarray], offsets: Sequence[int]
) -> list[torch.Tensor]:
    """Views of `buffer` (uint8, `_pack`'s layout) with each array's dtype and shape."""
    views = []
    for a, at in zip(arrays, offsets, strict=True):
        dtype = torch.from_numpy(a[:0].reshape(-1)).dtype
        views.append(buffer[at : at + a.nbytes].view(dtype).view(a.shape))
    return views


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
