"""ModelRunner: lays out each step from the running requests' `InputBatch`, builds attention
metadata once per KV-cache group (`kv_cache_group.py`; a per-phase group's decodes and prefills
by their own builders, `build_by_phase`), runs the model, and returns the logits of the
requests that need a next token. On CUDA, uniform decode steps replay CUDA graphs when
every group's backend allows it (`cuda_graphs.py`); one log line says whether, or why not.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from anyattn.async_copy import to_device, to_device_all
from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.engine.cuda_graphs import (
    CudaGraphPlan,
    CudaGraphRunner,
    default_capture_sizes,
    plan_cuda_graphs,
)
from anyattn.engine.input_batch import InputBatch, StepInputs
from anyattn.engine.kv_cache_group import (
    KVCacheGroup,
    build_by_phase,
    in_kernel_blocks,
)
from anyattn.engine.sequence import PLACEHOLDER
from anyattn.kv_cache import allocate_kv_cache
from anyattn.kv_cache_sharing import KVCacheNotShareableError, SharedKVCache, plan_shared_kv_cache
from anyattn.layer import Attention
from anyattn.metadata import CommonAttentionMetadata
from anyattn.mla_layer import MLAAttention
from anyattn.types import AttentionCGSupport

logger = logging.getLogger(__name__)

# (backend, prefill backend of a per-phase group or None, KV-cache spec in kernel blocks)
GroupKey = tuple[type[AttentionBackend], type[AttentionBackend] | None, AttentionSpec]

__all__ = ["KVCacheGroup", "ModelRunner", "StepOutput"]


@dataclass
class StepOutput:
    """What one step produced: the order it ran the scheduled requests in, the requests that
    get a next token (`sample_rows`, indices into the scheduled batch), their float32 logits
    `[len(sample_rows), vocab_size]`, and the shared prefix run once by cascade (0: none)."""

    order: list[int]
    sample_rows: list[int]
    logits: torch.Tensor
    common_prefix_len: int = 0


class ModelRunner:
    """Owns the KV caches (`num_blocks` engine blocks per layer, block 0 the null block), the
    builders (given `limits`) and the CUDA graphs (`cuda_graphs` when on;
    `cuda_graph_plan.message` says why or why not); `execute` runs one scheduled step."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        limits: BatchLimits,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        # for the cascade cost model; 0 leaves out its SM-occupancy term
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 0
        )
        attention_layers = list(model.attention_layers())
        layers = {layer.layer_name: layer for layer in attention_layers}
        if len(layers) != len(attention_layers):  # two layers would share one cache
            raise ValueError(
                f"ModelRunner: attention layer names must be unique (got {len(attention_layers)} "
                f"layers under {len(layers)} names)."
            )
        specs = self._group_specs(attention_layers, kv_cache_dtype)
        self.cuda_graph_plan, self.limits = self._plan_cuda_graphs(specs, limits, enforce_eager)
        self.groups = [self._make_group(key, names, layers) for key, names in specs.items()]
        thresholds = [g.builder.reorder_batch_threshold for g in self.groups]
        for g in self.groups:
            if g.prefill_builder is not None:
                # a per-phase group splits at its decode builder's threshold, else 1
                split = g.builder.reorder_batch_threshold
                thresholds += [
                    1 if split is None else split,
                    g.prefill_builder.reorder_batch_threshold,
                ]
        known = [t for t in thresholds if t is not None]
        self.decode_threshold: int | None = min(known) if known else None
        self.kv_caches: dict[str, torch.Tensor] = {}
        for group in self.groups:
            kernel_blocks = num_blocks * (block_size // group.kernel_block_size)
            for name in group.layer_names:
                self.kv_caches[name] = allocate_kv_cache(
                    group.backend,
                    kernel_blocks,
                    group.kernel_block_size,
                    group.spec.num_kv_heads,
                    group.spec.head_size,
                    dtype,
                    kv_cache_dtype,
                    layout=group.layout,
                    device=self.device,
                )
        # per slot, the latest sampled token, which a step's reserved input tokens read
        self.last_tokens = torch.zeros(self.limits.max_num_reqs, dtype=torch.long, device=device)
        # Recorded once a step's inputs are copied: the next step rewrites pinned buffers (its
        # own and the builders') only after it, while the step itself may still be running.
        self._inputs_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.cuda_graphs: CudaGraphRunner | None = None
        if self.cuda_graph_plan.enabled:  # captured now that the caches have their addresses
            self.cuda_graphs = CudaGraphRunner(
                model,
                self.groups,
                self.kv_caches,
                plan=self.cuda_graph_plan,
                block_size=block_size,
                max_model_len=self.limits.max_model_len,
                device=self.device,
            )
            self.cuda_graphs.capture()

    def _plan_cuda_graphs(
        self,
        specs: dict[GroupKey, list[str]],
        limits: BatchLimits,
        enforce_eager: bool,
    ) -> tuple[CudaGraphPlan, BatchLimits]:
        """The plan (logged) and the builders' limits: capture sizes exactly the captured ones
        (some builders pad to them), `has_persistent_graph_inputs` when graphs are on."""
        if self.device.type == "cuda" and not limits.cudagraph_capture_sizes:
            sizes = default_capture_sizes(limits.max_num_reqs, limits.max_num_tokens)
            limits = replace(limits, cudagraph_capture_sizes=sizes)
        levels: dict[str, AttentionCGSupport] = {}
        # Graph steps are pure decodes: a per-phase group runs them on its decode backend alone.
        for backend, _, spec in specs:
            level = backend.get_builder_cls().get_cudagraph_support(spec, limits)
            name = backend.get_name()
            levels[name] = min(level, levels.get(name, level))
        model_reason = None
        if not getattr(self.model, "supports_cuda_graphs", True):
            model_reason = f"{type(self.model).__name__} steps cannot be captured"
        plan = plan_cuda_graphs(
            levels,
            device_type=self.device.type,
            enforce_eager=enforce_eager,
            limits=limits,
            model_reason=model_reason,
        )
        log_level = logging.INFO if self.device.type == "cuda" else logging.DEBUG
        logger.log(log_level, "%s", plan.message)
        captured = tuple(sorted({t for t, _ in plan.graph_keys}))
        return plan, replace(
            limits, cudagraph_capture_sizes=captured, has_persistent_graph_inputs=bool(captured)
        )

    def _group_specs(
        self, layers: list[Attention | MLAAttention], kv_cache_dtype: str
    ) -> dict[GroupKey, list[str]]:
        """(backend, prefill backend or None, spec in kernel blocks) -> layer names, in layer
        order; a per-phase layer's kernel block is the one both backends read. ValueError: a
        per-phase layer whose two backends cannot share its cache (why)."""
        by_key: dict[GroupKey, list[str]] = {}
        for layer in layers:
            prefill = getattr(layer, "prefill_backend", None)
            if prefill is None:
                kernel = layer.backend.get_kernel_block_size(self.block_size)
            else:
                kernel = self._shared_cache(layer, prefill, kv_cache_dtype).kernel_block_size
            spec = layer.kv_cache_spec(kernel, self.dtype, kv_cache_dtype)
            by_key.setdefault((layer.backend, prefill, spec), []).append(layer.layer_name)
        return by_key

    def _shared_cache(
        self, layer: Attention, prefill: type[AttentionBackend], kv_cache_dtype: str
    ) -> SharedKVCache:
        try:
            return plan_shared_kv_cache(
                (layer.backend, prefill),
                block_size=self.block_size,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_size,
                kv_cache_dtype=kv_cache_dtype,
            )
        except KVCacheNotShareableError as error:
            raise KVCacheNotShareableError(
                f"ModelRunner: layer {layer.layer_name!r} cannot run decodes on "
                f"{layer.backend.get_name()} and prefills on {prefill.get_name()}: {error} Run "
                "it on one backend."
            ) from None

    def _make_group(
        self, key: GroupKey, names: list[str], layers: dict[str, Attention | MLAAttention]
    ) -> KVCacheGroup:
        """The group of `names`: its builder(s), each made with its own impls' records."""
        backend, prefill, spec = key

        def builder(backend_cls: type[AttentionBackend], impl_attr: str) -> object:
            records = {name: getattr(layers[name], impl_attr).layer_params() for name in names}
            return backend_cls.get_builder_cls()(spec, records, self.limits, self.device)

        layout = None
        if prefill is not None:  # the layout both backends take
            layout = self._shared_cache(layers[names[0]], prefill, spec.kv_cache_dtype).layout
        return KVCacheGroup(
            backend,
            spec,
            names,
            builder(backend, "impl"),
            spec.block_size,
            max(layers[name].num_heads for name in names),
            any(layers[name].config.has_alibi for name in names),
            prefill_backend=prefill,
            prefill_builder=None if prefill is None else builder(prefill, "prefill_impl"),
            layout=layout,
        )

    @property
    def backend_names(self) -> list[str]:
        """Every backend the groups run on (both of a per-phase group)."""
        names = {g.backend.get_name() for g in self.groups}
        names |= {g.prefill_backend.get_name() for g in self.groups if g.prefill_backend}
        return sorted(names)

    def _order(self, num_new: np.ndarray) -> np.ndarray:
        """Batch order every builder accepts: decodes first (stable) when a builder asks or a
        group runs phases on different backends; the smallest threshold serves every group."""
        if self.decode_threshold is None:
            return np.arange(len(num_new))
        is_decode = num_new <= self.decode_threshold
        return np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])

    def execute(self, batch: InputBatch, slots: np.ndarray, num_new: np.ndarray) -> StepOutput:
        """Run `num_new[i]` tokens (int `[R]`) of each request `slots[i]` of `batch`, from its
        `num_computed` on (its blocks cover them); the requests whose step ends at their last
        known token are sampled. Reserved tokens (`PLACEHOLDER`) take the slot's entry of
        `last_tokens`. Nothing is read back from the device: the step may still be running
        when this returns."""
        slots = np.asarray(slots, dtype=np.int32)
        num_new = np.asarray(num_new, dtype=np.int32)
        needs_sample = batch.num_computed[slots] + num_new == batch.num_tokens[slots]
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        if self.cuda_graphs is not None:
            key = self.cuda_graphs.graph_key(num_new, batch.num_blocks[slots])
            if key is not None:
                return self._execute_graph(key, batch, slots, needs_sample)
        order = self._order(num_new)
        step = batch.gather(slots[order], num_new[order])
        prefix_len = batch.common_prefix_len(slots)
        rows = np.flatnonzero(needs_sample[order])
        reserved = _reserved_index(step.input_ids, np.repeat(slots[order], num_new[order]))
        # one upload for all of the step's inputs: an eager step is bound by the host
        arrays = [
            step.input_ids,
            step.positions,
            step.query_start_loc[1:][rows].astype(np.int64) - 1,
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            step.slot_mapping,
        ]
        if reserved is not None:
            arrays.append(reserved)
        uploaded = to_device_all(arrays, self.device)
        input_ids, positions, last = uploaded[:3]
        common = self._common_metadata(step, *uploaded[3:7])
        # Builders run under inference mode on every path (graph capture and replay too): a
        # buffer a builder makes lazily is then an inference tensor, which may only be updated
        # in place under inference mode, whichever path updates it next.
        with torch.inference_mode():
            attn_metadata, used_prefix = self._build(common, prefix_len, num_new[order])
            if reserved is not None:
                self._fill_reserved(input_ids, uploaded[7])
            self._record_inputs_copied()
            hidden = self.model(input_ids, positions, attn_metadata, self.kv_caches)
            logits = self.model.compute_logits(hidden[last])
        return StepOutput(order.tolist(), order[rows].tolist(), logits, used_prefix)

    def record_sampled(self, slots: np.ndarray, tokens: torch.Tensor) -> None:
        """Remember the tokens just sampled (int64 `[R]` on the device) for `slots` (int `[R]`),
        for the next step's reserved input tokens."""
        if len(slots):
            self.last_tokens[to_device(np.asarray(slots, dtype=np.int64), self.device)] = tokens

    def _fill_reserved(self, input_ids: torch.Tensor, index: torch.Tensor) -> None:
        """Reserved tokens of `input_ids` from `last_tokens`; `index`: `_reserved_index`'s."""
        input_ids[index[0]] = self.last_tokens[index[1]]

    def _record_inputs_copied(self) -> None:
        if self._inputs_copied is not None:
            self._inputs_copied.record(torch.cuda.current_stream(self.device))

    def _common_metadata(
        self,
        step: StepInputs,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> CommonAttentionMetadata:
        """The step's metadata over its host arrays and their device copies."""
        return CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=torch.from_numpy(step.query_start_loc),
            seq_lens=seq_lens,
            seq_lens_cpu=torch.from_numpy(step.seq_lens),
            num_computed_tokens_cpu=torch.from_numpy(step.num_computed),
            num_reqs=len(step.seq_lens),
            num_actual_tokens=len(step.input_ids),
            max_query_len=int(np.diff(step.query_start_loc).max(initial=0)),
            max_seq_len=int(step.seq_lens.max(initial=0)),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
            block_table_cpu=torch.from_numpy(step.block_table),
            slot_mapping_cpu=torch.from_numpy(step.slot_mapping),
        )

    def _execute_graph(
        self, key: tuple[int, int], batch: InputBatch, slots: np.ndarray, needs_sample: np.ndarray
    ) -> StepOutput:
        """A uniform decode step in a CUDA graph; requests keep their order."""
        assert self.cuda_graphs is not None
        query_len = key[1]
        rows = np.flatnonzero(needs_sample)
        with torch.inference_mode():
            input_ids, host_ids = self.cuda_graphs.prepare(key, batch, slots)
            reserved = _reserved_index(host_ids, np.repeat(slots, query_len))
            if reserved is not None:
                self._fill_reserved(input_ids, to_device(reserved, self.device))
            picked = to_device(rows, self.device) if len(rows) < len(slots) else None
            self._record_inputs_copied()
            hidden = self.cuda_graphs.replay(key, len(slots))
            if query_len > 1:  # each request's last token
                hidden = hidden[query_len - 1 :: query_len]
            if picked is not None:
                hidden = hidden[picked]
            logits = self.model.compute_logits(hidden)
        return StepOutput(list(range(len(slots))), rows.tolist(), logits)

    def _build(
        self, common: CommonAttentionMetadata, prefix_len: int, query_lens: np.ndarray
    ) -> tuple[dict[str, object], int]:
        metadata: dict[str, object] = {}
        used_prefix = 0
        for group in self.groups:
            group_common = in_kernel_blocks(group, common, self.block_size)
            cascade_len = functools.partial(self._cascade_len, group, prefix_len)
            if group.prefill_builder is None:
                prefix = cascade_len(group.builder, query_lens)
                built: object = group.builder.build(prefix, group_common)
            else:
                assert self.decode_threshold is not None  # a per-phase group sets one
                built, prefix = build_by_phase(
                    group, group_common, self.decode_threshold, cascade_len
                )
            used_prefix = max(used_prefix, prefix)
            for name in group.layer_names:
                metadata[name] = built
        return metadata, used_prefix

    def _cascade_len(
        self, group: KVCacheGroup, prefix_len: int, builder: object, query_lens: np.ndarray
    ) -> int:
        """`prefix_len` when `builder` runs this step's shared prefix by cascade, else 0."""
        cascade = prefix_len > 0 and builder.use_cascade_attention(
            prefix_len,
            query_lens,
            num_query_heads=group.num_query_heads,
            num_kv_heads=group.spec.num_kv_heads,
            use_alibi=group.has_alibi,
            use_sliding_window=group.spec.sliding_window is not None,
            num_sms=self.num_sms,
        )
        return prefix_len if cascade else 0


def _reserved_index(host_ids: np.ndarray, token_slots: np.ndarray) -> np.ndarray | None:
    """int64 `[2, n]`: the positions of the reserved tokens (`PLACEHOLDER`) among a step's
    input ids `host_ids`, and the slots they belong to (`token_slots`, one per token); None
    when there are none."""
    at = np.flatnonzero(host_ids[: len(token_slots)] == PLACEHOLDER)
    if not len(at):
        return None
    return np.stack([at, token_slots[at].astype(np.int64)])
