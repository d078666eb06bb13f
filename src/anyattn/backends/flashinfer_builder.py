"""FLASHINFER's metadata builder: FlashInfer's wrappers planned in `build`, per layer record.

A step (decodes first) is served by up to three runs per layer (see `flashinfer_plan`): its
leading single-token requests by `BatchDecodeWithPagedKVCacheWrapper` (tensor cores) or by the
plan-free XQA decode (`flashinfer_xqa`, per layer by `decode_kernel`); its trailing fresh
prefills by `BatchPrefillWithRaggedKVCacheWrapper` over the step's own K/V (fp8 caches: the
paged wrapper); the requests between by `BatchPrefillWithPagedKVCacheWrapper`.

What a plan depends on beyond the KV-cache spec (query heads, scale, soft cap, window) is in
the layers' records (`LayerParams`), so `build` plans one set of wrappers per distinct record.
A wrapper keeps one plan: a forward on metadata of an earlier build is refused
(`LayerPlan.check_current`). `plan()` enqueues a copy from the wrapper's page-locked buffer
without waiting, so a builder running ahead of the device waits, before planning a wrapper
again, for the event recorded after its last plan (only while the device has not reached it).

CUDA graphs: `build_for_cudagraph_capture` plans N single-token decodes into the graph decode
wrapper of size N (`use_cuda_graph`, index buffers for N requests of `max_model_len` tokens) or
copies them into the size's XQA buffers. A later decode-only step whose `slot_mapping` has N
rows is planned into the same wrapper / buffers, so the captured graph replays with the new
plan; padding rows get no keys (wrapper) or one key (XQA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from anyattn.backend import AttentionBackend, AttentionMetadataBuilder
from anyattn.backends.flashinfer_metadata import FlashInferMetadata, LayerPlan, WrapperSlot
from anyattn.backends.flashinfer_plan import (
    PagedIndex,
    first_trailing_fresh,
    num_leading_decodes,
    paged_index,
    query_indptr,
)
from anyattn.backends.flashinfer_version import import_flashinfer
from anyattn.backends.flashinfer_xqa import (
    XQA_WORKSPACE_BYTES,
    XqaGraphBuffers,
    contiguous_rows,
    xqa_decode_reason,
)
from anyattn.layer_params import LayerParams
from anyattn.metadata import CommonAttentionMetadata, HostBatch
from anyattn.types import AttentionCGSupport, AttentionType, is_fp8_cache

__all__ = ["WORKSPACE_BYTES", "FlashInferMetadataBuilder"]

# FlashInfer's recommended float workspace (split-KV partial results), shared by every wrapper
# of a builder: layers run one after another on one stream.
WORKSPACE_BYTES = 128 * 1024 * 1024


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of `device`, None off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


@dataclass(slots=True)
class _Parts:
    """A build's plan inputs every record shares (None: the part is absent or not needed)."""

    decode: PagedIndex | None = None
    paged: PagedIndex | None = None
    ragged: torch.Tensor | None = None  # query (and key) offsets, int32 CPU
    xqa: tuple[WrapperSlot | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


@dataclass(frozen=True, slots=True)
class _Step:
    """A build's inputs every record's plan shares."""

    cm: CommonAttentionMetadata
    host: HostBatch
    num_decodes: int
    cudagraph_size: int | None
    generation: int


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Plans FlashInfer's wrappers for each step, for every record in `layers` (see the module
    docstring). Assigned its backend as `backend` by `anyattn.backends.flashinfer`."""

    backend: ClassVar[type[AttentionBackend]]
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # Which kernel runs the decodes: "auto", "xqa" or "wrapper" (see flashinfer_xqa).
    decode_kernel: ClassVar[str] = "auto"

    def __init__(self, kv_cache_spec, layers, limits, device) -> None:
        super().__init__(kv_cache_spec, layers, limits, device)
        api = "FlashInferMetadataBuilder"
        self.backend.check_kv_cache_spec(kv_cache_spec, api)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        for name, record in self.layers.items():  # (the base checked heads and head size)
            if AttentionType(record.attn_type) is not AttentionType.DECODER:
                raise ValueError(
                    f"{api}: layer {name!r} is {AttentionType(record.attn_type).value} "
                    "attention; FLASHINFER serves decoder attention only."
                )
        self._records = list(dict.fromkeys(self.layers.values()))
        self._capability = device_capability(self.device)
        self._xqa_reasons = {r: self._xqa_reason(r) for r in self._records}
        self._xqa_reason(None)  # a bad decode_kernel fails here, not in a build
        self._wrappers: dict[tuple[LayerParams, str], WrapperSlot] = {}
        self._graph_sizes: set[int] = set()
        self._xqa_graph: dict[int, WrapperSlot] = {}
        self._workspace: torch.Tensor | None = None
        self._xqa_workspace: torch.Tensor | None = None
        self._generation = 0

    def xqa_reason(self, record: LayerParams) -> str | None:
        """Why `record`'s decodes run the decode wrapper rather than XQA, or None."""
        return self._xqa_reasons[record]

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashInferMetadata:
        """Plan every record's wrappers for the step (see the module docstring).

        Raises:
            ValueError: a common prefix (cascade), cross attention, a block table narrower than
                the longest request's pages.
        """
        api = "FlashInferMetadataBuilder.build"
        cm = common_attn_metadata
        if common_prefix_len:
            raise ValueError(
                f"{api}: cascade attention not supported (got common_prefix_len="
                f"{common_prefix_len}, expected 0). FLASHINFER's use_cascade_attention is False."
            )
        if cm.encoder_seq_lens_cpu is not None:
            raise ValueError(
                f"{api}: cross attention not supported (got encoder_seq_lens, expected None; "
                "FLASHINFER serves decoder attention only). Build encoder_decoder layers' steps "
                "with another backend (`anyattn explain --head-size N --attn-type "
                "encoder_decoder` lists those that support it)."
            )
        return self._build(cm, self._replay_size(cm))

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashInferMetadata:
        """Plan a batch of single-token decodes into the CUDA-graph wrappers of its size; later
        decode-only steps padded to this size (`len(slot_mapping)`) reuse them.

        Raises:
            ValueError: not single-token decodes only, or more than `max_num_reqs` of them.
        """
        cm = common_attn_metadata
        api = "FlashInferMetadataBuilder.build_for_cudagraph_capture"
        if cm.num_reqs == 0 or cm.num_actual_tokens != cm.num_reqs:
            raise ValueError(
                f"{api}: CUDA graphs capture batches of single-token decodes only (got "
                f"{cm.num_reqs} requests with {cm.num_actual_tokens} tokens)."
            )
        if cm.num_reqs > self.limits.max_num_reqs:
            raise ValueError(
                f"{api}: batch larger than the limits allow (got {cm.num_reqs} requests, "
                f"expected <= max_num_reqs {self.limits.max_num_reqs})."
            )
        self._graph_sizes.add(cm.num_reqs)
        return self._build(cm, cm.num_reqs)

    def _replay_size(self, cm: CommonAttentionMetadata) -> int | None:
        """The captured batch size a decode-only step is padded to, or None (eager)."""
        size = int(cm.slot_mapping.shape[0])
        if size not in self._graph_sizes or cm.num_reqs > size:
            return None
        return size if cm.num_actual_tokens == cm.num_reqs else None

    def _build(self, cm: CommonAttentionMetadata, cudagraph_size: int | None) -> FlashInferMetadata:
        host = cm.host_batch
        block_size = self.kv_cache_spec.block_size
        needed, width = -(-host.max_seq_len // block_size), cm.block_table_tensor.shape[1]
        if needed > width:
            raise ValueError(
                f"FlashInferMetadataBuilder.build: block_table too narrow for the longest "
                f"sequence (got {width} columns, expected >= {needed} for block_size "
                f"{block_size})."
            )
        self._generation += 1
        num_decodes = num_leading_decodes(host) if cudagraph_size is None else cm.num_reqs
        step = _Step(cm, host, num_decodes, cudagraph_size, self._generation)
        decode_rows = cudagraph_size or num_decodes
        fresh = cm.num_reqs
        if not is_fp8_cache(self.kv_cache_spec.kv_cache_dtype):
            fresh = first_trailing_fresh(host, num_decodes)
        parts = _Parts()
        if decode_rows and any(self.xqa_reason(r) is not None for r in self._records):
            parts.decode = paged_index(host, cm.block_table_tensor, block_size,
                                       (0, num_decodes), cudagraph_size)  # fmt: skip
        if decode_rows and any(self.xqa_reason(r) is None for r in self._records):
            parts.xqa = self._xqa_inputs(step)
        if num_decodes < fresh:
            parts.paged = paged_index(host, cm.block_table_tensor, block_size,
                                      (num_decodes, fresh))  # fmt: skip
        if fresh < cm.num_reqs:
            parts.ragged = query_indptr(host, (fresh, cm.num_reqs))
        by_record = {r: self._plan(r, step, parts) for r in self._records}
        spec = self.kv_cache_spec
        rows = host.query_start_loc
        return FlashInferMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            slot_mapping=cm.slot_mapping,
            causal=cm.causal,
            num_decodes=num_decodes,
            decode_rows=decode_rows,
            paged_tokens=(int(rows[num_decodes]), int(rows[fresh])),
            ragged_tokens=(int(rows[fresh]), int(rows[cm.num_reqs])),
            cudagraph_size=cudagraph_size,
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=spec.dtype,
            cache_dtype=spec.cache_dtype,
            layer_names=frozenset(self.layers),
            plans={name: by_record[record] for name, record in self.layers.items()},
            common_attn_metadata=cm,
        )

    def _plan(self, record: LayerParams, step: _Step, parts: _Parts) -> LayerPlan:
        """`record`'s wrappers planned for `step` (its XQA inputs where XQA runs its decodes)."""
        spec = self.kv_cache_spec
        window_left = record.sliding_window - 1 if record.sliding_window else -1
        common = dict(
            window_left=window_left,
            logits_soft_cap=record.logits_soft_cap or None,
            sm_scale=record.scale,
            q_data_type=spec.dtype,
            o_data_type=spec.dtype,
            non_blocking=True,
        )
        heads = (record.num_heads, spec.num_kv_heads, spec.head_size)
        slots: list[WrapperSlot] = []
        planned = dict(decode=None, ragged=None, paged=None, xqa=None)
        cache = dict(kv_data_type=spec.cache_dtype, **common)
        if parts.decode is not None and self.xqa_reason(record) is not None:
            d = parts.decode
            slot = self._decode_slot(record, step.cudagraph_size)
            self._planned(slot, step, d.kv_indptr, d.kv_indices, d.kv_last_page_len, *heads,
                          spec.block_size, **cache)  # fmt: skip
            planned["decode"] = slot.obj
            slots.append(slot)
        elif parts.xqa is not None and self.xqa_reason(record) is None:
            graph_slot, planned["xqa"] = parts.xqa
            slots.extend([graph_slot] if graph_slot is not None else [])
        if parts.paged is not None:
            p = parts.paged
            slot = self._wrapper_slot(record, "paged")
            self._planned(slot, step, p.qo_indptr, p.kv_indptr, p.kv_indices,
                          p.kv_last_page_len, *heads, spec.block_size, causal=step.cm.causal,
                          **cache)  # fmt: skip
            planned["paged"] = slot.obj
            slots.append(slot)
        if parts.ragged is not None:
            slot = self._wrapper_slot(record, "ragged")
            self._planned(slot, step, parts.ragged, parts.ragged, *heads, causal=step.cm.causal,
                          kv_data_type=spec.dtype, **common)  # fmt: skip
            planned["ragged"] = slot.obj
            slots.append(slot)
        return LayerPlan(record, **planned, window_left=window_left,
                         generation=step.generation, slots=tuple(slots))  # fmt: skip

    def _planned(self, slot: WrapperSlot, step: _Step, *args: Any, **kwargs: Any) -> None:
        """`plan(*args, **kwargs)` of `slot`'s wrapper for `step` (once per build: records
        share no wrapper)."""
        slot.plan(step.generation, self.device, *args, **kwargs)

    def _xqa_inputs(
        self, step: _Step
    ) -> tuple[WrapperSlot | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """XQA's page table and lengths for the step's decodes: the step's own rows (eager),
        or the captured size's fixed buffers with the step copied in."""
        cm, size = step.cm, step.cudagraph_size
        table, seq_lens = cm.block_table_tensor, cm.seq_lens  # int32 (checked by cm)
        if size is None:
            n = step.num_decodes
            return None, (
                contiguous_rows(table, n),
                contiguous_rows(seq_lens, n),
                self._xqa_space(),
            )
        slot = self._xqa_graph.get(size)
        if slot is None:
            max_pages = -(-self.limits.max_model_len // self.kv_cache_spec.block_size)
            buffers = XqaGraphBuffers(size, max_pages, self.device)
            slot = self._xqa_graph[size] = WrapperSlot(buffers)
        most = -(-step.host.max_seq_len // self.kv_cache_spec.block_size)
        slot.obj.fill(table, seq_lens, cm.num_reqs, most)
        slot.generation = step.generation
        return slot, (slot.obj.page_table, slot.obj.seq_lens, self._xqa_space())

    def _xqa_reason(self, record: LayerParams | None) -> str | None:
        spec = self.kv_cache_spec
        return xqa_decode_reason(
            self.decode_kernel, self._capability, spec.block_size, spec.head_size, spec.dtype,
            spec.cache_dtype, (record.logits_soft_cap or 0.0) if record else 0.0,
            record.num_heads // spec.num_kv_heads if record else None,
        )  # fmt: skip

    def _xqa_space(self) -> torch.Tensor:
        """XQA's own workspace (its semaphores must stay zeroed: no wrapper may share it)."""
        if self._xqa_workspace is None:
            self._xqa_workspace = torch.zeros(
                XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device
            )
        return self._xqa_workspace

    def _float_workspace(self) -> torch.Tensor:
        if self._workspace is None:
            # FlashInfer asks for a zeroed buffer on first use.
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _wrapper_slot(self, record: LayerParams, part: str) -> WrapperSlot:
        """`record`'s eager "decode", "paged" or "ragged" wrapper, made on first use."""
        slot = self._wrappers.get((record, part))
        if slot is None:
            fi, space = import_flashinfer(), self._float_workspace()
            # Prefills: FlashInfer's "auto" on Hopper (fa3 where it applies), else "fa2" (where
            # "auto" may pick kernels whose planning reads device memory).
            hopper = self._capability is not None and self._capability[0] == 9
            prefill = "auto" if hopper else "fa2"
            if part == "decode":
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    space, "NHD", use_tensor_cores=True, backend="fa2"
                )
            elif part == "paged":
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(space, "NHD", backend=prefill)
            else:
                wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(space, "NHD", backend=prefill)
            slot = self._wrappers[(record, part)] = WrapperSlot(wrapper)
        return slot

    def _decode_slot(self, record: LayerParams, size: int | None) -> WrapperSlot:
        """`record`'s decode wrapper: eager, or the CUDA-graph one of batch size `size`, whose
        index buffers hold `size` requests of up to `max_model_len` tokens."""
        if size is None:
            return self._wrapper_slot(record, "decode")
        slot = self._wrappers.get((record, f"graph{size}"))
        if slot is None:
            fi = import_flashinfer()
            max_pages = -(-self.limits.max_model_len // self.kv_cache_spec.block_size)
            int32 = dict(dtype=torch.int32, device=self.device)
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                self._float_workspace(),
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, **int32),
                paged_kv_indices_buffer=torch.zeros(size * max_pages, **int32),
                paged_kv_last_page_len_buffer=torch.ones(size, **int32),
                backend="fa2",
            )
            slot = self._wrappers[(record, f"graph{size}")] = WrapperSlot(wrapper)
        return slot
