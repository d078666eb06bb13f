"""`anyattn.async_copy`: uploads give the host values back, whatever their shapes and dtypes.

The packed layout of `to_device_all` is checked on the CPU through its host half (`_pack`,
`_unpack`); the CUDA test runs the whole upload.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anyattn.async_copy import HostCopy, _pack, _unpack, to_device, to_device_all

_ARRAYS = [
    np.arange(5, dtype=np.int32),
    np.arange(12, dtype=np.int64).reshape(3, 4),
    np.zeros((0, 7), dtype=np.int32),
    np.array([1.5, -2.25], dtype=np.float32),
    np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::2],  # not contiguous
    np.array([True, False, True]),
    np.arange(3, dtype=np.int16),
]


def test_packed_views_give_each_array_back_aligned():
    arrays = [np.ascontiguousarray(a) for a in _ARRAYS]
    staging, offsets = _pack(arrays, pin_memory=False)
    views = _unpack(staging, arrays, offsets)
    for array, view in zip(arrays, views, strict=True):
        assert view.data_ptr() % 64 == 0
        assert tuple(view.shape) == array.shape
        assert view.dtype == torch.from_numpy(array).dtype
        np.testing.assert_array_equal(view.numpy(), array)
    # every array has bytes of its own
    ends = [at + a.nbytes for at, a in zip(offsets, arrays, strict=True)]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:], strict=False))


def test_on_the_cpu_uploads_are_the_arrays_themselves():
    arrays = [np.arange(4, dtype=np.int64), np.ones((2, 2), dtype=np.int32)]
    tensors = to_device_all(arrays, torch.device("cpu"))
    for array, tensor in zip(arrays, tensors, strict=True):
        assert tensor.data_ptr() == array.ctypes.data
    np.testing.assert_array_equal(to_device(arrays[0], torch.device("cpu")).numpy(), arrays[0])


@pytest.mark.gpu
def test_cuda_uploads_and_host_copies_round_trip():
    device = torch.device("cuda")
    tensors = to_device_all(_ARRAYS, device)
    for array, tensor in zip(_ARRAYS, tensors, strict=True):
        assert tensor.device.type == "cuda"
        assert tensor.data_ptr() % 64 == 0
        np.testing.assert_array_equal(tensor.cpu().numpy(), array)
        np.testing.assert_array_equal(HostCopy(tensor).tolist(), array.tolist())
    one = to_device(_ARRAYS[1], device)
    np.testing.assert_array_equal(one.cpu().numpy(), _ARRAYS[1])
