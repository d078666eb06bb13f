"""FLASHINFER_MLA's plan: FlashInfer's wrappers planned in `build`, on top of the shared MLA plan.

`build` extends `MLAMetadata` (docs/mla.md) with planned FlashInfer wrappers, one set per
distinct `(num_heads, scale)` among the builder's layers (a wrapper holds one plan):

- Decode rows: one `flashinfer.mla.BatchMLAPagedAttentionWrapper`, planned from CSR metadata
  (one query row per decode token; its request's pages and length) with the query as a split
  pair `(q_latent, q_pe)` and the latent cache packed (`[c_kv, k_pe]` rows, the cache itself),
  LSE in natural base.
- Prefill rows: `BatchPrefillWithRaggedKVCacheWrapper`s over up-projected keys and values
  (`P + R` for queries and keys, `Vd` for values), one for the new tokens (causal) and one per
  run of consecutive requests in each context chunk (not causal; a request whose context the
  chunk does not hold is left out, so that no launch has a request without keys), LSE in
  natural base for the merges.

Index tensors come from the CPU mirrors; the page ids are gathered on the device, so `build`
never waits for the device. Every plan records the build that made it; a forward on metadata
whose wrappers have been planned since is refused (`flashinfer_metadata.LayerPlan` does the
same for FLASHINFER). CUDA graphs: not declared (`AttentionCGSupport.NEVER`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from anyattn.backends.flashinfer_builder import WORKSPACE_BYTES
from anyattn.backends.flashinfer_metadata import WrapperSlot, check_plans_current
from anyattn.backends.flashinfer_plan import gather_pages
from anyattn.backends.flashinfer_version import import_flashinfer
from anyattn.backends.mla_builder import MLAMetadataBuilder
from anyattn.backends.mla_metadata import MLAMetadata, MLAPrefillMetadata, extend_metadata
from anyattn.config import BatchLimits, MLAAttentionSpec
from anyattn.layer_params import LayerParams
from anyattn.metadata import CommonAttentionMetadata
from anyattn.types import AttentionCGSupport

__all__ = [
    "FlashInferMLAMetadata",
    "FlashInferMLAMetadataBuilder",
    "MLAWrapperPlan",
    "RaggedLaunch",
]


@dataclass(frozen=True)
class RaggedLaunch:
    """One planned ragged prefill launch.

    Attributes:
        wrapper: the planned `BatchPrefillWithRaggedKVCacheWrapper`.
        q_start, q_end: the prefill rows (from the first prefill row) it computes.
        causal: the new tokens among themselves (True) or a context chunk's rows (False).
        key_start, key_end: its key rows in the chunk (all new tokens for the causal launch).
    """

    wrapper: Any
    q_start: int
    q_end: int
    causal: bool
    key_start: int
    key_end: int


@dataclass(frozen=True)
class MLAWrapperPlan:
    """What the layers of one `(num_heads, scale)` run for one step.

    Attributes:
        decode: the planned MLA wrapper, or None (no decode rows).
        new_tokens: the causal launch over the new prefill tokens, or None (no prefill rows).
        chunks: per context chunk (in `prefill.chunks` order), its launches.
        generation: the build that planned them.
    """

    decode: Any
    new_tokens: RaggedLaunch | None
    chunks: tuple[tuple[RaggedLaunch, ...], ...]
    generation: int
    slots: tuple[WrapperSlot, ...] = field(repr=False)

    def check_current(self, api: str) -> None:
        """Raises `RuntimeError` when a later build has planned these wrappers again."""
        check_plans_current(api, self.generation, self.slots)


@dataclass(frozen=True)
class FlashInferMLAMetadata(MLAMetadata):
    """`MLAMetadata` plus each layer's planned wrappers (`plans`, by layer name) and the
    decode LSE scratch buffer (float32, flat, at least `num_decode_tokens * num_heads`)."""

    plans: Mapping[str, MLAWrapperPlan] = field(default_factory=dict, repr=False)
    decode_lse: torch.Tensor | None = None


class FlashInferMLAMetadataBuilder(MLAMetadataBuilder):
    """Plans a FLASHINFER_MLA step from the CPU mirrors; never syncs with the device."""

    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: MLAAttentionSpec,
        layers: Mapping[str, LayerParams],
        limits: BatchLimits,
        device: torch.device,
    ) -> None:
        """See `MLAMetadataBuilder`. Wrappers and buffers are made on first use."""
        super().__init__(kv_cache_spec, layers, limits, device)
        self._records = {name: (p.num_heads, p.scale) for name, p in self.layers.items()}
        self._max_heads = max((p.num_heads for p in self.layers.values()), default=1)
        self._decode_slots: dict[tuple[int, float], WrapperSlot] = {}
        self._ragged_slots: dict[tuple[int, float], list[WrapperSlot]] = {}
        self._workspace: torch.Tensor | None = None
        self._decode_lse: torch.Tensor | None = None
        self._generation = 0

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashInferMLAMetadata:
        """The step's `FlashInferMLAMetadata` (see the module docstring)."""
        base = super().build(common_prefix_len, common_attn_metadata)
        self._generation += 1
        cm = common_attn_metadata
        decode_csr = self._decode_csr(cm, base) if base.decode is not None else None
        launches = self._launch_rows(base.prefill) if base.prefill is not None else None
        plans: dict[tuple[int, float], MLAWrapperPlan] = {}
        for key in dict.fromkeys(self._records.values()):
            plans[key] = self._plan_record(key, decode_csr, base.prefill, launches)
        decode_lse = self._lse_buffer() if base.decode is not None else None
        by_layer = {name: plans[key] for name, key in self._records.items()}
        return extend_metadata(base, FlashInferMLAMetadata, plans=by_layer, decode_lse=decode_lse)

    def _decode_csr(self, cm: CommonAttentionMetadata, base: MLAMetadata) -> tuple:
        """`(qo_indptr, kv_indptr, kv_indices, kv_len)` of the decode rows: int32, the page ids
        gathered on the device, the rest on the CPU."""
        decode = base.decode
        assert decode is not None
        seq_lens = decode.seq_lens_cpu.numpy().astype(np.int64)
        block_size = self.kv_cache_spec.block_size
        pages = (seq_lens + block_size - 1) // block_size
        kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(pages, out=kv_indptr[1:])
        indices = gather_pages(decode.block_table, 0, pages, kv_indptr, int(kv_indptr[-1]))
        qo_indptr = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
        return qo_indptr, torch.from_numpy(kv_indptr), indices, decode.seq_lens_cpu

    @staticmethod
    def _launch_rows(pre: MLAPrefillMetadata) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """Per context chunk, its launches' `(qo_indptr, kv_indptr)` (int64, from 0): one per
        run of consecutive prefill requests with rows in the chunk."""
        loc = pre.query_start_loc_cpu.numpy().astype(np.int64)
        out = []
        for chunk in pre.chunks:
            runs: list[list[Any]] = []
            for piece in chunk.pieces:
                if runs and runs[-1][-1].request + 1 == piece.request:
                    runs[-1].append(piece)
                else:
                    runs.append([piece])
            launches = []
            for run in runs:
                first, last = run[0].request, run[-1].request
                qo = loc[first : last + 2]
                kv = np.array([run[0].row_start] + [p.row_start + p.row_len for p in run])
                launches.append((qo, kv))
            out.append(launches)
        return out

    def _plan_record(
        self,
        key: tuple[int, float],
        decode_csr: tuple | None,
        pre: MLAPrefillMetadata | None,
        launches: list[list[tuple[np.ndarray, np.ndarray]]] | None,
    ) -> MLAWrapperPlan:
        """The wrappers of layers with `(num_heads, scale) = key`, planned for this build."""
        num_heads, scale = key
        spec = self.kv_cache_spec
        used: list[WrapperSlot] = []
        decode = None
        if decode_csr is not None:
            slot = self._decode_slot(key)
            metadata = import_flashinfer().mla.MLAPlanMetadata.csr(*decode_csr)
            self._planned(slot, metadata=metadata, num_heads=num_heads,
                          head_dim_ckv=spec.kv_lora_rank, head_dim_kpe=spec.qk_rope_head_dim,
                          page_size=spec.block_size, causal=False, sm_scale=scale,
                          q_data_type=spec.dtype, kv_data_type=spec.cache_dtype,
                          query_layout="split", kv_cache_layout="packed",
                          lse_mode="basee")  # fmt: skip
            decode = slot.obj
            used.append(slot)
        new_tokens, chunks = None, []
        if pre is not None and launches is not None:
            pool = self._ragged_pool(key, 1 + sum(len(c) for c in launches))
            used += pool
            loc = pre.query_start_loc_cpu.numpy().astype(np.int64)
            new_tokens = self._ragged(pool[0], key, loc, loc, causal=True)
            slots = iter(pool[1:])
            for chunk_launches in launches:
                chunks.append(tuple(self._ragged(next(slots), key, qo, kv, causal=False)
                                    for qo, kv in chunk_launches))  # fmt: skip
        return MLAWrapperPlan(decode, new_tokens, tuple(chunks), self._generation, tuple(used))

    def _ragged(
        self, slot: WrapperSlot, key: tuple[int, float], qo: np.ndarray, kv: np.ndarray,
        causal: bool,
    ) -> RaggedLaunch:  # fmt: skip
        """`slot`'s ragged wrapper planned for queries `qo` (prefill rows) over keys `kv`."""
        num_heads, scale = key
        spec = self.kv_cache_spec
        qo_indptr = torch.from_numpy((qo - qo[0]).astype(np.int32))
        kv_indptr = torch.from_numpy((kv - kv[0]).astype(np.int32))
        self._planned(slot, qo_indptr, kv_indptr, num_heads, num_heads,
                      spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim,
                      causal=causal, sm_scale=scale, q_data_type=spec.dtype,
                      kv_data_type=spec.dtype, non_blocking=True)  # fmt: skip
        return RaggedLaunch(slot.obj, int(qo[0]), int(qo[-1]), causal, int(kv[0]), int(kv[-1]))

    def _planned(self, slot: WrapperSlot, *args: Any, **kwargs: Any) -> None:
        slot.plan(self._generation, self.device, *args, **kwargs)

    def _decode_slot(self, key: tuple[int, float]) -> WrapperSlot:
        slot = self._decode_slots.get(key)
        if slot is None:
            wrapper = import_flashinfer().mla.BatchMLAPagedAttentionWrapper(self._space())
            slot = self._decode_slots[key] = WrapperSlot(wrapper)
        return slot

    def _ragged_pool(self, key: tuple[int, float], count: int) -> list[WrapperSlot]:
        """`count` ragged wrappers for `key` (the pool grows to the most a step needed)."""
        pool = self._ragged_slots.setdefault(key, [])
        while len(pool) < count:
            wrapper = import_flashinfer().BatchPrefillWithRaggedKVCacheWrapper(self._space(), "NHD")
            pool.append(WrapperSlot(wrapper))
        return pool[:count]

    def _space(self) -> torch.Tensor:
        if self._workspace is None:
            # FlashInfer asks for a zeroed buffer on first use.
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _lse_buffer(self) -> torch.Tensor:
        """float32 `[max_num_reqs * max heads]`, flat: the decode LSEs the MLA wrapper writes
        (its plan asks for them, so that a layer may ask for the LSE on any step)."""
        if self._decode_lse is None:
            size = max(self.limits.max_num_reqs, 1) * self._max_heads
            self._decode_lse = torch.empty(size, dtype=torch.float32, device=self.device)
        return self._decode_lse
