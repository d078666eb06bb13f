"""TORCH: the reference backend, in plain PyTorch, for the CPU and any CUDA GPU.

Every feature of the contract except MLA, sparse attention and bitwise batch invariance. The
builder plans the step from the CPU mirrors (a batched decode group, then one segment per other
request); `forward` gathers each group's blocks once, KV-head-major, and runs `dense_attention`.
A step of single-token decodes on a layer without score modifiers takes a shorter path to SDPA
(`plain_decode_attention`); on the CPU the builder resolves the step's slots once for every
layer's cache write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar

import torch

from anyattn.backend import AttentionBackend, AttentionImpl, AttentionLayer, check_layer_planned
from anyattn.backends.torch_attn_builder import (
    TorchAttentionMetadata,
    TorchAttentionMetadataBuilder,
)
from anyattn.ops.dense_attention import (
    DenseKV,
    PagedKV,
    ScoreMods,
    dense_attention,
    plain_decode_attention,
)
from anyattn.ops.merge_attn_states import merge_attn_states
from anyattn.ops.reshape_and_cache import write_cpu_slots
from anyattn.types import (
    ENCODER_TYPES,
    AttentionType,
    KVCacheLayout,
    cache_torch_dtype,
    is_fp8_cache,
)
from anyattn.validation import check_forward, check_forward_inputs, check_kv_write, layer_kv_scale

__all__ = [
    "TorchAttentionBackend",
    "TorchAttentionImpl",
    "TorchAttentionMetadata",
    "TorchAttentionMetadataBuilder",
]


class TorchAttentionBackend(AttentionBackend):
    """Declarations of the TORCH backend."""

    priority: ClassVar[Mapping[str, int]] = {"cpu": 0, "cuda": 4, "blackwell": 4}

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cpu", "cuda")
    supported_attn_types = tuple(AttentionType)
    supported_features = (
        "sink", "sliding_window", "alibi", "logits_soft_cap", "non_causal",
        "per_head_quant_scales", "lse", "cascade",
    )  # fmt: skip
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
        # HND first: a KV head's blocks then copy out as whole [block_size, head_size] tiles.
        return (KVCacheLayout.HND, KVCacheLayout.NHD)


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
        # Decodes of such a layer need no mask but the keys' lengths: `plain_decode_attention`.
        no_mods = all(x is None for x in (self.logits_soft_cap, self.sliding_window, slopes, sinks))
        is_plain = self.attn_type == AttentionType.DECODER and not is_fp8_cache(self.kv_cache_dtype)
        self._has_plain_decodes = is_plain and no_mods

    def _mods_on(self, device: torch.device) -> ScoreMods:
        """The score modifiers with their tensors on `device` (moved once, then kept)."""
        tensors = {"alibi_slopes": self._mods.alibi_slopes, "sinks": self._mods.sinks}
        moved = {
            k: t.to(device) for k, t in tensors.items() if t is not None and t.device != device
        }
        if moved:
            self._mods = replace(self._mods, **moved)
        return self._mods

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
        bias = md.decode_key_bias
        same_dtypes = kv_cache.dtype == query.dtype and (bias is None or bias.dtype == query.dtype)
        if self._has_plain_decodes and md.decode_is_plain and output_lse is None and same_dtypes:
            # the engine's CPU decode step, where the general path's small ops cost more than
            # their work (benchmarks/RESULTS.md, "Engine against transformers (CPU)")
            plain_decode_attention(
                query[:n], kv_cache, md.decode_block_ids, md.decode_max_seq_len,
                md.decode_key_bias, self.scale, md.workspace.get, output[:n],
            )  # fmt: skip
            return output
        run = _Run(self, query, key, value, kv_cache, md, layer)
        lse = None if output_lse is None else output_lse[:, :n]
        if not md.common_prefix_len:
            run.decodes(output, lse, first_key=0)
            run.segments(output, lse, first_key=0)
            return output
        # Cascade. Partial LSEs in float64: the merge weights amplify their rounding by |lse|.
        run.lse_dtype = torch.float64
        prefix_out, prefix_lse = self._cascade_prefix(run)
        suffix_out = torch.empty_like(query[:n])
        suffix_lse = torch.empty(self.num_heads, n, dtype=torch.float64, device=query.device)
        run.decodes(suffix_out, suffix_lse, md.common_prefix_len)
        run.segments(suffix_out, suffix_lse, md.common_prefix_len)
        merge_attn_states(output[:n], prefix_out, prefix_lse, suffix_out, suffix_lse, lse)
        return output

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        attn_metadata: object = None,
    ) -> None:
        """See `AttentionImpl.do_kv_cache_update`. On the CPU the step's own slot mapping comes
        resolved by the builder (`TorchAttentionMetadata.cpu_slots`): each layer's write is
        then one `index_put_`."""
        planned = getattr(attn_metadata, "cpu_slots", None)
        shared = self.kv_sharing_target_layer_name is not None
        if planned is None or shared or not planned.serves(slot_mapping, key.shape[0], kv_cache):
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping, attn_metadata)
            return
        args = check_kv_write(self, layer, key, value, kv_cache, slot_mapping, attn_metadata)
        write_cpu_slots(planned, key, value, kv_cache, *args)

    def _cascade_prefix(self, run: _Run) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query of the step against the shared prefix, gathered and attended once."""
        md = run.md
        k_pos = torch.arange(md.common_prefix_len, device=run.query.device)
        out, lse = dense_attention(
            run.query[: md.num_actual_tokens].unsqueeze(0), run.cache_keys(md.prefix_blocks[None]),
            md.token_positions[None], k_pos, None, run.mods,
            causal=md.causal, need_lse=True, lse_dtype=run.lse_dtype,
        )  # fmt: skip
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
        check_forward_inputs("TORCH forward", self, query, key, value, kv_cache, md,
                             TorchAttentionMetadata, output=output,
                             output_lse=output_lse)  # fmt: skip


class _Run:
    """One forward call: where keys come from, and the passes run over it. A pass over keys
    from `first_key > 0` is a cascade suffix, whose sinks the prefix pass counts."""

    def __init__(self, impl: TorchAttentionImpl, query, key, value, kv_cache, md, layer) -> None:
        self.query, self.key, self.value = query, key, value
        self.kv_cache, self.md, self.mods = kv_cache, md, impl._mods_on(query.device)
        self.lse_dtype = torch.float32
        self.encoder = impl.attn_type in ENCODER_TYPES
        self.decoder = impl.attn_type == AttentionType.DECODER  # neither encoder nor cross
        self.k_scale = self.v_scale = None
        if is_fp8_cache(impl.kv_cache_dtype) and not self.encoder:
            self.k_scale, self.v_scale = (
                layer_kv_scale("TORCH forward", layer, name, impl.num_kv_heads, query.device)
                for name in ("k_scale", "v_scale")
            )
        # A fresh prefill reads its new K/V from the inputs when they equal what was cached
        # (a cache of the model dtype; not a shared-KV layer).
        self.fresh_from_inputs = (
            key is not None
            and self.decoder
            and impl.kv_sharing_target_layer_name is None
            and cache_torch_dtype(impl.kv_cache_dtype, query.dtype) == query.dtype
        )

    def cache_keys(self, block_ids: torch.Tensor, length: int | None = None) -> PagedKV:
        """K/V of `block_ids [B, nblk]` (first `length` positions), left in the cache."""
        return PagedKV(self.kv_cache, block_ids, self.k_scale, self.v_scale,
                       self.md.workspace.get, length)  # fmt: skip

    def decodes(self, out: torch.Tensor, lse: torch.Tensor | None, first_key: int) -> None:
        """The leading decodes as one padded batch over keys `[first_key, seq_len)`."""
        md = self.md
        num_decodes = md.num_decodes
        if num_decodes == 0 or self.encoder:
            return
        first_block = first_key // md.block_size
        kv = self.cache_keys(
            md.decode_block_ids, length=md.decode_max_seq_len - first_block * md.block_size
        )
        k_pos, k_valid = md.decode_key_positions, md.decode_key_valid
        single = md.decode_is_single_token
        # Every valid key of a single query token (at its sequence's end) is causal already.
        causal = md.causal and not single
        # q: [num_decodes, Lq, H, D]
        q = self.query[:num_decodes, None] if single else self.query[md.decode_token_ids]
        o, part_lse = dense_attention(
            q, kv, md.decode_positions, k_pos, k_valid, self.mods, causal=causal,
            use_sinks=not first_key, need_lse=lse is not None, lse_dtype=self.lse_dtype,
        )  # fmt: skip
        if single:
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

    def segments(self, out: torch.Tensor, lse: torch.Tensor | None, first_key: int) -> None:
        """Every request outside the decode group, one at a time."""
        md, device, block_size = self.md, self.query.device, self.md.block_size
        causal = md.causal and self.decoder
        first_block = first_key // block_size
        for seg in md.all_segments if self.encoder else md.segments:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            if self.encoder or (self.fresh_from_inputs and seg.context == 0 and first_key == 0):
                # [q_len, KVH, D] -> [KVH, 1, q_len, D]
                kv = DenseKV(self.key[rows].transpose(0, 1)[:, None],
                             self.value[rows].transpose(0, 1)[:, None])  # fmt: skip
            else:
                last_block = -(-seg.k_len // block_size)
                kv = self.cache_keys(md.block_table[seg.row : seg.row + 1, first_block:last_block],
                                     length=seg.k_len - first_block * block_size)  # fmt: skip
            k_pos = first_key + torch.arange(kv.length, device=device)
            q_pos = (seg.context + torch.arange(seg.q_len, device=device)).unsqueeze(0)
            o, part_lse = dense_attention(
                self.query[rows].unsqueeze(0), kv, q_pos, k_pos, None, self.mods, causal=causal,
                use_sinks=not first_key, need_lse=lse is not None, lse_dtype=self.lse_dtype,
            )  # fmt: skip
            out[rows] = o[0]
            if lse is not None:
                lse[:, rows] = part_lse[0]


TorchAttentionImpl.backend = TorchAttentionBackend
TorchAttentionMetadataBuilder.backend = TorchAttentionBackend
