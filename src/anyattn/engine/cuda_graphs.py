"""CUDA graphs for uniform decode steps: captured once at start-up, replayed afterwards.

The contract between the runner (this file) and a backend's metadata builder:

- Buffers: persistent device inputs sized for the largest capture (plus one expanded block
  table per group with a smaller kernel block) and pinned CPU twins. A step writes a prefix of
  the CPU buffers and copies it in place once the previous step's copies have run (the model
  runner's event); the step's `CommonAttentionMetadata` holds views of both, so every address
  is the same at capture and replay. One output buffer serves all graphs.
- Padding: R requests of query length q run in the smallest captured size of N >= R requests;
  requests R .. N-1 are dummies (seq_len q, context 0, block-table row 0 the null block,
  slot_mapping -1, input id 0) and the metadata says `num_reqs = N`. Only the first R * q
  hidden rows are used.
- Capture, per size, largest first, in one memory pool: `builder.build(0, common)` and one
  eager run over dummies (lazy initialisation outside the capture), then
  `builder.build_for_cudagraph_capture(common)` and the capture, both with `max_seq_len =
  max_model_len` so that a launch sized by it fits any replay.
- Replay: fill the buffers, `builder.build(0, common)` for every group, patch the input ids
  sampled by the step still running, replay. Builders must return metadata whose device tensors
  live at the captured addresses; `BatchLimits.has_persistent_graph_inputs` tells them they may
  read the step's tensors in place.
- Which steps: uniform decode batches (query length 1, or 1 + k speculative tokens at level
  `UNIFORM_BATCH`) within the largest capture, when every group's level is at least
  `UNIFORM_SINGLE_TOKEN_DECODE`; never cascade. The captured forward never synchronises with
  the host.
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
    """Powers of two up to `min(max_num_reqs, max_num_tokens)`, and that bound itself."""
    top = min(max_num_reqs, max_num_tokens)
    sizes = [top]
    size = 1
    while size < top:
        sizes.append(size)
        size *= 2
    return tuple(sorted(sizes))


@dataclass(frozen=True, slots=True)
class CudaGraphPlan:
    """What the engine will capture, or why it will not: the weakest level over the groups,
    `(num_tokens, query_len)` of every graph, largest first (empty: graphs off), and one log
    line ("CUDA graphs on: ..." or "CUDA graphs off: <why>")."""

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
    model_reason: str | None = None,
) -> CudaGraphPlan:
    """Decide whether and what to capture from each backend's weakest `get_cudagraph_support`
    level; empty `limits.cudagraph_capture_sizes` means the defaults; `model_reason`, when
    given, says why the model's steps cannot be captured (graphs are then off)."""
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
    elif model_reason:
        why = model_reason
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
    """The smallest captured size (tokens, a whole number of requests) holding `num_reqs`
    requests of `query_len` tokens, or None."""
    needed = num_reqs * query_len
    fitting = [s for s in sizes if s >= needed and s % query_len == 0]
    return min(fitting) if fitting else None


class CudaGraphRunner:
    """Captures the model's forward for the plan's uniform decode batches and replays it
    (`kv_caches` are allocated before, at fixed addresses). `num_replays` counts graph steps."""

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
        self.num_replays = 0

    def graph_key(self, num_new: np.ndarray, num_blocks: np.ndarray) -> tuple[int, int] | None:
        """`(num_tokens, query_len)` of the graph that runs requests of `num_new` tokens holding
        `num_blocks` blocks each (int `[R]`), or None (run eagerly)."""
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
        """Capture every graph of the plan, largest first; RuntimeError naming the size, and
        how to run without graphs, when one fails."""
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

    def prepare(
        self, key: tuple[int, int], batch: InputBatch, slots: np.ndarray
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Fill graph `key`'s inputs for the decode batch of `slots` and build every group's
        metadata into its captured buffers; returns the padded device input ids and their host
        values, to patch before `replay`. The previous `prepare`'s copies must have run."""
        num_tokens, query_len = key
        ids, _, common = self.inputs.prepare(batch, slots, query_len, num_tokens // query_len)
        metadata = self.inputs.build(common, for_capture=False)
        # A replay runs no layer's Python: the step is checked against each group's cache here.
        for group in self.inputs.groups:
            name = group.layer_names[0]
            step = step_of(metadata[name])
            if step is not None:
                check_step_against_cache("CudaGraphRunner.prepare", step, self.kv_caches[name])
        return ids, self.inputs.host.input_ids[: len(slots) * query_len].numpy()

    def replay(self, key: tuple[int, int], num_reqs: int) -> torch.Tensor:
        """Replay the prepared graph `key`; returns the hidden states of the first `num_reqs`
        requests' tokens `[num_reqs * query_len, hidden_size]`, a view of the output buffer
        that the next replay overwrites."""
        self.graphs[key].replay()
        self.num_replays += 1
        assert self.hidden is not None
        return self.hidden[: num_reqs * key[1]]
