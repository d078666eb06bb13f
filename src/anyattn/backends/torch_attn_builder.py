"""TORCH's plan, made from the CPU mirrors (no device sync): the leading decodes (and
spec-decode runs of 1 + k tokens) as one padded group, every other request as a `Segment`, for
cascade the shared prefix's blocks, on the CPU the cache write's resolved slots (`CpuSlots`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from anyattn.async_copy import to_device
from anyattn.backend import AttentionMetadataBuilder
from anyattn.metadata import CommonAttentionMetadata, split_decodes_and_prefills
from anyattn.ops.dense_attention import is_one_load
from anyattn.ops.reshape_and_cache import CpuSlots, cpu_slots
from anyattn.types import AttentionCGSupport

__all__ = ["Segment", "TorchAttentionMetadata", "TorchAttentionMetadataBuilder", "Workspace"]


class Workspace:
    """A buffer the builder owns and every layer's gather reuses, grown when a step needs more
    (fresh memory costs first-touch page faults on the CPU that exceed the copy itself)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of at least `numel` elements (contents undefined)."""
        buf = self._buffer
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffer = torch.empty(numel, dtype=dtype, device=device)
        return buf


@dataclass(frozen=True)
class Segment:
    """One request run on its own: queries `[q_start, q_start + q_len)` at positions
    `context, ...`, keys `[0, k_len)` of block-table row `row`."""

    row: int
    q_start: int
    q_len: int
    context: int
    k_len: int


@dataclass(frozen=True)
class TorchAttentionMetadata:
    """What `TorchAttentionImpl.forward` needs for one step.

    Attributes:
        num_actual_tokens: real tokens; output rows past it are untouched.
        block_size: tokens per block of `block_table`.
        block_table: int32 `[num_reqs, max_blocks]` (device).
        slot_mapping: int64 `[num_tokens]` (device).
        cpu_slots: on the CPU, `slot_mapping` resolved once for every layer's cache write.
        causal: False for bidirectional attention.
        num_decodes: the leading requests, run as one batched group.
        decode_*: that group's padded layout (device): query token ids `[num_decodes, Lq]`,
            the real (request, query) cells as flat row indices and their token ids, query
            positions `[num_decodes, Lq]`, the block-table columns it reads from
            `prefix_blocks` on (`decode_block_ids`, int64), those keys' positions, and their
            validity (bool `[num_decodes, keys]`) and additive SDPA mask (0 or -inf
            `[num_decodes, 1, 1, keys]`), both None when every decode has the longest length.
        decode_is_plain: the step is single-token decodes only, no cascade, gathered whole:
            `plain_decode_attention` serves it on a layer without score modifiers.
        segments: every other request; all_segments: every request (encoder attention).
        common_prefix_len: tokens of the shared prefix run once (cascade), else 0;
            prefix_blocks: its block ids (device); token_positions: int64
            `[num_actual_tokens]` absolute position of each query.
        workspace: the builder's gather buffer, reused by every layer.
        layer_names: the builder's layers (`forward` refuses any other).
        common_attn_metadata: the step it was built from (its mirrors for the checks).
    """

    num_actual_tokens: int
    block_size: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    cpu_slots: CpuSlots | None
    causal: bool
    num_decodes: int
    decode_is_single_token: bool
    decode_is_plain: bool
    decode_max_seq_len: int
    decode_token_ids: torch.Tensor
    decode_valid_rows: torch.Tensor
    decode_valid_token_ids: torch.Tensor
    decode_positions: torch.Tensor
    decode_block_ids: torch.Tensor
    decode_key_positions: torch.Tensor
    decode_key_valid: torch.Tensor | None
    decode_key_bias: torch.Tensor | None
    segments: tuple[Segment, ...]
    all_segments: tuple[Segment, ...]
    common_attn_metadata: CommonAttentionMetadata
    workspace: Workspace
    layer_names: frozenset[str]
    common_prefix_len: int = 0
    prefix_blocks: torch.Tensor | None = None
    token_positions: torch.Tensor | None = None


class TorchAttentionMetadataBuilder(AttentionMetadataBuilder[TorchAttentionMetadata]):
    """Plans a step for the TORCH impl from the CPU mirrors; never syncs with the device."""

    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layers, limits, device) -> None:
        super().__init__(kv_cache_spec, layers, limits, device)
        # Decodes (and spec-decode verification runs of 1 + k tokens) go first, as one group.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self._workspace = Workspace()
        self._layer_names = frozenset(self.layer_names)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> TorchAttentionMetadata:
        cm, block_size = common_attn_metadata, self.kv_cache_spec.block_size
        num_reqs = cm.num_reqs
        cross = cm.encoder_seq_lens_cpu is not None
        k_lens_cpu = (cm.encoder_seq_lens_cpu if cross else cm.seq_lens_cpu)[:num_reqs].long()
        context_cpu = cm.num_computed_tokens_cpu[:num_reqs].long()
        self._check(common_prefix_len, context_cpu, k_lens_cpu, cm.block_table_tensor, cross)
        num_decodes = 0
        if self.reorder_batch_threshold is not None and not cross:
            num_decodes, _, _, _ = split_decodes_and_prefills(cm, self.reorder_batch_threshold)
        loc = cm.query_start_loc_cpu[: num_reqs + 1].tolist()
        contexts, k_lens = context_cpu.tolist(), k_lens_cpu.tolist()
        all_segments = tuple(
            Segment(r, loc[r], loc[r + 1] - loc[r], contexts[r], k_lens[r]) for r in range(num_reqs)
        )
        prefix_blocks = token_positions = None
        if common_prefix_len:
            prefix_blocks = cm.block_table_tensor[0, : common_prefix_len // block_size]
            # position of token t of request r: context_r + (t - query_start_r)
            starts = cm.query_start_loc_cpu[:num_reqs].long()
            shift = torch.repeat_interleave(context_cpu - starts, cm.query_lens_cpu[:num_reqs])
            token_positions = to_device(shift + torch.arange(cm.num_actual_tokens), self.device)
        on_cpu = cm.slot_mapping.device.type == "cpu"
        return TorchAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            block_size=block_size,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            cpu_slots=cpu_slots(cm.slot_mapping, cm.num_actual_tokens, block_size)
            if on_cpu
            else None,
            causal=cm.causal,
            num_decodes=num_decodes,
            segments=all_segments[num_decodes:],
            all_segments=all_segments,
            common_attn_metadata=cm,
            common_prefix_len=common_prefix_len,
            prefix_blocks=prefix_blocks,
            token_positions=token_positions,
            workspace=self._workspace,
            layer_names=self._layer_names,
            **self._plan_decodes(cm, num_decodes, common_prefix_len, block_size),
        )

    def _check(self, common_prefix_len, context_cpu, k_lens_cpu, block_table, cross) -> None:
        """The block table's width and the cascade prefix, against the step's CPU mirrors."""
        n, block_size, width = (
            common_prefix_len,
            self.kv_cache_spec.block_size,
            block_table.shape[1],
        )
        needed = -(-int(k_lens_cpu.max()) // block_size) if k_lens_cpu.numel() else 0
        min_context = int(context_cpu.min()) if context_cpu.numel() else 0
        if needed > width:
            error = f"block_table too narrow for the longest sequence (got {width} columns, "
            error += f"expected >= {needed} for block_size {block_size})"
        elif n and cross:
            error = "cascade attention is not defined for cross-attention (got "
            error += f"common_prefix_len={n}, expected 0)"
        elif n < 0 or n % block_size:
            error = "common_prefix_len must be a non-negative multiple of block_size (got "
            error += f"{n}, block_size {block_size})"
        elif n > min_context:
            error = "common_prefix_len must lie within every request's context (got "
            error += f"{n}, shortest context {min_context})"
        else:
            return
        raise ValueError(f"TorchAttentionMetadataBuilder.build: {error}.")

    def _plan_decodes(
        self, cm: CommonAttentionMetadata, num_decodes: int, first_key: int, block_size: int
    ) -> dict[str, object]:
        """Padded layout of the leading decode group over keys `[first_key, seq_len)`, from
        the CPU mirrors (host-to-device copies only)."""
        device = cm.query_start_loc.device
        query_lens = cm.query_lens_cpu[:num_decodes].long()
        seq_lens = cm.seq_lens_cpu[:num_decodes].long()
        max_query_len = int(query_lens.max()) if num_decodes else 0
        max_seq_len = int(seq_lens.max()) if num_decodes else 0
        offsets = torch.arange(max_query_len)
        valid = offsets.unsqueeze(0) < query_lens.unsqueeze(1)  # [num_decodes, Lq]
        token_ids = cm.query_start_loc_cpu[:num_decodes].long().unsqueeze(1) + offsets
        token_ids = token_ids.masked_fill(~valid, 0)
        valid_rows = valid.flatten().nonzero().flatten()  # CPU tensor: no device sync
        # Keys from the block holding `first_key` to the longest sequence's end.
        first_block = first_key // block_size
        k_pos = first_key + torch.arange(max(max_seq_len - first_block * block_size, 0))
        uniform = bool(num_decodes) and bool((seq_lens == max_seq_len).all())
        k_valid = None if uniform else k_pos.unsqueeze(0) < seq_lens.unsqueeze(1)
        k_bias = None
        if k_valid is not None:
            k_bias = torch.zeros(k_valid.shape, dtype=self.kv_cache_spec.dtype)
            k_bias = k_bias.masked_fill_(~k_valid, float("-inf"))[:, None, None]
        num_blocks = max(-(-max_seq_len // block_size) - first_block, 0)
        single, spec = bool(num_decodes) and bool((query_lens == 1).all()), self.kv_cache_spec
        is_whole = is_one_load(num_decodes, max_seq_len, spec.head_size, spec.num_kv_heads)
        is_plain = single and num_decodes == cm.num_actual_tokens and not first_key and is_whole
        block_ids = cm.block_table_tensor[:num_decodes, first_block : first_block + num_blocks]
        return {
            # one token per request: query row r is request r's, no gather needed
            "decode_is_single_token": single,
            "decode_is_plain": is_plain,
            "decode_max_seq_len": max_seq_len,
            "decode_token_ids": to_device(token_ids, device),
            "decode_valid_rows": to_device(valid_rows, device),
            "decode_valid_token_ids": to_device(token_ids.flatten()[valid_rows], device),
            "decode_positions": to_device((seq_lens - query_lens).unsqueeze(1) + offsets, device),
            "decode_block_ids": block_ids.long(),
            "decode_key_positions": to_device(k_pos, device),
            "decode_key_valid": None if k_valid is None else to_device(k_valid, device),
            "decode_key_bias": None if k_bias is None else to_device(k_bias, device),
        }

    def use_cascade_attention(
        self,
        common_prefix_len: int,
        query_lens: np.ndarray,
        num_query_heads: int,
        num_kv_heads: int,
        use_alibi: bool,
        use_sliding_window: bool,
        num_sms: int,
    ) -> bool:
        """When many requests share a long prefix (gathered and attended once, not once per
        request), without position-dependent score modifiers."""
        position_free = not (use_alibi or use_sliding_window)
        return position_free and common_prefix_len >= 256 and len(query_lens) >= 8
