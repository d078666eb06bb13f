"""TRITON: our own paged-attention kernels, for any NVIDIA GPU that runs Triton.

The whole step is one launch of `anyattn.ops.unified_attention` over the paged cache (NHD or
HND, GQA packing); decode batches too small to fill the GPU split each request's keys
(flash-decoding) and merge the splits in a second launch. `build` (`triton_attn_builder`) plans
from the CPU mirrors; `forward` only launches. CUDA graphs: ALWAYS (the kernel finds each
program's request on the GPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from anyattn.backend import AttentionBackend, AttentionImpl, AttentionLayer, check_layer_planned
from anyattn.backends.triton_attn_builder import (
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from anyattn.ops.unified_attention import UnifiedAttentionParams, unified_attention
from anyattn.types import AttentionType, DeviceInfo
from anyattn.validation import check_forward, check_forward_inputs, layer_kv_scale

__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
]

_API = "TRITON forward"


class TritonAttentionBackend(AttentionBackend):
    """Declarations of the TRITON backend."""

    priority: ClassVar[Mapping[str, int]] = {"cuda": 2, "blackwell": 2}

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cuda",)
    supported_attn_types = (AttentionType.DECODER,)
    supported_features = (
        "sink", "sliding_window", "alibi", "logits_soft_cap", "non_causal",
        "per_head_quant_scales", "lse",
    )  # fmt: skip
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "TRITON"

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TritonAttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # Any multiple of 8 up to 256: the kernel pads the head to a power of two with masks.
        return list(range(8, 257, 8))

    @classmethod
    def supports_compute_capability(cls, capability: tuple[int, int]) -> bool:
        return capability >= (8, 0)

    @classmethod
    def supports_combination(cls, config, device: DeviceInfo) -> str | None:
        capability = device.capability
        if config.kv_cache_dtype in ("fp8", "fp8_e4m3") and capability and capability < (8, 9):
            return "fp8 e4m3 KV cache needs compute capability >= 8.9 (Triton's e4m3 casts)"
        return None

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed: pip install 'anyattn[triton]'"
        return None


class TritonAttentionImpl(AttentionImpl[TritonAttentionMetadata]):
    """The TRITON backend's forward: one `unified_attention` launch per layer and step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._alibi_slopes = self.alibi_slopes
        self._sinks = None if self.sinks is None else self.sinks.detach().float()
        self._has_tma: bool | None = None

    def _on(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """ALiBi slopes and sinks on `device` (moved once, then kept)."""
        if self._alibi_slopes is not None and self._alibi_slopes.device != device:
            self._alibi_slopes = self._alibi_slopes.to(device)
        if self._sinks is not None and self._sinks.device != device:
            self._sinks = self._sinks.to(device)
        return self._alibi_slopes, self._sinks

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `AttentionImpl.forward`. Writes `output[:num_actual_tokens]` (and `output_lse`)."""
        md = attn_metadata
        check_layer_planned(md.layer_names, layer, _API)
        check_forward(self, query, key, value, kv_cache, md, output, output_lse)
        if md.num_actual_tokens == 0:
            return output
        alibi_slopes, sinks = self._on(query.device)
        k_scale = v_scale = None
        if kv_cache.element_size() == 1:
            k_scale, v_scale = (
                layer_kv_scale(_API, layer, name, self.num_kv_heads, query.device)
                for name in ("k_scale", "v_scale")
            )
        params = UnifiedAttentionParams(
            scale=self.scale,
            causal=md.causal,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        n = md.num_actual_tokens
        from_input = md.is_fresh_prefill and self._can_read_input(query, key, value, kv_cache)
        # Views of the real rows: padding rows are neither read nor written.
        unified_attention(
            query[:n], kv_cache, output[:n], md.query_start_loc, md.seq_lens, md.block_table,
            md.num_reqs, md.max_query_len, params,
            output_lse=None if output_lse is None else output_lse[:, :n],
            num_splits=md.num_splits, workspace=md.workspace,
            key=key[:n] if from_input else None, value=value[:n] if from_input else None,
        )  # fmt: skip
        return output

    def _can_read_input(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
    ) -> bool:
        """Whether a fresh prefill may read the new K/V through TMA: they equal what was cached
        (own cache of the model dtype), Hopper or newer, and TMA's alignment rules hold."""
        if key is None or value is None or not query.is_cuda:
            return False
        if torch.cuda.is_current_stream_capturing():
            return False  # a graph replays over batches with context
        if self.kv_sharing_target_layer_name is not None or kv_cache.dtype != query.dtype:
            return False
        if self.head_size & (self.head_size - 1) or self.head_size < 16:
            return False
        if self._has_tma is None:
            self._has_tma = torch.version.hip is None and (
                torch.cuda.get_device_capability(query.device) >= (9, 0)
            )
        return self._has_tma and all(
            x.stride(2) == 1
            and x.stride(1) == self.head_size
            and (x.stride(0) * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0
            for x in (key, value)
        )

    def validate_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: TritonAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `AttentionImpl.validate_inputs`; shapes, dtypes and devices of every input."""
        check_forward_inputs(_API, self, query, key, value, kv_cache, md, TritonAttentionMetadata,
                             output=output, output_lse=output_lse)  # fmt: skip


TritonAttentionImpl.backend = TritonAttentionBackend
TritonAttentionMetadataBuilder.backend = TritonAttentionBackend
