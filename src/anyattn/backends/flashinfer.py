"""FLASHINFER: FlashInfer 0.7.2.post1's batch attention wrappers behind the anyattn contract.

Plan/run split, as FlashInfer's own API has it: the builder turns each step into the index
arrays FlashInfer's planners take (`flashinfer_plan.plan_step`, pure numpy on the CPU mirrors)
and calls the wrappers' `plan()` in `build`, so that `forward` only calls `run()`. Nothing in
`build` waits on the device and no per-page index is built on the host: the decode wrapper's
page offsets, last-page lengths and flat page list are made on the device from the step's
`seq_lens` and block table in one kernel launch (`ops.paged_kv_layout`), the paged prefill
wrapper's pages are gathered there from host offsets (`ops.gather_pages`). A decode wrapper
that `plan()` has set up once for a layer signature is re-planned for later steps by
`flashinfer_replan.replan_decode`, which does only the batch-dependent part of `plan()` (the
index buffers and FlashInfer's C++ planner). A decode batch at or past FlashInfer's split
limit (2 * SMs / KV heads requests) gets a schedule that depends on its size alone (eager:
`flashinfer_replan.schedule_is_fixed`; CUDA graphs of such a size are planned with
`disable_split_kv`, see `_fixed_schedule_of`): later steps of that size keep it, with no C++
planner, no page-locked buffer and no host arrays, and only get their index buffers. The
CUDA-graph decode wrappers of one size share their fixed index buffers, which each step's
layout is made into.

A step is served by up to three wrappers, decodes first:

- decodes (one query token): `BatchDecodeWithPagedKVCacheWrapper`, tensor cores on (the fa2
  prefill kernel, which serves any GQA ratio and shares its compiled module with the prefills);
  or, with no plan at all, FlashInfer's XQA decode kernel over the block table itself
  (`flashinfer_xqa`; the builder's `decode_kernel`, by default XQA for 16-bit caches with
  blocks of 64 tokens or more on SM90+, where it measured as fast as the planned decode, so
  that `build` does no FlashInfer planning for a decode step);
- fresh prefills (no context): `BatchPrefillWithRaggedKVCacheWrapper` over the step's own K/V;
- prefills with context: `BatchPrefillWithPagedKVCacheWrapper` over the paged cache.

fp8 caches send every prefill to the paged wrapper (the inputs' K/V are not what the cache
holds); so do fresh prefills that sit between prefills with context (see `split_batch`).
Non-causal steps plan both prefill wrappers with `causal=False`; a single-token decode sees
every key either way. Sliding windows of W keys are FlashInfer's `window_left = W - 1`.
Prefills use FlashInfer's own kernel choice on Hopper (fa3 where it applies) and fa2 elsewhere,
where its "auto" could pick kernels whose planning reads device memory.

What the wrappers need per layer (query heads, scale, soft cap) is not in the KV-cache spec, so
plans are kept per layer signature: a builder plans in `build` for every signature it knows.
The builder gets every layer's record at construction (`layers`), so all planning happens in
`build`. Plans are FlashInfer state: metadata is valid until the builder's
next `build`; a forward on older metadata plans again. Each plan writes its schedule into a
page-locked host buffer that the device copies from later, on the stream: every plan gets a
buffer no earlier copy still reads (`flashinfer_staging`), so a `build` may run ahead of the
device (asynchronous scheduling) without rewriting the schedule of a step not yet run.

Caches use the standard logical shape `(num_blocks, 2, block_size, num_kv_heads, head_size)`
in NHD or HND memory order: the wrappers are built for "NHD" and handed the logical view, whose
page / token / head strides FlashInfer's kernels read from the tensor.

LSEs come back in base 2 (`lse_base_on_e = False`), as FlashInfer's kernels compute them.
fp8 caches take one per-tensor `k_scale` / `v_scale` per layer: FlashInfer folds them into the
softmax scale and the output as Python floats, read once per scale tensor (one host read at the
layer's first forward; do it before capturing CUDA graphs).

Not declared, because FlashInfer 0.7.2's fa2/fa3 kernels would drop or change them: attention
sinks (their paged/ragged runs do not pass `sinks` on), ALiBi (the kernels use FlashInfer's own
slopes and measure distance from the query's row in its chunk, which changes the LSE), per-head
fp8 scales, encoder and cross attention, cascade attention. Kernels are compiled by FlashInfer's
JIT on first use of each dtype / head size / feature family (tens of seconds each).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from anyattn.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
)
from anyattn.backends.flashinfer_layouts import DecodeLayout, DecodeLayouts
from anyattn.backends.flashinfer_plan import (
    PagedArrays,
    StepArrays,
    decode_part,
    decode_step_arrays,
    plan_step,
)
from anyattn.backends.flashinfer_replan import (
    can_replan,
    keep_schedule,
    replan_decode,
    schedule_is_fixed,
)
from anyattn.backends.flashinfer_staging import PlannerStaging
from anyattn.backends.flashinfer_xqa import (
    XQA_WORKSPACE_BYTES,
    XqaGraphBuffers,
    contiguous_rows,
    run_xqa_decode,
    xqa_decode_reason,
)
from anyattn.metadata import CommonAttentionMetadata, HostBatch, first_rows
from anyattn.ops.gather_pages import gather_pages
from anyattn.ops.graph_decode_inputs import GraphDecodeInputsLaunch
from anyattn.types import (
    DTYPES,
    AttentionCGSupport,
    AttentionType,
    KVCacheLayout,
    MultipleOf,
    is_fp8_cache,
)
from anyattn.validation import check_forward, check_forward_inputs, check_metadata_type

__all__ = [
    "FlashInferBackend",
    "FlashInferImpl",
    "FlashInferMetadata",
    "FlashInferMetadataBuilder",
]

FLASHINFER_VERSION = "0.7.2.post1"
PIP_COMMAND = "pip install 'anyattn[flashinfer]'"
# FlashInfer's recommended float workspace (split-KV partial results), shared by every wrapper
# of a builder: layers run one after another on one stream.
WORKSPACE_BYTES = 128 * 1024 * 1024


def _installed_flashinfer() -> tuple[bool, str | None]:
    """Whether `flashinfer` is importable here, and its distribution's version (None when it
    has no package metadata, e.g. a source tree), without importing it."""
    if importlib.util.find_spec("flashinfer") is None:
        return False, None
    try:
        return True, importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return True, None


def _import_flashinfer() -> Any:
    import flashinfer  # optional and CUDA-only: imported when first needed

    return flashinfer


class FlashInferBackend(AttentionBackend):
    """Declarations of the FLASHINFER backend (see the module docstring)."""

    priority: ClassVar[Mapping[str, int]] = {"cuda": 1, "blackwell": 0}

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cuda",)
    supported_attn_types = (AttentionType.DECODER,)
    min_compute_capability = (8, 0)
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls() -> type[FlashInferImpl]:
        return FlashInferImpl

    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # The head dims FlashInfer 0.7.2 builds ahead of time for fa2 and fa3 (aot.py).
        return [64, 128, 256]

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        return [16, 32, 64]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.NHD, KVCacheLayout.HND)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_lse(cls) -> bool:
        return True

    @classmethod
    def supports_combination(cls, config, device) -> str | None:
        cache = config.kv_cache_dtype
        if cache in ("float16", "bfloat16") and DTYPES[cache] != config.dtype:
            return (
                f"kv_cache_dtype {cache} with dtype {str(config.dtype).removeprefix('torch.')} "
                "not supported (FlashInfer's 16-bit kernels need the cache in the model dtype)"
            )
        return None

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        importable, version = _installed_flashinfer()
        if not importable:
            return f"flashinfer is not installed; {PIP_COMMAND}"
        if version is not None and version != FLASHINFER_VERSION:
            return (
                f"flashinfer-python {version} is installed, FLASHINFER is written for "
                f"{FLASHINFER_VERSION}; {PIP_COMMAND}"
            )
        return None


@dataclass(frozen=True, slots=True)
class _PlanKey:
    """What a wrapper's plan depends on besides the step and the KV-cache spec."""

    num_heads: int
    scale: float
    logits_soft_cap: float  # 0.0: none


@dataclass
class _Planned:
    """The wrappers planned for one layer signature and one step (None: part absent)."""

    decode: Any = None
    ragged: Any = None
    paged: Any = None
    xqa: bool = False  # the decodes run XQA (`decode` is then planned only on demand)

    def wrappers(self) -> list[Any]:
        return [w for w in (self.decode, self.ragged, self.paged) if w is not None]


@dataclass
class _Step:
    """A build's plan inputs and the plans made from them (internal)."""

    builder: FlashInferMetadataBuilder
    generation: int
    # (`arrays.decode`, the decode wrapper's host arrays, is made when its C++ planner runs:
    # a batch that keeps its schedule needs only `decode_layout`, made on the device)
    arrays: StepArrays
    decode_layout: DecodeLayout | None
    paged_pages: torch.Tensor | None
    causal: bool
    cudagraph_size: int | None
    # The XQA decode's int32 page table `[rows, pages]` and sequence lengths `[rows]` (rows:
    # the decodes, or the captured size), None where XQA cannot serve this step's decodes.
    xqa: tuple[torch.Tensor, torch.Tensor] | None = None
    # What planning the decode wrapper later needs (`decode_layout` is None when every
    # registered layer's decodes run XQA): the build's validated mirrors and block table.
    host: HostBatch | None = None
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None  # int32 `[num_reqs]`, on the device
    planned: dict[_PlanKey, _Planned] = field(default_factory=dict)


@dataclass(slots=True)
class FlashInferMetadata:
    """What `FlashInferImpl.forward` needs for one step.

    Attributes:
        num_actual_tokens: real tokens; output rows past it are untouched (except the padding
            rows of a CUDA-graph decode batch, see `decode_rows`).
        slot_mapping: int64 `[num_tokens]` (device), for the cache write.
        causal: False for bidirectional attention.
        num_decodes, num_decode_tokens: the leading single-token requests.
        decode_rows: query rows the decode wrapper runs: `num_decode_tokens`, or the padded
            batch size of a CUDA-graph decode step (its padding rows are written too).
        ragged_tokens, paged_tokens: `[start, end)` token rows of the fresh prefills (ragged
            wrapper) and of the other prefills (paged wrapper).
        cudagraph_size: the captured batch size this step is planned for, or None.
        block_size, num_kv_heads, head_size, dtype, cache_dtype, window_left: the KV-cache
            spec the step was planned for (`window_left = sliding_window - 1`, -1 for none).
        common_attn_metadata: the step it was built from (its mirrors for the checks).
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    causal: bool
    num_decodes: int
    num_decode_tokens: int
    decode_rows: int
    ragged_tokens: tuple[int, int]
    paged_tokens: tuple[int, int]
    cudagraph_size: int | None
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    window_left: int
    step: _Step = field(repr=False)
    common_attn_metadata: CommonAttentionMetadata = field(repr=False)


@dataclass
class _Wrappers:
    """A layer signature's eager wrappers, made on first use."""

    decode: Any = None
    ragged: Any = None
    paged: Any = None


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Plans FlashInfer's wrappers for each step from the CPU mirrors (see the module docstring).

    CUDA graphs: `build_for_cudagraph_capture` plans a batch of N single-token decodes into
    the CUDA-graph decode wrapper of size N, whose index buffers are fixed. A later step of
    single-token decodes whose `slot_mapping` has N rows (N requests, dummies included, or
    fewer requests padded to N rows; not under `BatchLimits.has_persistent_graph_inputs`
    where XQA runs the decodes) is planned into the same wrapper, so the captured graph
    replays the new plan; FlashInfer plans it for N requests, the missing ones without keys.

    Decodes served by XQA (`decode_kernel`, see `flashinfer_xqa`) are not planned: the
    kernel takes the block table and lengths themselves, and a CUDA-graph step copies them
    into the graph's fixed buffers (`XqaGraphBuffers`), or, under
    `BatchLimits.has_persistent_graph_inputs`, has the graph read the step's own.

    Memory: each captured size N keeps its own fixed page list, `N * ceil(max_model_len /
    block_size)` int32 (and as much again for XQA's graph table where XQA layers are captured
    too). With `max_model_len` 131072 and 16-token blocks: about 34 MB per kind of buffer for
    the engine's capture sizes (powers of two up to 512: 1023 rows in all), about 545 MB for
    vLLM's (1, 2, 4, then every 8 up to 512: 16647 rows). One buffer of the largest size, viewed
    by every size, would serve as well, the writes being stream-ordered; not done yet.
    """

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # Prefill kernels: None = FlashInfer's "auto" on Hopper (fa3 where it applies), "fa2" on
    # other GPUs; or "fa2" / "fa3" / "auto" everywhere.
    prefill_backend: ClassVar[str | None] = None
    # Decode wrappers already set up by FlashInfer's plan() for their layer signature are
    # re-planned by `flashinfer_replan.replan_decode` (the batch-dependent part only).
    fast_decode_plan: ClassVar[bool] = True
    # Of those, a batch whose schedule depends on its size alone keeps the schedule while the
    # size does: no C++ planner then (eager: `flashinfer_replan.schedule_is_fixed`; CUDA
    # graphs of such a size are planned without splits, see `_fixed_schedule_of`).
    keep_fixed_schedules: ClassVar[bool] = True
    # Which kernel runs the decodes: "auto" (XQA with blocks of 64 tokens or more, where it is
    # as fast as the planned decode, else the wrapper), "xqa" (wherever it can serve the
    # layer) or "wrapper" (FlashInfer's planned decode wrapper always). See flashinfer_xqa.
    decode_kernel: ClassVar[str] = "auto"

    def __init__(self, kv_cache_spec, layers, limits, device) -> None:
        super().__init__(kv_cache_spec, layers, limits, device)
        FlashInferBackend.check_kv_cache_spec(kv_cache_spec, "FlashInferMetadataBuilder")
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        spec = kv_cache_spec
        self._cache_dtype = spec.cache_dtype
        self._allow_ragged = not is_fp8_cache(spec.kv_cache_dtype)
        self._window_left = spec.sliding_window - 1 if spec.sliding_window else -1
        self._layer_keys: dict[_PlanKey, None] = {
            _PlanKey(p.num_heads, p.scale, p.logits_soft_cap or 0.0): None
            for p in self.layers.values()
        }
        self._eager: dict[_PlanKey, _Wrappers] = {}
        self._graph: dict[tuple[_PlanKey, int], Any] = {}
        self._layouts = DecodeLayouts(
            self.device, spec.block_size, limits.max_num_reqs, self._max_pages_per_request()
        )
        # captured size -> whether its decode wrappers are planned without splits: decided at
        # its first plan and kept, as the captured graphs are (see `_fixed_schedule_of`)
        self._graph_unsplit: dict[int, bool] = {}
        self._graph_sizes: set[int] = set()
        self._planned_by: dict[int, int] = {}  # id(wrapper) -> generation of its last plan
        self._generation = 0
        self._workspace: torch.Tensor | None = None
        # Every plan gets a page-locked buffer no copy still reads (builds may run ahead).
        if self.device.type == "cuda":
            # (FlashInfer copies on the workspace device's stream, maybe not the current one)
            device = self.device
            self._staging = PlannerStaging(
                torch.cuda.Event, lambda: torch.cuda.current_stream(device)
            )
        else:
            self._staging = PlannerStaging(None)
        self._installed_version = _installed_flashinfer()[1]
        self.fast_decode_plans = 0  # decode plans made by `replan_decode` (for tests)
        # Of those, the plans that kept the last schedule, with no C++ planner (for tests):
        # a decode wrapper whose schedule depends on the batch size alone is planned again
        # only when that size changes (see `_fixed_schedule_of`).
        self.kept_decode_schedules = 0
        self._fixed_schedule: dict[int, int] = {}  # id(wrapper) -> batch size it is planned for
        self._num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else None
        )
        self._capability = (
            torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        )
        # (decode_kernel, plan key or None) -> `_xqa_reason`: a few us a build otherwise
        self._xqa_reasons: dict[tuple[str, _PlanKey | None], str | None] = {}
        self._xqa_reason(None)  # a bad decode_kernel fails here, not in a build
        self._routing: tuple[tuple[str, int], tuple[bool, bool]] | None = None
        self._xqa_workspace: torch.Tensor | None = None
        self._xqa_graph: dict[int, XqaGraphBuffers] = {}
        self._copy_inputs = GraphDecodeInputsLaunch(self.device, "FlashInferMetadataBuilder.build")
        self._xqa_filled_by: dict[int, int] = {}  # captured size -> generation of its fill
        # (captured size, plan key) whose graph decode wrapper an LSE request planned: a graph
        # captured then replays that wrapper, so every later build of the size plans it too
        self._graph_wrapper_keys: set[tuple[int, _PlanKey]] = set()
        # Query offsets of one token per request, for `replan_decode`, per batch size up to
        # max_num_reqs (larger eager batches are planned by FlashInfer's `plan()`).
        self._qo_indptrs: dict[int, dict[str, torch.Tensor]] = {}

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashInferMetadata:
        return self._build(
            common_prefix_len, common_attn_metadata, self._replay_size(common_attn_metadata)
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashInferMetadata:
        """Plan a batch of single-token decodes into the CUDA-graph wrappers of its size.

        Later decode-only steps padded to this size (`len(slot_mapping)`) reuse them (under
        `BatchLimits.has_persistent_graph_inputs` with XQA decodes, only steps of this many
        requests: see `_xqa_step_inputs`).
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
        return self._build(0, cm, cm.num_reqs)

    def _replay_size(self, cm: CommonAttentionMetadata) -> int | None:
        """The captured batch size a decode-only step is padded to, or None (eager)."""
        size = int(cm.slot_mapping.shape[0])
        if size not in self._graph_sizes or cm.num_reqs > size:
            return None
        return size if cm.num_actual_tokens == cm.num_reqs else None

    def _build(
        self, common_prefix_len: int, cm: CommonAttentionMetadata, cudagraph_size: int | None
    ) -> FlashInferMetadata:
        api = "FlashInferMetadataBuilder.build"
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
        host = cm.host_batch
        spec = self.kv_cache_spec
        xqa, wrapper_decodes = self._decode_routing()
        table = cm.block_table_tensor
        # (the decode wrapper's host arrays, its C++ planner's input, are made by the plan that
        # needs them: none where the schedule is kept)
        if host.max_query_len == 1 and cm.num_actual_tokens == cm.num_reqs:
            # single-token decodes only (the usual step): their split needs no pass over the
            # lengths (every token a request, none longer than one)
            arrays = decode_step_arrays(
                cm.num_reqs, host.max_seq_len, spec.block_size, table.shape[1], cudagraph_size
            )
        else:
            arrays = self._step_arrays(host, table, cudagraph_size, decode_arrays=False)
        num_decodes = arrays.split.num_decodes
        xqa_inputs = decode_layout = None
        if xqa and (num_decodes or cudagraph_size):
            xqa_inputs = self._xqa_inputs(cm, host, num_decodes, cudagraph_size)
        if wrapper_decodes and (num_decodes or cudagraph_size):
            decode_layout = self._decode_layout(
                table, cm.seq_lens, host, num_decodes, cudagraph_size, self._generation + 1
            )
        paged_pages = None
        if arrays.paged is not None:
            paged_pages = _gather_pages(table, arrays.paged)
        self._generation += 1
        step = _Step(
            self,
            self._generation,
            arrays,
            decode_layout,
            paged_pages,
            cm.causal,
            cudagraph_size,
            xqa_inputs,
            host,
            table,
            cm.seq_lens,
        )
        split = arrays.split
        # (positional: keywords cost a build half a microsecond; the fields' order)
        md = FlashInferMetadata(
            cm.num_actual_tokens,
            cm.slot_mapping,
            cm.causal,
            split.num_decodes,
            split.num_decode_tokens,
            cudagraph_size or split.num_decode_tokens,  # decode_rows
            split.ragged_tokens,
            split.paged_tokens,
            cudagraph_size,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_size,
            spec.dtype,
            self._cache_dtype,
            self._window_left,
            step,
            cm,
        )
        for key in self._layer_keys:
            self._plan(key, step)
        return md

    # --- plans ------------------------------------------------------------------------------

    def planned(
        self, md: FlashInferMetadata, key: _PlanKey, decode_wrapper: bool = False
    ) -> _Planned:
        """The wrappers planned for `key` and `md`'s step, planning them now if needed
        (`decode_wrapper`: the decodes' too where XQA runs them, for an LSE)."""
        step = md.step
        planned = step.planned.get(key)
        if (
            planned is not None
            and all(self._planned_by.get(id(w)) == step.generation for w in planned.wrappers())
            and (not planned.xqa or self._xqa_current(step))
            and (planned.decode is None or self._layout_current(step))
        ):
            if not (decode_wrapper and planned.xqa and planned.decode is None):
                return planned
            self._refuse_while_capturing("the decode wrapper (for an LSE) is not planned")
            self._plan_decode(key, step, planned, wrapper=True)
            self._planned_by[id(planned.decode)] = step.generation
            return planned
        self._refuse_while_capturing("this layer's wrappers are not planned")
        self._layer_keys.setdefault(key, None)
        return self._plan(key, step, decode_wrapper)

    def _refuse_while_capturing(self, what: str) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"FLASHINFER forward: {what} for the step being captured (got a layer "
                "signature, metadata or LSE request the builder has not planned). Give the "
                "builder every layer's record or run one eager step as the graph will before "
                "capturing, and capture with the metadata of the latest build."
            )

    def xqa_workspace(self) -> torch.Tensor:
        """XQA's own workspace (its semaphores must stay zeroed: no wrapper may share it)."""
        if self._xqa_workspace is None:
            self._xqa_workspace = torch.zeros(
                XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device
            )
        return self._xqa_workspace

    def _decode_routing(self) -> tuple[bool, bool]:
        """(XQA may run some layer's decodes, the decode wrapper's layout is needed) for the
        layers known now. XQA decodes need no layout; the decode wrapper's is made when a layer
        needs it (a registered one now, an unregistered one or an LSE request
        in its forward). Kept until the layers or `decode_kernel` change (microseconds of
        hashing a build otherwise); `_layer_keys` only grows, so its length says which."""
        known = (self.decode_kernel, len(self._layer_keys))
        if self._routing is not None and self._routing[0] == known:
            return self._routing[1]
        keys = self._layer_keys
        served = [self._xqa_reason(k) is None for k in keys]
        # (no registered layer yet: one learnt in its forward may use XQA)
        xqa = self._xqa_reason(None) is None and (not keys or any(served))
        routing = (xqa, not (xqa and keys and all(served)))
        self._routing = (known, routing)
        return routing

    def _xqa_reason(self, key: _PlanKey | None) -> str | None:
        """Why `key`'s decodes (None: any layer's, soft cap aside) run the wrapper, or None."""
        cached = self._xqa_reasons.get((self.decode_kernel, key), False)
        if cached is not False:
            return cached
        spec = self.kv_cache_spec
        reason = xqa_decode_reason(
            self.decode_kernel,
            self._capability,
            spec.block_size,
            spec.head_size,
            spec.dtype,
            self._cache_dtype,
            key.logits_soft_cap if key is not None else 0.0,
            key.num_heads // spec.num_kv_heads if key is not None else None,
        )
        self._xqa_reasons[(self.decode_kernel, key)] = reason
        return reason

    def _xqa_inputs(
        self,
        cm: CommonAttentionMetadata,
        host: HostBatch,
        num_decodes: int,
        cudagraph_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """XQA's page table and lengths for the step's decodes: views of the step's own (a
        copy of the table's rows if they are not contiguous), or a CUDA-graph step's fixed
        buffers filled with them."""
        table, seq_lens = cm.block_table_tensor, cm.seq_lens
        # (XQA reads both by raw pointer: a wrong dtype would read garbage page ids; the
        # table's dtype `validate` has checked)
        if seq_lens.dtype != torch.int32:
            raise ValueError(
                "FlashInferMetadataBuilder.build: block_table_tensor and seq_lens must be "
                f"int32 (got {table.dtype} and {seq_lens.dtype})."
            )
        devices = (table.device.type, seq_lens.device.type)
        if not seq_lens.is_contiguous() or devices != (self.device.type,) * 2:
            raise ValueError(
                "FlashInferMetadataBuilder.build: seq_lens must be contiguous and both on the "
                f"builder's device (got strides {seq_lens.stride()}, devices {table.device} "
                f"and {seq_lens.device}, expected {self.device})."
            )
        if cudagraph_size is None:
            return contiguous_rows(table, num_decodes), first_rows(seq_lens, num_decodes)
        if self.limits.has_persistent_graph_inputs:
            return self._xqa_step_inputs(cm, cudagraph_size)
        buffers = self._xqa_graph.get(cudagraph_size)
        if buffers is None:
            buffers = XqaGraphBuffers(
                cudagraph_size, self._max_pages_per_request(), self.device, self._copy_inputs
            )
            self._xqa_graph[cudagraph_size] = buffers
        max_pages = buffers.page_table.shape[1]
        most = self._most_pages(host)
        if most > max_pages:
            raise ValueError(
                "FlashInferMetadataBuilder.build: a CUDA-graph decode step needs more pages "
                f"per request than max_model_len allows (got {most}, expected <= {max_pages}). "
                "Keep seq_lens within BatchLimits.max_model_len."
            )
        generation = self._generation + 1  # this build's
        self._fill_xqa_graph(cudagraph_size, table, seq_lens, cm.num_reqs, generation, most)
        return buffers.page_table, buffers.seq_lens

    def _xqa_step_inputs(
        self, cm: CommonAttentionMetadata, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A CUDA-graph step's XQA inputs under `BatchLimits.has_persistent_graph_inputs`: the
        step's own table and lengths, which the runner keeps at the captured addresses (XQA
        reads them by raw pointer, so a copy, made afresh each step, would not do)."""
        api = "FlashInferMetadataBuilder.build"
        if cm.num_reqs != size:
            raise ValueError(
                f"{api}: with BatchLimits.has_persistent_graph_inputs a CUDA-graph decode step is "
                f"padded to its captured size (got {cm.num_reqs} requests for size {size}). "
                "Pad it with dummy requests, or turn has_persistent_graph_inputs off."
            )
        table = first_rows(cm.block_table_tensor, size)
        if not table.is_contiguous():
            raise ValueError(
                f"{api}: with BatchLimits.has_persistent_graph_inputs XQA reads the step's block "
                f"table in place, so its rows must be contiguous (got strides {table.stride()} "
                f"for shape {tuple(table.shape)}). Pass whole rows of the table buffer."
            )
        return table, first_rows(cm.seq_lens, size)

    def _most_pages(self, host: HostBatch) -> int:
        """Pages of the step's longest request (`validate`'s maximum)."""
        return -(-host.max_seq_len // self.kv_cache_spec.block_size)

    def _fill_xqa_graph(
        self,
        size: int,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        num_reqs: int,
        generation: int,
        most: int,
    ) -> None:
        """Copy a step's table (the columns of its longest request's `most` pages, which the
        caller has checked the table and the buffers hold) and lengths into the graph buffers
        of `size` (one device launch)."""
        self._xqa_graph[size].fill(block_table, seq_lens, num_reqs, most)
        self._xqa_filled_by[size] = generation

    def _layout_current(self, step: _Step) -> bool:
        """False when a later build has made its decode layout into the memory that holds
        `step`'s (see `flashinfer_layouts`)."""
        layout = step.decode_layout
        return layout is None or self._layouts.is_current(layout)

    def _xqa_current(self, step: _Step) -> bool:
        """False when a later build refilled the CUDA-graph buffers `step`'s XQA reads."""
        size = step.cudagraph_size
        # (the step's own tensors, under has_persistent_graph_inputs: never refilled by a build)
        return (
            size is None
            or self.limits.has_persistent_graph_inputs
            or self._xqa_filled_by.get(size) == step.generation
        )

    def _common(self, key: _PlanKey) -> dict[str, Any]:
        """The `plan()` arguments every wrapper of `key` takes alike."""
        spec = self.kv_cache_spec
        return dict(
            window_left=self._window_left,
            logits_soft_cap=key.logits_soft_cap or None,
            sm_scale=key.scale,
            q_data_type=spec.dtype,
            o_data_type=spec.dtype,
            non_blocking=True,
        )

    def _plan(self, key: _PlanKey, step: _Step, decode_wrapper: bool = False) -> _Planned:
        spec = self.kv_cache_spec
        arrays = step.arrays
        planned = _Planned()
        if arrays.split.num_decodes or step.cudagraph_size:
            self._plan_decode(key, step, planned, wrapper=decode_wrapper)
        if arrays.ragged_qo_indptr is None and arrays.paged is None:  # decodes only
            if planned.decode is not None:
                self._planned_by[id(planned.decode)] = step.generation
            step.planned[key] = planned
            return planned
        common = self._common(key)
        heads = (key.num_heads, spec.num_kv_heads, spec.head_size)
        if arrays.ragged_qo_indptr is not None:
            wrapper = self._wrappers(key, "ragged")
            self._staged_plan(
                wrapper,
                wrapper.plan,
                torch.from_numpy(arrays.ragged_qo_indptr),
                torch.from_numpy(arrays.ragged_kv_indptr),
                *heads,
                causal=step.causal,
                kv_data_type=spec.dtype,
                **common,
            )
            planned.ragged = wrapper
        if arrays.paged is not None:
            p = arrays.paged
            wrapper = self._wrappers(key, "paged")
            self._staged_plan(
                wrapper,
                wrapper.plan,
                torch.from_numpy(p.qo_indptr),
                torch.from_numpy(p.paged_kv_indptr),
                step.paged_pages,
                torch.from_numpy(p.paged_kv_last_page_len),
                *heads,
                spec.block_size,
                causal=step.causal,
                kv_data_type=self._cache_dtype,
                seq_lens=torch.from_numpy(p.seq_lens),
                **common,
            )
            planned.paged = wrapper
        for wrapper in planned.wrappers():
            self._planned_by[id(wrapper)] = step.generation
        step.planned[key] = planned
        return planned

    def _plan_decode(self, key: _PlanKey, step: _Step, planned: _Planned, wrapper: bool) -> None:
        """The decodes of `key`'s plan: XQA where it serves them (no plan, `wrapper` False),
        else the decode wrapper, re-planned by `replan_decode` where it can be."""
        size = step.cudagraph_size
        if size is not None and wrapper and self._xqa_reason(key) is None:
            self._graph_wrapper_keys.add((size, key))  # an LSE request on an XQA layer
        wrapper = wrapper or (size is not None and (size, key) in self._graph_wrapper_keys)
        if not wrapper and step.xqa is not None and self._xqa_reason(key) is None:
            if not self._xqa_current(step):  # a stale graph step: the buffers hold a later one
                host = step.host
                self._fill_xqa_graph(size, step.block_table, step.seq_lens,
                                     host.seq_lens.shape[0], step.generation,
                                     self._most_pages(host))  # fmt: skip
            planned.xqa = True
            return
        layout = self._step_decode_layout(step)
        num_reqs = layout.num_reqs
        decode = self._graph_decode(key, size) if size else self._wrappers(key, "decode")
        fixed = self._fixed_schedule_of(size, num_reqs)
        # (cleared first: a plan that fails leaves no schedule to keep)
        planned_for = self._fixed_schedule.pop(id(decode), None)
        if (
            fixed
            and planned_for == num_reqs
            and self.fast_decode_plan
            and keep_schedule(decode, layout)
        ):
            # the steady state: no C++ planner, no page-locked buffer, no host arrays
            self.kept_decode_schedules += 1
            self.fast_decode_plans += 1
            self._fixed_schedule[id(decode)] = num_reqs
            planned.decode = decode
            return
        spec = self.kv_cache_spec
        unsplit = fixed and size is not None
        if (
            self.fast_decode_plan
            and num_reqs <= self.limits.max_num_reqs
            and can_replan(decode, self._installed_version)
        ):
            replan = functools.partial(
                replan_decode,
                decode,
                layout,
                num_qo_heads=key.num_heads,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                page_size=spec.block_size,
                window_left=self._window_left,
                **self._qo_indptr(num_reqs),
            )
            self._staged_plan(decode, replan, self._decode_arrays(step), disable_split_kv=unsplit)
            self.fast_decode_plans += 1
        else:
            d = self._decode_arrays(step)
            self._staged_plan(
                decode,
                decode.plan,
                torch.from_numpy(d.paged_kv_indptr),
                layout.indices,
                torch.from_numpy(d.paged_kv_last_page_len),
                key.num_heads,
                spec.num_kv_heads,
                spec.head_size,
                spec.block_size,
                kv_data_type=self._cache_dtype,
                disable_split_kv=unsplit,
                **self._common(key),
            )
        # (kept from here on only where `keep_schedule` may serve the next step of this size)
        if fixed and can_replan(decode, self._installed_version):
            self._fixed_schedule[id(decode)] = num_reqs
        planned.decode = decode

    def _staged_plan(
        self, wrapper: Any, plan: Callable[..., object], *args: Any, **kwargs: Any
    ) -> None:
        """`plan(*args, **kwargs)` for `wrapper`, with a page-locked buffer that no earlier
        plan's copy still reads (see `flashinfer_staging`)."""
        self._staging.acquire(wrapper)
        try:
            plan(*args, **kwargs)
        finally:
            self._staging.release(wrapper)

    def _fixed_schedule_of(self, cudagraph_size: int | None, num_decodes: int) -> bool:
        """Whether the decode wrapper of a batch of `num_decodes` decodes (padded to
        `cudagraph_size`) keeps its schedule, so that its steps need no host arrays and no C++
        planner once planned.

        Eager: `_may_keep_schedule`. CUDA graphs: in graph mode FlashInfer's planner always
        runs the split path (partial results, then a merge pass), even for a batch past its
        split limit, whose keys it leaves in one chunk per request; the graph wrappers of such
        a size are planned with `disable_split_kv` instead, the same work without the merge,
        and a schedule that depends on the size alone. Decided at the size's first plan and
        kept: the captured graph runs the kernels of that plan whatever the flags are later."""
        if cudagraph_size is None:
            return self._may_keep_schedule(num_decodes)
        unsplit = self._graph_unsplit.get(cudagraph_size)
        if unsplit is None:
            unsplit = self._graph_unsplit[cudagraph_size] = self._may_keep_schedule(cudagraph_size)
        return unsplit

    def _may_keep_schedule(self, num_decodes: int) -> bool:
        """Whether a batch of `num_decodes` decodes is at or past FlashInfer's split limit
        (`schedule_is_fixed`: its planner never splits such an eager batch) with schedules
        kept (`fast_decode_plan`, `keep_fixed_schedules`)."""
        return (
            self.fast_decode_plan
            and self.keep_fixed_schedules
            and self._num_sms is not None
            and schedule_is_fixed(num_decodes, self.kv_cache_spec.num_kv_heads, self._num_sms)
        )

    def _decode_arrays(self, step: _Step) -> PagedArrays:
        """The decode wrapper's host arrays of `step` (for its C++ planner), made on first
        need."""
        arrays = step.arrays
        if arrays.decode is None:
            decode = decode_part(
                step.host.seq_lens, self.kv_cache_spec.block_size, step.block_table.shape[1],
                arrays.split.num_decodes, step.cudagraph_size,
            )  # fmt: skip
            step.arrays = dataclasses.replace(arrays, decode=decode)
        return step.arrays.decode

    def _step_decode_layout(self, step: _Step) -> DecodeLayout:
        """`step`'s decodes on the device, made now if the build left them out (every
        registered layer's decodes ran XQA) or made again if a later build has made its layout
        into the same memory (metadata planned again after a newer build): an eager step's
        into memory of its own, a CUDA-graph step's into its size's buffers (which the graph
        reads)."""
        if step.decode_layout is None or not self._layout_current(step):
            step.decode_layout = self._decode_layout(
                step.block_table, step.seq_lens, step.host, step.arrays.split.num_decodes,
                step.cudagraph_size, step.generation, own_memory=True,
            )  # fmt: skip
        return step.decode_layout

    def _decode_layout(
        self,
        table: torch.Tensor,
        seq_lens: torch.Tensor,
        host: HostBatch,
        num_decodes: int,
        cudagraph_size: int | None,
        generation: int,
        own_memory: bool = False,
    ) -> DecodeLayout:
        """The decode wrapper's page offsets, last-page lengths and pages for the step's
        `num_decodes` leading decodes (padded to `cudagraph_size`), made on the device from its
        `seq_lens` and block `table` in one kernel launch (`DecodeLayouts.make`), by the build
        of `generation`."""
        seq = host.seq_lens
        if num_decodes == seq.shape[0]:
            longest = host.max_seq_len
        else:
            longest = int(seq[:num_decodes].max()) if num_decodes else 0
        return self._layouts.make(
            table, seq_lens, num_decodes, longest, generation, cudagraph_size, own_memory
        )

    def _step_arrays(
        self,
        host: HostBatch,
        block_table: torch.Tensor,
        cudagraph_size: int | None,
        decode_arrays: bool = True,
    ) -> StepArrays:
        """`plan_step` of a validated step with this builder's settings."""
        return plan_step(
            host.query_start_loc,
            host.seq_lens,
            self.kv_cache_spec.block_size,
            block_table.shape[1],
            decode_threshold=self.reorder_batch_threshold or 1,
            allow_ragged=self._allow_ragged,
            cudagraph_num_reqs=cudagraph_size,
            decode_arrays=decode_arrays,
        )

    # --- wrappers ---------------------------------------------------------------------------

    def _qo_indptr(self, num_reqs: int) -> dict[str, torch.Tensor]:
        """`replan_decode`'s int32 `[0, 1, ..., num_reqs]`, on the host and the device (made
        once per batch size: slicing one long arange would cost microseconds every step)."""
        pair = self._qo_indptrs.get(num_reqs)
        if pair is None:
            # Made on the device: a copy from pageable host memory would block the host.
            int32 = torch.int32
            pair = {
                "qo_indptr_host": torch.arange(num_reqs + 1, dtype=int32),
                "qo_indptr_device": torch.arange(num_reqs + 1, dtype=int32, device=self.device),
            }
            self._qo_indptrs[num_reqs] = pair
        return pair

    def _float_workspace(self) -> torch.Tensor:
        if self._workspace is None:
            # FlashInfer asks for a zeroed buffer on first use.
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _prefill_kernels(self) -> str:
        if self.prefill_backend is not None:
            return self.prefill_backend
        major, _ = torch.cuda.get_device_capability(self.device)
        return "auto" if major == 9 else "fa2"

    def _wrappers(self, key: _PlanKey, part: str) -> Any:
        wrappers = self._eager.get(key)
        if wrappers is None:
            wrappers = self._eager[key] = _Wrappers()
        wrapper = getattr(wrappers, part)
        if wrapper is None:
            fi = _import_flashinfer()
            workspace = self._float_workspace()
            if part == "decode":
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=True, backend="fa2"
                )
            elif part == "ragged":
                wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(
                    workspace, "NHD", backend=self._prefill_kernels()
                )
            else:
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                    workspace, "NHD", backend=self._prefill_kernels()
                )
            self._staging.adopt(wrapper)
            setattr(wrappers, part, wrapper)
        return wrapper

    def _graph_decode(self, key: _PlanKey, size: int) -> Any:
        """The CUDA-graph decode wrapper of one batch size: index buffers sized for `size`
        requests of up to `max_model_len` tokens, fixed for the wrapper's life."""
        wrapper = self._graph.get((key, size))
        if wrapper is None:
            fi = _import_flashinfer()
            indptr, last_page_len, indices = self._layouts.graph_buffers(size)
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                self._float_workspace(),
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len,
                backend="fa2",
            )
            self._staging.adopt(wrapper)
            self._graph[(key, size)] = wrapper
        return wrapper

    def _max_pages_per_request(self) -> int:
        """Pages of a request of `max_model_len` tokens: what the CUDA-graph buffers hold per
        request."""
        return -(-self.limits.max_model_len // self.kv_cache_spec.block_size)


def _gather_pages(block_table: torch.Tensor, part: PagedArrays) -> torch.Tensor:
    """int32 `[part.num_pages]` on the table's device: the part's page ids, gathered from the
    block table on the device (no synchronisation, no per-page index from the host), never a
    view of the table: one device copy of the table's rectangle, or the part's page offsets
    copied to the device and read by `ops.gather_pages`."""
    if part.rectangle is not None:  # one device copy of the table's rectangle
        return block_table[part.rectangle].clone(memory_format=torch.contiguous_format).view(-1)
    indptr_and_last = _to_device(part.indptr_and_last, block_table.device)
    pages = torch.empty(part.num_pages, dtype=torch.int32, device=block_table.device)
    gather_pages(
        block_table,
        indptr_and_last[: part.num_real_reqs + 1],
        pages,
        num_pages=part.num_pages,
        max_pages=part.max_pages,
        first_row=part.first_row,
    )
    return pages


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """`host` on `device`, copied without the host waiting for the device."""
    tensor = torch.from_numpy(host)
    if device.type == "cuda":
        # Through pinned memory (torch's caching host allocator, which keeps the block until
        # the copy has run): from pageable memory the driver stages the copy through its own
        # buffer, which took 13-37 us of a build's host time on the H200 machine.
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    """The FLASHINFER backend's forward: runs the wrappers the builder planned for the step."""

    can_return_lse_for_decode = True
    # FlashInfer's kernels return log2-sum-exp2 of the log2e-scaled scores.
    lse_base_on_e = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plan_key = _PlanKey(self.num_heads, self.scale, self.logits_soft_cap or 0.0)
        self._scales: dict[str, tuple[tuple[int, int, int], float]] = {}

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `AttentionImpl.forward`. Writes `output[:num_actual_tokens]` (and `output_lse`,
        base 2) with up to three runs: decodes (XQA or the decode wrapper), fresh prefills,
        other prefills."""
        md = attn_metadata
        check_forward(self, query, key, value, kv_cache, md, output, output_lse)
        if md.num_actual_tokens == 0:
            return output
        want_lse = output_lse is not None
        builder = md.step.builder
        planned = builder.planned(md, self.plan_key, decode_wrapper=want_lse)
        k_scale, v_scale = self._kv_scales(layer)
        if md.decode_rows and planned.xqa and not want_lse:
            n = md.decode_rows
            run_xqa_decode(
                query[:n],
                kv_cache,
                *md.step.xqa,
                scale=self.scale,
                k_scale=k_scale,
                v_scale=v_scale,
                window_left=md.window_left,
                workspace=builder.xqa_workspace(),
                out=output[:n],
            )
        elif md.decode_rows:
            rows = (0, md.decode_rows)
            result = planned.decode.run(
                query[: rows[1]],
                kv_cache,
                k_scale=k_scale,
                v_scale=v_scale,
                out=output[: rows[1]],
                return_lse=want_lse,
            )
            _write_lse(output_lse, rows, result)
        start, end = md.ragged_tokens
        if end > start:
            fresh_key, fresh_value = self._fresh_kv(
                key, value, kv_cache, md.slot_mapping, start, end
            )
            result = planned.ragged.run(
                query[start:end],
                fresh_key,
                fresh_value,
                out=output[start:end],
                return_lse=want_lse,
            )
            _write_lse(output_lse, md.ragged_tokens, result)
        start, end = md.paged_tokens
        if end > start:
            result = planned.paged.run(
                query[start:end],
                kv_cache,
                k_scale=k_scale,
                v_scale=v_scale,
                out=output[start:end],
                return_lse=want_lse,
            )
            _write_lse(output_lse, md.paged_tokens, result)
        return output

    def _fresh_kv(
        self,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        start: int,
        end: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V rows `[start, end)` of fresh prefills: the inputs, or for a layer that reads
        another layer's cache (or gets no key) the cache rows the step wrote."""
        if key is not None and value is not None and self.kv_sharing_target_layer_name is None:
            return key[start:end], value[start:end]
        slots = slot_mapping[start:end]
        block_size = kv_cache.shape[2]
        # [m, 2, num_kv_heads, head_size]: the advanced indices lead the result
        rows = kv_cache[slots // block_size, :, slots % block_size]
        return rows[:, 0], rows[:, 1]

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        attn_metadata: object = None,
    ) -> None:
        """See `AttentionImpl.do_kv_cache_update`; an fp8 cache's scales are checked first, so
        that scales `forward` would refuse never write the cache."""
        if is_fp8_cache(self.kv_cache_dtype):
            for name in ("k_scale", "v_scale"):
                _per_tensor_scale(layer, name)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping, attn_metadata)

    def _kv_scales(self, layer: AttentionLayer) -> tuple[float | None, float | None]:
        if not is_fp8_cache(self.kv_cache_dtype):
            return None, None
        return self._scale(layer, "k_scale"), self._scale(layer, "v_scale")

    def _scale(self, layer: AttentionLayer, name: str) -> float:
        """The layer's per-tensor fp8 scale as a float (FlashInfer takes Python floats), read
        from the device once per scale tensor and kept while the tensor is unchanged."""
        scale = _per_tensor_scale(layer, name)
        identity = (id(scale), scale._version, scale.data_ptr())
        cached = self._scales.get(name)
        if cached is not None and cached[0] == identity:
            return cached[1]
        if scale.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"FLASHINFER forward: layer.{name} has not been read yet and cannot be read "
                "while a CUDA graph is being captured (got a new scale tensor). Run one eager "
                "forward before capturing."
            )
        value = float(scale.item())
        self._scales[name] = (identity, value)
        return value

    def validate_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: FlashInferMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `AttentionImpl.validate_inputs`; shapes, dtypes and the metadata's spec."""
        api = "FLASHINFER forward"
        check_metadata_type(api, md, FlashInferMetadata)
        spec = (md.num_kv_heads, md.head_size)
        if spec != (self.num_kv_heads, self.head_size):
            raise ValueError(
                f"{api}: the metadata was built for another KV-cache spec (got num_kv_heads, "
                f"head_size {spec}, expected {(self.num_kv_heads, self.head_size)})."
            )
        window_left = self.sliding_window - 1 if self.sliding_window else -1
        if window_left != md.window_left:
            raise ValueError(
                f"{api}: sliding_window differs from the KV-cache spec the step was planned for "
                f"(got {self.sliding_window}, expected {md.window_left + 1 or None}). Group "
                "layers by sliding window."
            )
        if query.dtype != md.dtype:
            raise ValueError(
                f"{api}: query dtype differs from the KV-cache spec's dtype (got {query.dtype}, "
                f"expected {md.dtype})."
            )
        check_forward_inputs(api, self, FlashInferBackend.supported_dtypes, query, key, value,
                             kv_cache, md, FlashInferMetadata, output=output,
                             output_lse=output_lse,  # graph steps run their padded rows too
                             num_rows=max(md.num_actual_tokens, md.decode_rows))  # fmt: skip
        # What the step was planned for, and what the wrappers need beyond the shared checks.
        if kv_cache.dtype != md.cache_dtype:
            raise ValueError(
                f"{api}: kv_cache dtype differs from the KV-cache spec the step was planned for "
                f"(got {kv_cache.dtype}, expected {md.cache_dtype})."
            )
        if not output.is_contiguous() or kv_cache.stride(-1) != 1:
            raise ValueError(
                f"{api}: output must be contiguous and kv_cache's head dimension too (got "
                f"strides {output.stride()} and {kv_cache.stride()}, expected "
                f"{(output.shape[1] * output.shape[2], output.shape[2], 1)} and (..., 1)). "
                "Allocate output with torch.empty and kv_cache in NHD or HND order."
            )


def _per_tensor_scale(layer: AttentionLayer, name: str) -> torch.Tensor:
    """`layer.<name>`, checked to be one per-tensor scale (no device read)."""
    scale = getattr(layer, name, None)
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(
            f"FLASHINFER forward: layer.{name} must be a float32 tensor of shape [] (got "
            f"{got}). FlashInfer takes one per-tensor scale; per-head scales are not supported."
        )
    return scale


def _write_lse(output_lse: torch.Tensor | None, rows: tuple[int, int], result: Any) -> None:
    """Copy a wrapper's base-2 LSE `[rows, num_heads]` into `output_lse[:, rows]`."""
    if output_lse is not None:
        _, lse = result
        output_lse[:, rows[0] : rows[1]].copy_(lse.t())


FlashInferImpl.backend = FlashInferBackend
