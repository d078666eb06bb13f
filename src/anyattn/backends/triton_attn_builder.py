"""TRITON's plan: the metadata its builder makes for a step, the number of KV splits, and the
split-KV workspace.

`build` reads only the CPU mirrors (the number of KV splits; whether a fresh prefill may read its
new K/V from the inputs) and hands the kernel the step's device tensors: a CUDA graph captured
for a batch shape replays for any contents of that shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anyattn.backend import AttentionMetadataBuilder
from anyattn.metadata import CommonAttentionMetadata
from anyattn.ops.unified_attention import split_kv_workspace_shape
from anyattn.types import AttentionCGSupport

__all__ = [
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
    "choose_num_splits",
]

# Split-KV: aim for this many programs on the GPU, at most this many splits, and at least
# this many keys per split (measured on the H200: 8 x 32768 is best at 4 splits, 64 x 4096 at
# one; see benchmarks/RESULTS.md).
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 16
_MIN_KEYS_PER_SPLIT = 1024
# Decode batches up to this many tokens may split (the workspace is sized for them).
_MAX_SPLIT_TOKENS = 256


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
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
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
            workspace=None if splits == 1 else self._split_workspace(),
            common_attn_metadata=cm,
            layer_names=self._layer_names,
        )

    def _split_workspace(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 `(partial_out, partial_lse)` every layer shares, for the layer with the
        most heads, made by the first build that splits (an eager warm-up step before capture
        makes it)."""
        if self._workspace is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "TritonAttentionMetadataBuilder: the split-KV workspace would be made during "
                    "CUDA-graph capture; run one eager step of each captured shape first (the "
                    "engine's warm-up does)."
                )
            max_tokens = min(self.limits.max_num_tokens, _MAX_SPLIT_TOKENS)
            num_heads = max((p.num_heads for p in self.layers.values()), default=1)
            shapes = split_kv_workspace_shape(
                max_tokens, num_heads, self.kv_cache_spec.head_size, _MAX_SPLITS
            )
            self._workspace = tuple(
                torch.empty(shape, dtype=torch.float32, device=self.device) for shape in shapes
            )
        return self._workspace
