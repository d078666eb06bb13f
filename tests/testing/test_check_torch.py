"""The TORCH reference backend passes the whole conformance kit on the CPU, in every dtype."""

from __future__ import annotations

import pytest
import torch

from anyattn.testing import check_backend

torch_attn = pytest.importorskip("anyattn.backends.torch_attn")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_torch_backend_conforms(dtype: torch.dtype) -> None:
    report = check_backend(torch_attn.TorchAttentionBackend, "cpu", dtype)
    report.assert_passed()
    # TORCH declares every feature the kit knows: nothing may be left out.
    assert report.not_declared == [], report.summary()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_torch_backend_conforms_on_cuda(dtype: torch.dtype) -> None:
    report = check_backend(torch_attn.TorchAttentionBackend, "cuda", dtype)
    report.assert_passed()
