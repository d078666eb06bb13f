"""FLEX_ATTENTION: attention through PyTorch's FlexAttention (`torch.nn.attention.flex_attention`).

The portable backend for what the fused kernels do not serve: encoder, encoder-only and cross
attention on CUDA (after FLASH_ATTN), every attention type on the CPU (after TORCH). One compiled
`flex_attention` call per layer and step covers the batch: `flex_attention_builder` lays the
step out and makes the BlockMasks, `flex_attention_impl` runs it.

Limits, all declared: LSE only on CUDA; no cascade; head sizes multiples of 16 up to 256
(Triton's dot); no CUDA graphs. Each configuration's first step compiles (tens of seconds).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Mapping
from typing import ClassVar

import torch

from anyattn.backend import AttentionBackend
from anyattn.backends.flex_attention_builder import (
    FlexAttentionMetadata,
    FlexAttentionMetadataBuilder,
)
from anyattn.backends.flex_attention_impl import FlexAttentionImpl
from anyattn.types import AttentionType, DeviceInfo

__all__ = [
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexAttentionMetadataBuilder",
]


class FlexAttentionBackend(AttentionBackend):
    """Declarations of the FLEX_ATTENTION backend (see the module docstring)."""

    priority: ClassVar[Mapping[str, int]] = {"cpu": 1, "cuda": 3, "blackwell": 3}

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cpu", "cuda")
    supported_attn_types = tuple(AttentionType)
    supported_features = (
        "sink", "sliding_window", "alibi", "logits_soft_cap", "non_causal",
        "per_head_quant_scales", "lse",  # lse: on CUDA only (see supports_combination)
    )  # fmt: skip
    # The Triton template is tuned for and tested on Ampere and newer.
    min_compute_capability = (8, 0)
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "FLEX_ATTENTION"

    @staticmethod
    def get_impl_cls() -> type[FlexAttentionImpl]:
        return FlexAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlexAttentionMetadataBuilder]:
        return FlexAttentionMetadataBuilder

    @classmethod
    def chosen_automatically(cls, config, device: DeviceInfo) -> bool:
        """On the CPU every attention type; on CUDA all but decoder attention."""
        return device.type == "cpu" or AttentionType(config.attn_type) != AttentionType.DECODER

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(16, 257, 16))

    @classmethod
    def supports_combination(cls, config, device) -> str | None:
        if config.needs_lse and device.type == "cpu":
            return (
                "returning LSE (needs_lse) not supported on cpu (Inductor's CPU FlexAttention "
                "has no LSE output)"
            )
        return None

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        return _unavailable_reason()


@functools.cache
def _unavailable_reason() -> str | None:
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return (
            "torch.nn.attention.flex_attention is missing (torch >= 2.5 needed): "
            "pip install 'torch>=2.5'"
        )
    if not torch._dynamo.is_dynamo_supported():
        version = ".".join(str(v) for v in sys.version_info[:2])
        return (
            f"torch.compile is not supported on this Python (got Python {version}): run on a "
            f"Python version torch {torch.__version__.split('+')[0]} supports for torch.compile"
        )
    if torch.cuda.is_available():
        if importlib.util.find_spec("triton") is None:
            return "Triton is missing (torch.compile needs it on CUDA): pip install triton"
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:
        return "no C++ compiler for torch.compile on the CPU: install g++ (or set CXX)"
    return None


FlexAttentionImpl.backend = FlexAttentionBackend
FlexAttentionMetadataBuilder.backend = FlexAttentionBackend
