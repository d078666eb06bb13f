"""TRITON_MLA's plan: the metadata its builder makes for a step, on top of the shared MLA plan.

`build` extends `MLAMetadata` (docs/mla.md) with what the kernels need and plans nothing in
`forward`:

- Decode: the number of KV splits (more than one only when the decode rows and head tiles leave
  the GPU idle) and the split-KV workspace, a float32 buffer the builder owns, allocated once at
  its full size (so that its address never changes once a CUDA graph has captured it). The decode
  rows read the step's own `seq_lens` and block table in place (views of the common metadata),
  so a launch depends only on tensor sizes.
- Prefill: the launch arguments of `unified_attention` over the up-projected keys and values,
  laid out densely as a cache of one-token blocks: the new tokens (causal, block i = token i of
  the step's prefill rows) and, per context chunk, the chunk's rows (not causal, block i = row i
  of the chunk) for the queries of the requests it holds (a request between them without a
  piece in the chunk attends to no key there).

CUDA graphs (UNIFORM_SINGLE_TOKEN_DECODE): a batch of single-token decodes, captured over the
step's own tensors, which must stay at the captured addresses from capture to replay:
`BatchLimits.has_persistent_graph_inputs` (the engine's runner keeps that promise). The split
choice of a capture assumes `max_model_len` keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from anyattn.async_copy import to_device
from anyattn.backends.mla_builder import MLAMetadataBuilder
from anyattn.backends.mla_metadata import MLADecodeMetadata, MLAMetadata, MLAPrefillMetadata
from anyattn.config import BatchLimits, MLAAttentionSpec
from anyattn.layer_params import LayerParams
from anyattn.metadata import CommonAttentionMetadata
from anyattn.ops.mla_decode import mla_decode_tiles, mla_decode_workspace_shape
from anyattn.types import AttentionCGSupport

__all__ = [
    "DenseAttentionPlan",
    "TritonMLADecodePlan",
    "TritonMLAMetadata",
    "TritonMLAMetadataBuilder",
    "TritonMLAPrefillPlan",
    "choose_num_splits",
]

# Split-KV: aim for this many programs on the GPU, at most this many splits, at least this
# many keys per split. The default decode tiles hold one program per SM (their shared memory),
# and one wave on sm90's 132 SMs was fastest in benchmarks/RESULTS.md's tile sweep.
_TARGET_PROGRAMS = 128
_MAX_SPLITS = 32
_MIN_KEYS_PER_SPLIT = 256


def choose_num_splits(
    num_rows: int,
    programs_per_row: int,
    max_seq_len: int,
    min_keys_per_split: int = _MIN_KEYS_PER_SPLIT,
    *,
    target_programs: int = _TARGET_PROGRAMS,
    max_splits: int = _MAX_SPLITS,
) -> int:
    """KV splits of a decode step: doubled while `num_rows * programs_per_row * splits`
    programs stay under `target_programs`, at most `max_splits`, never fewer than
    `min_keys_per_split` keys per split. So `num_rows * splits <= split_rows_capacity`.
    `programs_per_row` is `MLADecodeTiles.programs_per_row(num_heads)`."""
    if num_rows == 0:
        return 1
    splits = 1
    while splits < max_splits and num_rows * programs_per_row * splits * 2 <= target_programs:
        splits *= 2
    while splits > 1 and max_seq_len < splits * min_keys_per_split:
        splits //= 2
    return splits


def split_rows_capacity(programs_per_row: int, target_programs: int = _TARGET_PROGRAMS) -> int:
    """The most `num_rows * num_splits` that `choose_num_splits` gives for splits > 1."""
    return target_programs // programs_per_row


@dataclass(frozen=True)
class TritonMLADecodePlan:
    """How the decode rows run.

    Attributes:
        num_splits: KV splits per row (1: no split-KV).
        workspace: `(partial_out, partial_lse)` float32, the builder's buffers (viewed at
            the step's size); None when `num_splits` is 1.
    """

    num_splits: int
    workspace: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class DenseAttentionPlan:
    """One `unified_attention` launch over up-projected keys and values laid out as a cache of
    one-token blocks (block i = key row i).

    Attributes:
        q_start, q_end: the prefill rows (from the first prefill row) it computes.
        num_reqs: requests of the launch.
        query_start_loc: int32 `[num_reqs + 1]` (device), from `q_start`.
        seq_lens: int32 `[num_reqs]` (device): keys of each request.
        block_table: int32 `[num_reqs, max_keys]` (device): each request's key rows.
        max_query_len: the longest query.
        causal: new tokens among themselves (True) or a context chunk (False).
    """

    q_start: int
    q_end: int
    num_reqs: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    causal: bool


@dataclass(frozen=True)
class TritonMLAPrefillPlan:
    """The new tokens' launch and one launch per context chunk (in `prefill.chunks` order)."""

    new_tokens: DenseAttentionPlan
    chunks: tuple[DenseAttentionPlan, ...]


@dataclass(frozen=True)
class TritonMLAMetadata(MLAMetadata):
    """`MLAMetadata` plus TRITON_MLA's launch plans (None where the step has no such rows)."""

    decode_plan: TritonMLADecodePlan | None = None
    prefill_plan: TritonMLAPrefillPlan | None = None


class _SplitWorkspace:
    """The float32 split-KV buffers, shared by the builder's layers: allocated once, at the
    most any step can need, by the first build that splits (outside graph capture)."""

    def __init__(self, rows_capacity: int, num_heads: int, rank: int, device: torch.device):
        self.shapes = mla_decode_workspace_shape(rows_capacity, num_heads, rank, 1)
        self.device = device
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None

    def view(
        self, num_rows: int, num_heads: int, rank: int, splits: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(partial_out, partial_lse)` of `mla_decode_workspace_shape(num_rows, num_heads,
        rank, splits)`, views of the buffers."""
        if self._flat is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "TritonMLAMetadataBuilder: the split-KV workspace would be allocated during "
                    "CUDA-graph capture; run one eager step of the captured shape first (the "
                    "engine's warm-up does)."
                )
            self._flat = tuple(
                torch.empty(int(np.prod(s)), dtype=torch.float32, device=self.device)
                for s in self.shapes
            )
        out_shape, lse_shape = mla_decode_workspace_shape(num_rows, num_heads, rank, splits)
        out, lse = self._flat
        return (
            out[: int(np.prod(out_shape))].view(out_shape),
            lse[: int(np.prod(lse_shape))].view(lse_shape),
        )


class TritonMLAMetadataBuilder(MLAMetadataBuilder):
    """Plans a TRITON_MLA step from the CPU mirrors; never syncs with the device."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # The split policy of `choose_num_splits`, class attributes so that a subclass can tune
    # it (and tests can force splits on tiny contexts).
    min_keys_per_split: int = _MIN_KEYS_PER_SPLIT
    target_programs: int = _TARGET_PROGRAMS
    max_splits: int = _MAX_SPLITS

    def __init__(
        self,
        kv_cache_spec: MLAAttentionSpec,
        layers: Mapping[str, LayerParams],
        limits: BatchLimits,
        device: torch.device,
    ) -> None:
        """See `MLAMetadataBuilder`; also sizes the split-KV workspace (allocated on first use)
        for the layer with the most heads."""
        super().__init__(kv_cache_spec, layers, limits, device)
        heads = [p.num_heads for p in self.layers.values()]
        self._max_heads = max(heads, default=1)
        self._programs_per_row = mla_decode_tiles(self._max_heads).programs_per_row(self._max_heads)
        self._workspace = _SplitWorkspace(
            split_rows_capacity(self._programs_per_row, self.target_programs),
            self._max_heads,
            kv_cache_spec.kv_lora_rank,
            self.device,
        )

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> TritonMLAMetadata:
        """The step's `TritonMLAMetadata` (see the module docstring)."""
        base = super().build(common_prefix_len, common_attn_metadata)
        max_seq_len = base.decode.max_seq_len if base.decode is not None else 0
        return self._extend(base, max_seq_len)

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TritonMLAMetadata:
        """Metadata for capturing a batch of single-token decodes (the split choice assumes
        `max_model_len` keys, since the graph replays over any lengths).

        Raises:
            ValueError: a batch that is not all single-token decodes, or limits without
                `has_persistent_graph_inputs` (the graph reads the step's tensors in place).
        """
        api = f"{type(self).__name__}.build_for_cudagraph_capture"
        if not self.limits.has_persistent_graph_inputs:
            raise ValueError(
                f"{api}: TRITON_MLA captures decode graphs over the step's own tensors (got "
                "BatchLimits.has_persistent_graph_inputs=False, expected True). Keep the step's "
                "tensors at fixed addresses and say so in BatchLimits, as the engine does."
            )
        base = super().build(0, common_attn_metadata)
        if base.num_prefills or base.num_decode_tokens != base.num_decodes:
            raise ValueError(
                f"{api}: only batches of single-token decodes are captured (got "
                f"{base.num_decodes} decodes and {base.num_prefills} prefills)."
            )
        return self._extend(base, self.limits.max_model_len)

    def plan_decodes(self, cm: CommonAttentionMetadata, num_decodes: int) -> MLADecodeMetadata:
        """The shared plan, but reading the step's `seq_lens` and block table in place when
        every decode request has its token (always in a CUDA-graph step)."""
        host = cm.host_batch
        if not bool((host.query_lens[:num_decodes] == 1).all()):
            return super().plan_decodes(cm, num_decodes)
        seq_lens_cpu = torch.from_numpy(host.seq_lens[:num_decodes].astype(np.int32))
        return MLADecodeMetadata(
            block_table=cm.block_table_tensor[:num_decodes],
            seq_lens=cm.seq_lens[:num_decodes],
            seq_lens_cpu=seq_lens_cpu,
            max_seq_len=int(seq_lens_cpu.max()),
        )

    def _extend(self, base: MLAMetadata, max_seq_len: int) -> TritonMLAMetadata:
        decode_plan = None
        if base.decode is not None:
            rows = base.num_decode_tokens
            splits = choose_num_splits(
                rows,
                self._programs_per_row,
                max_seq_len,
                self.min_keys_per_split,
                target_programs=self.target_programs,
                max_splits=self.max_splits,
            )
            workspace = None
            if splits > 1:
                workspace = self._workspace.view(
                    rows, self._max_heads, self.kv_cache_spec.kv_lora_rank, splits
                )
            decode_plan = TritonMLADecodePlan(splits, workspace)
        prefill_plan = None if base.prefill is None else self._plan_dense(base.prefill)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(MLAMetadata)}
        return TritonMLAMetadata(**fields, decode_plan=decode_plan, prefill_plan=prefill_plan)

    def _plan_dense(self, pre: MLAPrefillMetadata) -> TritonMLAPrefillPlan:
        """The new tokens' launch and each context chunk's (see `DenseAttentionPlan`)."""
        loc = pre.query_start_loc_cpu.numpy().astype(np.int64)
        q_lens = np.diff(loc)
        new_tokens = self._dense(0, loc, q_lens, loc[:-1], q_lens, causal=True)
        chunks = []
        for chunk in pre.chunks:
            first, last = chunk.pieces[0].request, chunk.pieces[-1].request
            keys = np.zeros(last - first + 1, dtype=np.int64)
            key_start = np.zeros(last - first + 1, dtype=np.int64)
            for piece in chunk.pieces:
                keys[piece.request - first] = piece.row_len
                key_start[piece.request - first] = piece.row_start
            sub = loc[first : last + 2] - loc[first]
            chunks.append(self._dense(int(loc[first]), sub, keys, key_start, np.diff(sub), False))
        return TritonMLAPrefillPlan(new_tokens, tuple(chunks))

    def _dense(
        self, q_start: int, loc: np.ndarray, keys: np.ndarray, key_start: np.ndarray,
        q_lens: np.ndarray, causal: bool,
    ) -> DenseAttentionPlan:  # fmt: skip
        """A launch over key rows `[key_start[r], key_start[r] + keys[r])` for request r."""
        width = max(int(keys.max()), 1)
        last_row = max(int((key_start + keys).max()) - 1, 0)
        # Entries past a request's keys are never read; clamped so that each is a real row.
        table = np.minimum(key_start[:, None] + np.arange(width)[None, :], last_row)
        device = self.device
        return DenseAttentionPlan(
            q_start=q_start,
            q_end=q_start + int(loc[-1]),
            num_reqs=len(keys),
            query_start_loc=to_device(loc.astype(np.int32), device),
            seq_lens=to_device(keys.astype(np.int32), device),
            block_table=to_device(table.astype(np.int32), device),
            max_query_len=int(q_lens.max()),
            causal=causal,
        )
