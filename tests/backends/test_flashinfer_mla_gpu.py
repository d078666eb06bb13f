"""FLASHINFER_MLA on CUDA (`gpu` marker; skipped without a GPU or FlashInfer): the MLA
conformance kit in bf16 and fp16 against the float64 oracle (DeepSeek's 512+64 split, decodes,
fresh and chunked prefills, context read in three or more chunks, LSE). Every declared value also
runs in the declaration sweep (tests/backends/test_declarations.py -k FLASHINFER_MLA).

    pytest -m gpu tests/backends/test_flashinfer_mla_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from anyattn.backends.flashinfer_mla import FlashInferMLABackend
from anyattn.testing import check_backend

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conformance_kit_on_cuda(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("flashinfer")
    check_backend(FlashInferMLABackend, "cuda", dtype).assert_passed()
