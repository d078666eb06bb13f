"""TORCH: the reference backend, in plain PyTorch, for the CPU and any CUDA GPU.

Every other backend is judged against it, so it implements every feature of the contract
except MLA, sparse attention and bitwise batch invariance: paged KV over shuffled blocks, mixed
batches (decodes, fresh and chunked prefills), GQA/MQA, causal and non-causal, all four
attention types, sliding window, ALiBi, soft cap, sinks, fp8 KV with per-tensor or per-head
scales, LSE output, cascade attention and KV sharing.

Plan/run split: the builder turns the step into frozen metadata (a batched decode group with its
key positions and validity, plus one segment per other request, all from CPU mirrors, no
device sync); `forward` gathers each group's blocks once, KV-head-major, and runs
`dense_attention` (SDPA where no feature needs the explicit math). Never a Python loop over
tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from anyattn.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    check_layer_planned,
)
from anyattn.metadata import CommonAttentionMetadata, split_decodes_and_prefills
from anyattn.ops.dense_attention import DenseKV, PagedKV, ScoreMods, dense_attention
from anyattn.ops.merge_attn_states import merge_attn_states
from anyattn.types import (
    AttentionCGSupport,
    AttentionType,
    KVCacheLayout,
    cache_torch_dtype,
    is_fp8_cache,
)
from anyattn.validation import check_forward, check_forward_inputs, layer_kv_scale

__all__ = [
    "TorchAttentionBackend",
    "TorchAttentionImpl",
    "TorchAttentionMetadata",
    "TorchAttentionMetadataBuilder",
]

_ENCODER_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


class TorchAttentionBackend(AttentionBackend):
    """Declarations of the TORCH backend."""

    priority: ClassVar[Mapping[str, int]] = {"cpu": 0, "cuda": 4, "blackwell": 4}

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cpu", "cuda")
    supported_attn_types = tuple(AttentionType)
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "TORCH"

    @staticmethod
    def get_impl_cls() -> type[TorchAttentionImpl]:
        return TorchAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TorchAttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # HND first: copying one KV head's blocks out of the pages then moves whole
        # [block_size, head_size] tiles, measured 40% faster than NHD's head_size rows.
        return (KVCacheLayout.HND, KVCacheLayout.NHD)

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
    def supports_cascade(cls) -> bool:
        return True


class Workspace:
    """A buffer the builder owns and every layer's gather reuses, grown when a step needs more.

    Fresh memory for each gather costs first-touch page faults on the CPU that exceed the copy
    itself; layers run one after another, so one buffer serves them all.
    """

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
        causal: False for bidirectional attention.
        num_decodes, num_decode_tokens: the leading requests run as one batched group.
        decode_*: that group's padded layout (device): query token ids `[num_decodes, Lq]`,
            the real (request, query) cells as flat row indices and their token ids, query
            positions `[num_decodes, Lq]`, sequence lengths `[num_decodes]`;
            `decode_is_single_token` when every decode has exactly one query token.
        decode_num_blocks: block-table columns the group reads (from `prefix_blocks` on).
        decode_key_positions: int64 `[keys]` (device): positions of the keys the group reads,
            from `common_prefix_len` on.
        decode_key_valid: bool `[num_decodes, keys]` (device), or None when every decode has
            the longest length.
        segments: every other request, one by one.
        all_segments: every request as a segment (encoder attention runs them all so).
        common_prefix_len: tokens of the shared prefix run once (cascade), else 0.
        prefix_blocks: block ids of that prefix `[common_prefix_len // block_size]` (device).
        token_positions: int64 `[num_actual_tokens]` absolute position of each query (cascade).
        workspace: the builder's gather buffer, reused by every layer.
        layer_names: the builder's layers (`forward` refuses any other).
        common_attn_metadata: the step it was built from (its mirrors for the checks).
    """

    num_actual_tokens: int
    block_size: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool
    num_decodes: int
    num_decode_tokens: int
    decode_is_single_token: bool
    decode_max_seq_len: int
    decode_has_uniform_seq_len: bool
    decode_max_query_len: int
    decode_token_ids: torch.Tensor
    decode_valid_rows: torch.Tensor
    decode_valid_token_ids: torch.Tensor
    decode_positions: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_num_blocks: int
    decode_key_positions: torch.Tensor
    decode_key_valid: torch.Tensor | None
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
        TorchAttentionBackend.check_kv_cache_spec(kv_cache_spec, "TorchAttentionMetadataBuilder")
        # Decodes (and spec-decode verification runs of 1 + k tokens) go first, as one group.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self._workspace = Workspace()
        self._layer_names = frozenset(self.layer_names)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> TorchAttentionMetadata:
        cm = common_attn_metadata
        block_size = self.kv_cache_spec.block_size
        num_reqs = cm.num_reqs
        cross = cm.encoder_seq_lens_cpu is not None
        k_lens_cpu = (cm.encoder_seq_lens_cpu if cross else cm.seq_lens_cpu)[:num_reqs].long()
        needed = int((k_lens_cpu.max() + block_size - 1) // block_size) if num_reqs else 0
        if needed > cm.block_table_tensor.shape[1]:
            raise ValueError(
                f"TorchAttentionMetadataBuilder.build: block_table too narrow for the longest "
                f"sequence (got {cm.block_table_tensor.shape[1]} columns, expected >= {needed} "
                f"for block_size {block_size})."
            )
        context_cpu = cm.num_computed_tokens_cpu[:num_reqs].long()
        common_prefix_len = self._check_prefix(common_prefix_len, context_cpu, block_size, cross)
        prefix_blocks = common_prefix_len // block_size

        num_decodes = num_decode_tokens = 0
        if self.reorder_batch_threshold is not None and not cross:
            num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
                cm, self.reorder_batch_threshold
            )
        decode = self._plan_decodes(cm, num_decodes, common_prefix_len, block_size)
        loc = cm.query_start_loc_cpu[: num_reqs + 1].tolist()
        contexts = context_cpu.tolist()
        k_lens = k_lens_cpu.tolist()
        all_segments = tuple(
            Segment(r, loc[r], loc[r + 1] - loc[r], contexts[r], k_lens[r]) for r in range(num_reqs)
        )
        token_positions = None
        if common_prefix_len:
            # position of token t of request r: context_r + (t - query_start_r), on the device
            qsl = cm.query_start_loc[: num_reqs + 1].long()
            query_lens = qsl[1:] - qsl[:-1]
            req = torch.repeat_interleave(
                torch.arange(num_reqs, device=qsl.device),
                query_lens,
                output_size=cm.num_actual_tokens,
            )
            context = cm.seq_lens[:num_reqs].long() - query_lens
            token_positions = (
                context[req] + torch.arange(cm.num_actual_tokens, device=qsl.device) - qsl[req]
            )
        return TorchAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            block_size=block_size,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            causal=cm.causal,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            segments=all_segments[num_decodes:],
            all_segments=all_segments,
            common_attn_metadata=cm,
            common_prefix_len=common_prefix_len,
            prefix_blocks=cm.block_table_tensor[0, :prefix_blocks] if common_prefix_len else None,
            token_positions=token_positions,
            workspace=self._workspace,
            layer_names=self._layer_names,
            **decode,
        )

    @staticmethod
    def _check_prefix(
        common_prefix_len: int, context_cpu: torch.Tensor, block_size: int, cross: bool
    ) -> int:
        if common_prefix_len == 0:
            return 0
        api = "TorchAttentionMetadataBuilder.build"
        if cross:
            raise ValueError(
                f"{api}: cascade attention is not defined for cross-attention (got "
                f"common_prefix_len={common_prefix_len}, expected 0)."
            )
        if common_prefix_len < 0 or common_prefix_len % block_size:
            raise ValueError(
                f"{api}: common_prefix_len must be a non-negative multiple of block_size (got "
                f"{common_prefix_len}, block_size {block_size})."
            )
        min_context = int(context_cpu.min()) if context_cpu.numel() else 0
        if common_prefix_len > min_context:
            raise ValueError(
                f"{api}: common_prefix_len must lie within every request's context (got "
                f"{common_prefix_len}, shortest context {min_context})."
            )
        return common_prefix_len

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
        # Keys from the first block holding `first_key` up to the longest sequence: equal
        # lengths need no validity mask.
        first_block = first_key // block_size
        k_pos = first_key + torch.arange(max(max_seq_len - first_block * block_size, 0))
        uniform = bool(num_decodes) and bool((seq_lens == max_seq_len).all())
        k_valid = None if uniform else k_pos.unsqueeze(0) < seq_lens.unsqueeze(1)
        return {
            # one token per request: query row r is request r's, no gather needed
            "decode_is_single_token": bool(num_decodes) and bool((query_lens == 1).all()),
            # equal lengths: keys trimmed to max_seq_len need no validity mask
            "decode_max_seq_len": max_seq_len,
            "decode_has_uniform_seq_len": uniform,
            "decode_max_query_len": max_query_len,
            "decode_token_ids": token_ids.to(device, non_blocking=True),
            "decode_valid_rows": valid_rows.to(device, non_blocking=True),
            "decode_valid_token_ids": token_ids.flatten()[valid_rows].to(device, non_blocking=True),
            "decode_positions": ((seq_lens - query_lens).unsqueeze(1) + offsets).to(
                device, non_blocking=True
            ),
            "decode_seq_lens": seq_lens.to(device, non_blocking=True),
            "decode_num_blocks": max(-(-max_seq_len // block_size) - first_block, 0),
            "decode_key_positions": k_pos.to(device, non_blocking=True),
            "decode_key_valid": None if k_valid is None else k_valid.to(device, non_blocking=True),
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
        """Cascade pays off here when many requests share a long prefix: the prefix blocks are
        then gathered and attended once instead of once per request. Position-dependent score
        modifiers rule it out."""
        if use_alibi or use_sliding_window:
            return False
        return common_prefix_len >= 256 and len(query_lens) >= 8


class TorchAttentionImpl(AttentionImpl[TorchAttentionMetadata]):
    """The TORCH backend's forward; see the module docstring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        shape = (self.num_kv_heads, 1, self.num_heads // self.num_kv_heads)
        slopes, sinks = self.alibi_slopes, self.sinks
        self._mods = ScoreMods(
            scale=self.scale,
            soft_cap=self.logits_soft_cap,
            sliding_window=self.sliding_window,
            alibi_slopes=None if slopes is None else slopes.view(*shape, 1, 1),
            sinks=None if sinks is None else sinks.detach().float().view(*shape, 1),
        )

    def _mods_on(self, device: torch.device) -> ScoreMods:
        """The score modifiers with their tensors on `device` (moved once, then kept)."""
        mods = self._mods
        moved = {
            name: tensor.to(device)
            for name in ("alibi_slopes", "sinks")
            if (tensor := getattr(mods, name)) is not None and tensor.device != device
        }
        if moved:
            mods = self._mods = replace(mods, **moved)
        return mods

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: TorchAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `AttentionImpl.forward`. Writes `output[:num_actual_tokens]` (and `output_lse`)."""
        md = attn_metadata
        check_layer_planned(md.layer_names, layer, "TORCH forward")
        check_forward(self, query, key, value, kv_cache, md, output, output_lse)
        n = md.num_actual_tokens
        if n == 0:
            return output
        run = _Run(self, query, key, value, kv_cache, md, self._mods_on(query.device), layer)
        lse = None if output_lse is None else output_lse[:, :n]
        if md.common_prefix_len:
            # Partial LSEs in float64: the merge weights amplify their rounding by |lse|.
            run.lse_dtype = torch.float64
            prefix_out, prefix_lse = self._cascade_prefix(run)
            suffix_out = torch.empty_like(query[:n])
            suffix_lse = torch.empty(self.num_heads, n, dtype=torch.float64, device=query.device)
            run.decodes(suffix_out, suffix_lse, first_key=md.common_prefix_len, use_sinks=False)
            run.segments(suffix_out, suffix_lse, first_key=md.common_prefix_len, use_sinks=False)
            merge_attn_states(output[:n], prefix_out, prefix_lse, suffix_out, suffix_lse, lse)
        else:
            run.decodes(output, lse, first_key=0, use_sinks=True)
            run.segments(output, lse, first_key=0, use_sinks=True)
        return output

    def _cascade_prefix(self, run: _Run) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query of the step against the shared prefix, gathered and attended once."""
        md = run.md
        kv = run.cache_keys(md.prefix_blocks.unsqueeze(0))
        k_pos = torch.arange(md.common_prefix_len, device=run.query.device)
        out, lse = dense_attention(
            run.query[: md.num_actual_tokens].unsqueeze(0),
            kv,
            md.token_positions.unsqueeze(0),
            k_pos,
            None,
            run.mods,
            causal=md.causal,
            need_lse=True,
            lse_dtype=run.lse_dtype,
        )
        return out[0], lse[0]

    def validate_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: TorchAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `AttentionImpl.validate_inputs`; shapes, dtypes and devices of every input."""
        check_forward_inputs(
            "TORCH forward",
            self,
            TorchAttentionBackend.supported_dtypes,
            query,
            key,
            value,
            kv_cache,
            md,
            TorchAttentionMetadata,
            output=output,
            output_lse=output_lse,
            reads_cache=self.attn_type not in _ENCODER_TYPES,
        )


class _Run:
    """One forward call: where keys come from, and the decode group and segments run over it."""

    def __init__(
        self,
        impl: TorchAttentionImpl,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: TorchAttentionMetadata,
        mods: ScoreMods,
        layer: AttentionLayer,
    ) -> None:
        self.impl, self.query, self.key, self.value = impl, query, key, value
        self.kv_cache, self.md, self.mods = kv_cache, md, mods
        self.lse_dtype = torch.float32
        self.encoder = impl.attn_type in _ENCODER_TYPES
        self.cross = impl.attn_type == AttentionType.ENCODER_DECODER
        self.fp8 = is_fp8_cache(impl.kv_cache_dtype)
        self.k_scale = self.v_scale = None
        if self.fp8 and not self.encoder:
            self.k_scale = layer_kv_scale(
                "TORCH forward", layer, "k_scale", impl.num_kv_heads, query.device
            )
            self.v_scale = layer_kv_scale(
                "TORCH forward", layer, "v_scale", impl.num_kv_heads, query.device
            )
        # A fresh prefill may read its new K/V from the inputs: for a non-fp8 cache of the
        # model dtype they equal what was cached. Shared-KV layers always read the cache.
        self.fresh_from_inputs = (
            key is not None
            and impl.attn_type == AttentionType.DECODER
            and impl.kv_sharing_target_layer_name is None
            and cache_torch_dtype(impl.kv_cache_dtype, query.dtype) == query.dtype
        )

    def cache_keys(self, block_ids: torch.Tensor, length: int | None = None) -> PagedKV:
        """K/V of `block_ids [B, nblk]` (first `length` positions), left in the cache until
        the kernel loads them."""
        cache = self.kv_cache
        return PagedKV(
            cache,
            block_ids,
            self.k_scale,
            self.v_scale,
            lambda numel: self.md.workspace.get(numel, cache.dtype, cache.device),
            length,
        )

    def decodes(
        self, out: torch.Tensor, lse: torch.Tensor | None, *, first_key: int, use_sinks: bool
    ) -> None:
        """The leading decodes as one padded batch over keys `[first_key, seq_len)`."""
        md = self.md
        num_decodes = md.num_decodes
        if num_decodes == 0 or self.encoder:
            return
        first_block = first_key // md.block_size
        kv = self.cache_keys(
            md.block_table[:num_decodes, first_block : first_block + md.decode_num_blocks],
            length=md.decode_max_seq_len - first_block * md.block_size,
        )
        k_pos, k_valid = md.decode_key_positions, md.decode_key_valid
        # A single query token sits at its sequence's last position, so every valid key is
        # causal already; only multi-token (spec-decode) queries need the causal mask.
        causal = md.causal and not md.decode_is_single_token
        if md.decode_is_single_token:
            q = self.query[:num_decodes].unsqueeze(1)
        else:
            q = self.query[md.decode_token_ids]  # [num_decodes, Lq, H, D]
        o, part_lse = dense_attention(
            q, kv, md.decode_positions, k_pos, k_valid, self.mods, causal=causal,
            use_sinks=use_sinks, need_lse=lse is not None, lse_dtype=self.lse_dtype,
        )  # fmt: skip
        if md.decode_is_single_token:
            out[:num_decodes] = o[:, 0]
            if lse is not None:
                lse[:, :num_decodes] = part_lse[:, :, 0].T
            return
        # o: [num_decodes, Lq, H, D] -> rows of real queries; index tensors, no host sync
        num_heads = o.shape[2]
        rows, ids = md.decode_valid_rows, md.decode_valid_token_ids
        out[ids] = o.flatten(0, 1)[rows]
        if lse is not None:
            # part_lse: [num_decodes, H, Lq] -> [num_decodes * Lq, H]
            lse[:, ids] = part_lse.transpose(1, 2).reshape(-1, num_heads)[rows].T

    def segments(
        self, out: torch.Tensor, lse: torch.Tensor | None, *, first_key: int, use_sinks: bool
    ) -> None:
        """Every request outside the decode group, one at a time."""
        md = self.md
        device = self.query.device
        segments = md.segments if not self.encoder else md.all_segments
        for seg in segments:
            q = self.query[seg.q_start : seg.q_start + seg.q_len].unsqueeze(0)
            causal = md.causal and not self.encoder and not self.cross
            if self.encoder or (self.fresh_from_inputs and seg.context == 0 and first_key == 0):
                rows = slice(seg.q_start, seg.q_start + seg.q_len)
                # [q_len, KVH, D] -> [KVH, 1, q_len, D]
                kv = DenseKV(
                    self.key[rows].transpose(0, 1).unsqueeze(1),
                    self.value[rows].transpose(0, 1).unsqueeze(1),
                )
                k_valid = None
            else:
                first_block = first_key // md.block_size
                last_block = (seg.k_len + md.block_size - 1) // md.block_size
                kv = self.cache_keys(md.block_table[seg.row : seg.row + 1, first_block:last_block])
                k_valid = None
                if first_block * md.block_size + kv.length != seg.k_len:
                    k_valid = (
                        torch.arange(kv.length, device=device)
                        < seg.k_len - first_block * md.block_size
                    ).unsqueeze(0)
            k_pos = first_key + torch.arange(kv.length, device=device)
            q_pos = (seg.context + torch.arange(seg.q_len, device=device)).unsqueeze(0)
            o, part_lse = dense_attention(
                q, kv, q_pos, k_pos, k_valid, self.mods,
                causal=causal, use_sinks=use_sinks, need_lse=lse is not None,
                lse_dtype=self.lse_dtype,
            )  # fmt: skip
            out[seg.q_start : seg.q_start + seg.q_len] = o[0]
            if lse is not None:
                lse[:, seg.q_start : seg.q_start + seg.q_len] = part_lse[0]


TorchAttentionImpl.backend = TorchAttentionBackend
