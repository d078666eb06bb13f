"""CUDA graphs for decode steps: captured once at start-up, replayed for uniform decode batches.

A small model at small batch spends most of a decode step launching kernels; a CUDA graph
launches the whole forward at once. The contract between the runner (this file) and a backend's
metadata builder, for every graph step:

- Buffers. The runner owns persistent device buffers sized for the largest capture: input ids,
  positions, `query_start_loc`, `seq_lens`, `block_table` (in engine blocks, plus one expanded
  copy per KV-cache group whose kernel block is smaller) and `slot_mapping`, and pinned CPU
  buffers of the same shapes (`num_computed_tokens` is read from the CPU copy only). A step
  writes a prefix of the CPU buffers and copies it to the device in place (`non_blocking`;
  the CPU buffers are rewritten only after the previous replay has completed); the device
  tensors of its `CommonAttentionMetadata` are views of those buffers and its CPU mirrors are
  views of the pinned ones, so every address is the same at capture and at replay. The final
  hidden states land in one output buffer shared by all graphs.
- Padding. A decode batch of R requests of query length q runs in the graph of the smallest
  captured size of N >= R requests (N * q tokens). Requests R .. N-1 are dummies: query length
  q, seq_len q (context 0), block-table row all 0 (the null block), slot_mapping -1 (never
  written), input id 0 at positions 0 .. q-1. The step's metadata says `num_reqs = N` and
  `num_actual_tokens = N * q`; the CPU mirrors are padded the same way. Only the first R * q
  rows of the hidden states are used (the logits of the first R requests).
- Capture. For each size, largest first, the runner fills the buffers with N dummies, builds
  the metadata with `builder.build(0, common)` and runs the model once eagerly (warm-up: lazy
  initialisation, Triton compilation and autotuning happen outside the capture), then builds
  it again with `builder.build_for_cudagraph_capture(common)` and captures the model's forward
  into a graph. All graphs share one memory pool. The warm-up and capture metadata say
  `max_seq_len = max_model_len`, so that a builder that sizes a launch by it sizes it for any
  replay (and the warm-up compiles what the capture launches).
- Replay. The runner fills the buffers for the real batch, calls `builder.build(0, common)` for
  every group, and replays the graph. The builder is responsible for returning metadata whose
  device tensors live at the captured addresses: views of the common metadata's tensors or of
  its own persistent buffers, written in place. What it returns is not passed anywhere: the
  graph reads the captured addresses. The builders get `BatchLimits.has_persistent_graph_inputs`
  (this contract, as a flag), so those that would copy the step's tensors into buffers of
  their own (FLASH_ATTN) may read them in place instead.
- Which steps. Only uniform decode batches: every request has query length 1, or 1 + k under
  speculative decoding (k = `BatchLimits.num_speculative_tokens`) when the weakest backend
  level is `UNIFORM_BATCH` or more, with N * q within the largest captured size; graphs are
  on only when every KV-cache group's level is at least `UNIFORM_SINGLE_TOKEN_DECODE`. A
  backend declaring `ALWAYS` could also serve mixed prefill/decode batches; this engine
  captures decode steps only (prefills are long enough that launch costs hardly matter) and
  runs everything else eagerly. Graph steps never use cascade attention.
- The forward must not synchronise with the host while it is captured: the model and
  `anyattn.layer.Attention` contain no `.item()` / `.cpu()` / branches on device values.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from anyattn.config import BatchLimits
from anyattn.engine.decode_inputs import StaticDecodeInputs
from anyattn.engine.input_batch import InputBatch
from anyattn.engine.kv_cache_group import KVCacheGroup
from anyattn.types import AttentionCGSupport
from anyattn.validation import check_step_against_cache, step_of

logger = logging.getLogger(__name__)

__all__ = [
    "CudaGraphPlan",
    "CudaGraphRunner",
    "default_capture_sizes",
    "pick_capture_size",
    "plan_cuda_graphs",
]


def default_capture_sizes(max_num_reqs: int, max_num_tokens: int) -> tuple[int, ...]:
    """Powers of two up to `min(max_num_reqs, max_num_tokens)`, and that bound itself.

    Padding to the next power of two at most doubles a decode batch, which costs little: small
    decode batches are bound by reading the weights, not by the number of rows.
    """
    top = min(max_num_reqs, max_num_tokens)
    sizes = {top}
    size = 1
    while size < top:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


@dataclass(frozen=True, slots=True)
class CudaGraphPlan:
    """What the engine will capture, or why it will not.

    Attributes:
        level: the weakest `AttentionCGSupport` over the KV-cache groups.
        graph_keys: `(num_tokens, query_len)` of every graph to capture, largest first
            (empty: graphs off). Sizes come from `BatchLimits.cudagraph_capture_sizes` (or the
            defaults), within `max_num_tokens` and `max_num_reqs` requests.
        message: one line for the log, "CUDA graphs on: ..." or "CUDA graphs off: <why>".
    """

    level: AttentionCGSupport
    graph_keys: tuple[tuple[int, int], ...]
    message: str

    @property
    def enabled(self) -> bool:
        return bool(self.graph_keys)

    @property
    def query_lens(self) -> tuple[int, ...]:
        """Query lengths of the uniform decode batches that run in graphs."""
        return tuple(sorted({q for _, q in self.graph_keys}))


def plan_cuda_graphs(
    levels: Mapping[str, AttentionCGSupport],
    *,
    device_type: str,
    enforce_eager: bool,
    limits: BatchLimits,
) -> CudaGraphPlan:
    """Decide whether and what to capture.

    Args:
        levels: backend name -> its `get_cudagraph_support(kv_cache_spec, limits)` (the weakest
            over that backend's groups).
        device_type: "cuda" or "cpu" (graphs are CUDA only).
        enforce_eager: the caller turned graphs off.
        limits: the engine's limits; empty `cudagraph_capture_sizes` means the defaults.

    Returns:
        A `CudaGraphPlan`; `plan.message` says why graphs are off, or what is captured.
    """
    level = min(levels.values(), default=AttentionCGSupport.NEVER)
    sizes = limits.cudagraph_capture_sizes or default_capture_sizes(
        limits.max_num_reqs, limits.max_num_tokens
    )
    query_lens: tuple[int, ...] = ()
    if level >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
        query_lens = (1,)
        k = limits.num_speculative_tokens
        if k and level >= AttentionCGSupport.UNIFORM_BATCH:
            query_lens = (1, 1 + k)
    keys = sorted(
        (
            (t, q)
            for q in query_lens
            for t in sizes
            if t % q == 0 and t <= limits.max_num_tokens and t // q <= limits.max_num_reqs
        ),
        reverse=True,
    )
    support = ", ".join(f"{name} supports {lvl.name}" for name, lvl in sorted(levels.items()))
    if device_type != "cuda":
        why = f"device is {device_type} (CUDA graphs need a CUDA device)"
    elif enforce_eager:
        why = "enforce_eager=True"
    elif not query_lens:
        never = [name for name, lvl in sorted(levels.items()) if lvl == AttentionCGSupport.NEVER]
        why = ", ".join(f"{name} supports NEVER" for name in never) or "no attention layers"
    elif not keys:
        why = (
            f"no capture size fits max_num_tokens={limits.max_num_tokens} and "
            f"max_num_reqs={limits.max_num_reqs} (got cudagraph_capture_sizes={sizes})"
        )
    else:
        batches = ", ".join(str(t) for t in sorted({t for t, _ in keys}))
        message = (
            f"CUDA graphs on: {support}; capturing uniform decode batches of {batches} tokens "
            "(other steps run eagerly)"
        )
        return CudaGraphPlan(level, tuple(keys), message)
    return CudaGraphPlan(level, (), f"CUDA graphs off: {why}")


def pick_capture_size(num_reqs: int, query_len: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size (in tokens) holding `num_reqs` requests of `query_len`
    tokens, or None when the batch is larger than every capture.

    A size counts only when it is a whole number of requests (`size % query_len == 0`).
    """
    needed = num_reqs * query_len
    fitting = [s for s in sizes if s >= needed and s % query_len == 0]
    return min(fitting) if fitting else None


class CudaGraphRunner:
    """Captures the model's forward for uniform decode batches and replays it.

    Args:
        model: the engine's model (`forward(input_ids, positions, attn_metadata, kv_caches)`).
        groups: the runner's KV-cache groups (backend, spec, layer names, builder).
        kv_caches: layer name -> cache (fixed addresses, allocated before capture).
        plan: a `CudaGraphPlan` with `enabled` True.
        block_size: the engine block size.
        max_model_len: longest sequence; sets the block-table width.
        device: the CUDA device.

    Attributes:
        num_replays: graph steps run so far (tests and benchmarks read it).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: Sequence[KVCacheGroup],
        kv_caches: Mapping[str, torch.Tensor],
        *,
        plan: CudaGraphPlan,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        assert plan.enabled, "a CudaGraphRunner needs a plan with graphs on"
        self.model = model
        self.kv_caches = kv_caches
        self.plan = plan
        self.device = device
        self.max_model_len = max_model_len
        self.max_num_tokens = max(t for t, _ in plan.graph_keys)
        self.inputs = StaticDecodeInputs(
            groups,
            block_size=block_size,
            max_num_reqs=max(t // q for t, q in plan.graph_keys),
            max_num_tokens=self.max_num_tokens,
            max_model_len=max_model_len,
            device=device,
        )
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.hidden: torch.Tensor | None = None  # [max_num_tokens, hidden_size], graph output
        self.pool = torch.cuda.graph_pool_handle()
        # Recorded after each replay: the pinned buffers (and the CPU mirrors a builder may
        # copy from asynchronously) are free to rewrite once it has completed.
        self._step_done = torch.cuda.Event()
        self.num_replays = 0

    def graph_key(self, num_new: np.ndarray, num_blocks: np.ndarray) -> tuple[int, int] | None:
        """`(num_tokens, query_len)` of the graph that runs this batch, or None (run eagerly).

        Args:
            num_new: int `[R]`, new tokens per request.
            num_blocks: int `[R]`, blocks each request holds.
        """
        if len(num_new) == 0:
            return None
        q = int(num_new[0])
        if q not in self.plan.query_lens or (num_new != q).any():
            return None
        if num_blocks.max() > self.inputs.max_blocks:
            return None
        size = pick_capture_size(len(num_new), q, [t for t, gq in self.graphs if gq == q])
        return None if size is None else (size, q)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph of the plan, largest first (smaller ones reuse its pool memory).

        Raises:
            RuntimeError: a capture failed (a kernel synchronised with the host, or is not
                capturable); the message names the size and how to run without graphs.
        """
        start = time.perf_counter()
        for key in self.plan.graph_keys:
            try:
                self._capture_one(*key)
            except RuntimeError as error:
                raise RuntimeError(
                    f"CudaGraphRunner: capturing the decode graph of {key[0]} tokens failed "
                    f"({error}). A backend declaring {self.plan.level.name} must not "
                    "synchronise with the host in build() or forward(); pass "
                    "enforce_eager=True to run without CUDA graphs."
                ) from error
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs in %.1f s", len(self.graphs), time.perf_counter() - start
        )

    def _capture_one(self, num_tokens: int, query_len: int) -> None:
        num_reqs = num_tokens // query_len
        no_slots = np.zeros(0, dtype=np.int32)
        ids, positions, common = self.inputs.prepare(
            None, no_slots, query_len, num_reqs, max_seq_len=self.max_model_len
        )
        warmup = self.inputs.build(common, for_capture=False)
        hidden = self.model(ids, positions, warmup, self.kv_caches)
        if self.hidden is None:
            self.hidden = hidden.new_empty((self.max_num_tokens, hidden.shape[1]))
        torch.cuda.synchronize(self.device)
        attn_metadata = self.inputs.build(common, for_capture=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(ids, positions, attn_metadata, self.kv_caches)
            # One output buffer for every graph: only one replays at a time.
            self.hidden[:num_tokens].copy_(hidden)
        self.graphs[(num_tokens, query_len)] = graph

    def run(self, key: tuple[int, int], batch: InputBatch, slots: np.ndarray) -> torch.Tensor:
        """Replay the graph `key` (from `graph_key`) for the uniform decode batch of `slots`.

        Returns:
            The final hidden states of the real tokens, `[R * query_len, hidden_size]`: a view
            of the graphs' output buffer, overwritten by the next replay.
        """
        num_tokens, query_len = key
        self._step_done.synchronize()
        _, _, common = self.inputs.prepare(batch, slots, query_len, num_tokens // query_len)
        # The builders fill their own persistent buffers; the graph reads the captured addresses.
        metadata = self.inputs.build(common, for_capture=False)
        # A replay runs no layer's Python: the step is checked against each group's cache here.
        for group in self.inputs.groups:
            name = group.layer_names[0]
            step = step_of(metadata[name])
            if step is not None:
                check_step_against_cache("CudaGraphRunner.run", step, self.kv_caches[name])
        self.graphs[key].replay()
        self._step_done.record()
        self.num_replays += 1
        assert self.hidden is not None
        return self.hidden[: len(slots) * query_len]
