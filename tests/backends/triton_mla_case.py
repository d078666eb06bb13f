"""TRITON_MLA test set-up shared by the interpreter tests and the GPU tests: the backend's
kernels on the CPU through the Triton interpreter (float32 and float16 added to what CUDA
declares, the small 64+16 split only, to keep the interpreter quick)."""

from __future__ import annotations

import torch

from anyattn.backends.triton_mla import TritonMLABackend, TritonMLAImpl
from anyattn.backends.triton_mla_builder import TritonMLAMetadataBuilder

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class InterpretedTritonMLA(TritonMLABackend):
    """TRITON_MLA's kernels on the CPU through the interpreter (tests only)."""

    supported_device_types = ("cpu", "cuda")
    supported_dtypes = _DTYPES

    @staticmethod
    def get_impl_cls() -> type[TritonMLAImpl]:
        return InterpretedTritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TritonMLAMetadataBuilder]:
        return InterpretedTritonMLABuilder

    @classmethod
    def get_supported_mla_splits(cls) -> list[tuple[int, int]]:
        return [(64, 16)]


class InterpretedTritonMLAImpl(TritonMLAImpl):
    backend = InterpretedTritonMLA


class InterpretedTritonMLABuilder(TritonMLAMetadataBuilder):
    backend = InterpretedTritonMLA
