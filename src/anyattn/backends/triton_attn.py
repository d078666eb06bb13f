"""TRITON: our own paged-attention kernels, for any NVIDIA GPU that runs Triton.

The whole step (decodes, fresh prefills, chunked prefills with context) is one launch of
`anyattn.ops.unified_attention`, reading K/V from the paged cache in NHD or HND layout with
GQA packing; decode batches too small to fill the GPU split each request's keys across programs
(flash-decoding) and merge the splits in a second launch. Features: causal and non-causal,
sliding window, ALiBi, soft cap, sinks, fp8 KV with per-tensor or per-KV-head scales, LSE.

Plan/run split: `build` reads only the CPU mirrors (to pick the tile shape and the number of
KV splits) and hands the kernel views of the common metadata's device tensors, so it never
waits on the GPU. CUDA graphs: ALWAYS. The launch depends only on tensor sizes and the
builder's choices, never on device values; the kernel finds each program's request on the GPU
from `query_start_loc`, so a graph captured for a batch shape replays correctly for any
contents of that shape (the split-KV workspace is builder-owned; the eager warm-up step before
capture sizes it, and it refuses to grow during capture).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from anyattn.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    check_layer_planned,
)
from anyattn.metadata import CommonAttentionMetadata
from anyattn.ops.unified_attention import (
    UnifiedAttentionParams,
    split_kv_workspace_shape,
    unified_attention,
)
from anyattn.types import AttentionCGSupport, AttentionType, DeviceInfo, KVCacheLayout
from anyattn.validation import check_forward, check_forward_inputs, layer_kv_scale

__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
]

_API = "TRITON forward"
# Split-KV: aim for this many programs on the GPU, at most this many splits, and at least
# this many keys per split (measured on the H200: 8 x 32768 is best at 4 splits, 64 x 4096 at
# one; see benchmarks/RESULTS.md).
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 16
_MIN_KEYS_PER_SPLIT = 1024
# Decode batches up to this many tokens may split (the workspace is sized for them).
_MAX_SPLIT_TOKENS = 256
# Fresh prefills read the new K/V through TMA rather than gathering pages (Hopper+).
_TMA_INPUTS = True


class TritonAttentionBackend(AttentionBackend):
    """Declarations of the TRITON backend."""

    priority: ClassVar[Mapping[str, int]] = {"cuda": 2, "blackwell": 2}

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cuda",)
    supported_attn_types = (AttentionType.DECODER,)
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
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Both run at the same speed on the H200 (benchmarks/RESULTS.md); NHD is what
        # FlashInfer and FlashAttention use, so caches can be shared with them.
        return (KVCacheLayout.NHD, KVCacheLayout.HND)

    @classmethod
    def supports_compute_capability(cls, capability: tuple[int, int]) -> bool:
        return capability >= (8, 0)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_alibi(cls) -> bool:
        return True

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True

    @classmethod
    def supports_lse(cls) -> bool:
        return True

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


class SplitWorkspace:
    """The float32 buffers of split-KV partial results, owned by the builder and shared by
    every layer; made by the first `build` that splits, sized for the builder's layers. Grown
    outside graph capture only (the runner's warm-up runs first)."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.device = device
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, num_heads: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(partial_out, partial_lse)` for `max_tokens` rows and `_MAX_SPLITS` splits."""
        out_shape, lse_shape = split_kv_workspace_shape(
            self.max_tokens, num_heads, head_size, _MAX_SPLITS
        )
        bufs = self._buffers
        if bufs is not None and all(
            have >= need for have, need in zip(bufs[0].shape, out_shape, strict=True)
        ):
            return bufs  # the kernel indexes through strides: a larger buffer serves too
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "TRITON forward: the split-KV workspace must grow during CUDA-graph capture "
                f"(got {num_heads} heads x {head_size}); run one eager step of each captured "
                "shape first (the engine's warm-up does)."
            )
        if bufs is not None:  # layers with other head counts share the group: cover both
            out_shape = tuple(map(max, out_shape, bufs[0].shape))
            lse_shape = out_shape[:3]
        bufs = self._buffers = (
            torch.empty(out_shape, dtype=torch.float32, device=self.device),
            torch.empty(lse_shape, dtype=torch.float32, device=self.device),
        )
        return bufs


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """What `TritonAttentionImpl.forward` needs for one step.

    Attributes:
        num_actual_tokens: real tokens; output rows past them are untouched.
        num_reqs: requests of the launch (padding requests included).
        max_query_len: longest query (chooses the tile shape).
        block_size: tokens per block of `block_table`.
        query_start_loc: int32 `[num_reqs + 1]` (device).
        seq_lens: int32 `[num_reqs]` (device).
        block_table: int32 `[num_reqs, max_blocks]` (device).
        slot_mapping: int64 `[num_tokens]` (device).
        causal: False for bidirectional attention.
        num_splits: KV splits per request (1 = no split-KV).
        is_fresh_prefill: every request starts this step (no context): keys may be read from
            the step's new K/V instead of the pages.
        workspace: `(partial_out, partial_lse)`, the builder's split-KV buffers for every
            layer; None when `num_splits` is 1.
        kernel_path: which kernel path runs, for logs and benchmarks.
        layer_names: the builder's layers (`forward` refuses any other).
        common_attn_metadata: the step it was built from (its mirrors for the checks).
    """

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    block_size: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    num_splits: int
    is_fresh_prefill: bool
    workspace: tuple[torch.Tensor, torch.Tensor] | None
    kernel_path: str
    common_attn_metadata: CommonAttentionMetadata
    layer_names: frozenset[str]


def choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_tokens: int
) -> int:
    """KV splits for a step: more than one only for decode-like batches (one query tile per
    request) whose `num_reqs * num_kv_heads` programs leave the GPU idle, and never fewer than
    `_MIN_KEYS_PER_SPLIT` keys per split."""
    if max_query_len > 4 or num_tokens > _MAX_SPLIT_TOKENS or num_reqs == 0:
        return 1
    programs = num_reqs * num_kv_heads
    splits = 1
    while splits < _MAX_SPLITS and programs * splits < _TARGET_PROGRAMS:
        splits *= 2
    while splits > 1 and max_seq_len < splits * _MIN_KEYS_PER_SPLIT:
        splits //= 2
    return splits


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder[TritonAttentionMetadata]):
    """Plans a TRITON step from the CPU mirrors; never syncs with the device."""

    _cudagraph_support = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layers, limits, device) -> None:
        super().__init__(kv_cache_spec, layers, limits, device)
        TritonAttentionBackend.check_kv_cache_spec(kv_cache_spec, "TritonAttentionMetadataBuilder")
        max_tokens = min(limits.max_num_tokens, _MAX_SPLIT_TOKENS)
        self._workspace = SplitWorkspace(max_tokens, self.device)
        self._max_heads = max((p.num_heads for p in self.layers.values()), default=1)
        self._layer_names = frozenset(self.layer_names)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> TritonAttentionMetadata:
        cm = common_attn_metadata
        if common_prefix_len:
            raise ValueError(
                "TritonAttentionMetadataBuilder.build: cascade attention not supported (got "
                f"common_prefix_len={common_prefix_len}, expected 0); TRITON reads a shared "
                "prefix once per request from L2 instead."
            )
        return self._make(cm, cm.max_seq_len, for_capture=False)

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TritonAttentionMetadata:
        """Metadata for capture: the split choice assumes the longest sequence the engine
        allows, since the graph will replay over any lengths."""
        return self._make(common_attn_metadata, self.limits.max_model_len, for_capture=True)

    def _make(
        self, cm: CommonAttentionMetadata, max_seq_len: int, for_capture: bool
    ) -> TritonAttentionMetadata:
        num_reqs = cm.num_reqs
        splits = choose_num_splits(
            num_reqs,
            self.kv_cache_spec.num_kv_heads,
            cm.max_query_len,
            max_seq_len,
            cm.num_actual_tokens,
        )
        context = cm.num_computed_tokens_cpu[:num_reqs]
        # A graph replays over batches with context: never bake the input-K/V path into one.
        is_fresh = (
            not for_capture and num_reqs > 0 and cm.max_query_len > 1 and not bool(context.any())
        )
        path = "unified" if splits == 1 else f"unified split-kv x{splits}"
        if is_fresh:
            path += " (fresh prefill: K/V via TMA where the impl can)"
        return TritonAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=num_reqs,
            max_query_len=cm.max_query_len,
            block_size=self.kv_cache_spec.block_size,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            causal=cm.causal,
            num_splits=splits,
            is_fresh_prefill=is_fresh,
            workspace=(
                None
                if splits == 1
                else self._workspace.get(self._max_heads, self.kv_cache_spec.head_size)
            ),
            kernel_path=path,
            common_attn_metadata=cm,
            layer_names=self._layer_names,
        )


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
            k_scale = layer_kv_scale(_API, layer, "k_scale", self.num_kv_heads, query.device)
            v_scale = layer_kv_scale(_API, layer, "v_scale", self.num_kv_heads, query.device)
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
            query[:n],
            kv_cache,
            output[:n],
            md.query_start_loc,
            md.seq_lens,
            md.block_table,
            md.num_reqs,
            md.max_query_len,
            params,
            output_lse=None if output_lse is None else output_lse[:, :n],
            num_splits=md.num_splits,
            workspace=md.workspace,
            key=key[:n] if from_input else None,
            value=value[:n] if from_input else None,
        )
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
        if key is None or value is None or not query.is_cuda or not _TMA_INPUTS:
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
        check_forward_inputs(
            _API,
            self,
            TritonAttentionBackend.supported_dtypes,
            query,
            key,
            value,
            kv_cache,
            md,
            TritonAttentionMetadata,
            output=output,
            output_lse=output_lse,
        )


TritonAttentionImpl.backend = TritonAttentionBackend
