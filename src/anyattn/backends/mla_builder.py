"""`MLAMetadataBuilder`: the builder MLA backends share (docs/mla.md).

Constructed once per MLA KV-cache group with an `MLAAttentionSpec` and one `MLALayerParams`
per layer; asks for decodes first (`reorder_batch_threshold = 1`). `build` reads only the CPU
mirrors (no device sync) and returns frozen `MLAMetadata`: the decode part (`plan_decodes`),
the prefill part and its context chunk plan (`plan_prefills`, `plan_context_chunks`) for the
group's workspace, the smallest `workspace_tokens` of its layers, which must hold at least one
block.

A backend's builder subclasses it and adds its own plan through the hooks: override
`plan_decodes` / `plan_prefills` to return subclasses of `MLADecodeMetadata` /
`MLAPrefillMetadata` with more fields, or `build` to wrap `super().build(...)` into its
`MLAMetadata` subclass (`extend_metadata`). CUDA graphs: this builder makes new device tensors
every step (the decode `seq_lens`, a gathered block table when a decode request has no token,
the whole prefill part) and declares `AttentionCGSupport.NEVER`. A builder that declares graph
support must hand its decode launch only tensors that keep their addresses from capture to
replay: views of the step's own tensors (`cm.seq_lens`, rows of `cm.block_table_tensor`) when
`BatchLimits.has_persistent_graph_inputs` promises they are persistent, else copies into
buffers it allocates once at the limits' size; the same for any workspace, never allocated
during capture (TRITON_MLA's builder overrides `plan_decodes` so).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from anyattn.async_copy import to_device
from anyattn.backends.mla_metadata import (
    MLAChunkPiece,
    MLAContextChunk,
    MLADecodeMetadata,
    MLAMetadata,
    MLAPrefillMetadata,
    plan_context_chunks,
)
from anyattn.builder import AttentionMetadataBuilder
from anyattn.config import BatchLimits, MLAAttentionSpec
from anyattn.layer_params import LayerParams, MLALayerParams
from anyattn.metadata import CommonAttentionMetadata, split_decodes_and_prefills
from anyattn.types import AttentionCGSupport

__all__ = ["MLAMetadataBuilder"]

_LATENT_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


class MLAMetadataBuilder(AttentionMetadataBuilder[MLAMetadata]):
    """Plans a step for MLA impls from the CPU mirrors; never syncs with the device.

    Attributes (besides the base class's):
        workspace_tokens: the most latent context rows one chunk holds.
    """

    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: MLAAttentionSpec,
        layers: Mapping[str, LayerParams],
        limits: BatchLimits,
        device: torch.device,
    ) -> None:
        """Keep the arguments; decodes go first.

        Raises:
            TypeError: a spec that is not an `MLAAttentionSpec`, or a layer whose record is not
                an `MLALayerParams`.
            ValueError: a layer whose latent sizes differ from the spec's, or a workspace
                smaller than one block (`workspace_tokens < block_size`).
        """
        api = type(self).__name__
        if not isinstance(kv_cache_spec, MLAAttentionSpec):
            raise TypeError(
                f"{api}: kv_cache_spec must be an MLAAttentionSpec (got "
                f"{type(kv_cache_spec).__name__}). Build it with MLAAttention.kv_cache_spec."
            )
        super().__init__(kv_cache_spec, layers, limits, device)
        for name, params in self.layers.items():
            if not isinstance(params, MLALayerParams):
                raise TypeError(
                    f"{api}: layer {name!r} has a {type(params).__name__} record (expected "
                    "MLALayerParams). Pass {name: impl.layer_params()} of MLA impls."
                )
            for field_name in _LATENT_FIELDS:
                got, spec = getattr(params, field_name), getattr(kv_cache_spec, field_name)
                if got != spec:
                    raise ValueError(
                        f"{api}: layer {name!r} has {field_name}={got}, but the KV-cache spec "
                        f"says {spec}. A builder serves the layers of one KV-cache group."
                    )
        block_size = kv_cache_spec.block_size
        self.workspace_tokens = min(
            (p.workspace_tokens for p in self.layers.values()), default=block_size
        )
        if self.workspace_tokens < block_size:
            raise ValueError(
                f"{api}: workspace_tokens too small for one context chunk (got "
                f"{self.workspace_tokens}, expected >= block_size {block_size}: a chunk holds "
                "at least one block). Give the layers a larger workspace_tokens."
            )
        self._init_reorder_batch_threshold(1)
        self._layer_names = frozenset(self.layer_names)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> MLAMetadata:
        """The step's `MLAMetadata` (see the module docstring).

        Raises:
            ValueError: a common prefix (MLA runs no cascade), or a block table too narrow
                for the longest sequence.
        """
        api = f"{type(self).__name__}.build"
        cm = common_attn_metadata
        if common_prefix_len:
            raise ValueError(
                f"{api}: cascade attention is not supported by MLA backends (got "
                f"common_prefix_len={common_prefix_len}, expected 0)."
            )
        block_size = self.kv_cache_spec.block_size
        host = cm.host_batch
        needed = -(-host.max_seq_len // block_size)
        if needed > cm.block_table_tensor.shape[1]:
            raise ValueError(
                f"{api}: block_table too narrow for the longest sequence (got "
                f"{cm.block_table_tensor.shape[1]} columns, expected >= {needed} for "
                f"block_size {block_size})."
            )
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            split_decodes_and_prefills(cm, self.reorder_batch_threshold)
        )
        return MLAMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=cm.num_reqs,
            block_size=block_size,
            slot_mapping=cm.slot_mapping,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            decode=self.plan_decodes(cm, num_decodes) if num_decode_tokens else None,
            prefill=self.plan_prefills(cm, num_decodes) if num_prefill_tokens else None,
            workspace_tokens=self.workspace_tokens,
            layer_names=self._layer_names,
            common_attn_metadata=cm,
        )

    def plan_decodes(self, cm: CommonAttentionMetadata, num_decodes: int) -> MLADecodeMetadata:
        """The decode part of a step with a decode row (a hook: override to add a plan).

        Args:
            cm: the step.
            num_decodes: its leading decode requests; those with a token this step have a row
                (a decode request without one has none).
        """
        host = cm.host_batch
        rows = np.flatnonzero(host.query_lens[:num_decodes] == 1)
        seq_lens_cpu = torch.from_numpy(host.seq_lens[rows].astype(np.int32))
        device = cm.block_table_tensor.device
        if rows.size == num_decodes:
            table = cm.block_table_tensor[:num_decodes]
        else:
            table = cm.block_table_tensor[to_device(rows, device)]
        return MLADecodeMetadata(
            block_table=table,
            seq_lens=to_device(seq_lens_cpu, device),
            seq_lens_cpu=seq_lens_cpu,
            max_seq_len=int(seq_lens_cpu.max()),
        )

    def plan_prefills(self, cm: CommonAttentionMetadata, num_decodes: int) -> MLAPrefillMetadata:
        """The prefill part of a step with a prefill row (a hook: override to add a plan): the
        requests after the `num_decodes` decodes, their rows from the first prefill row, and
        the context chunk plan."""
        host = cm.host_batch
        device = cm.block_table_tensor.device
        loc = host.query_start_loc[num_decodes:] - host.query_start_loc[num_decodes]
        context = host.context_lens[num_decodes:]
        table_cpu = cm.block_table_cpu.numpy()[num_decodes : cm.num_reqs]
        plan = plan_context_chunks(
            context, loc, table_cpu, self.kv_cache_spec.block_size, self.workspace_tokens
        )
        chunks = tuple(_chunk(slots, pieces, len(context), device) for slots, pieces in plan)
        loc_cpu = torch.from_numpy(loc.astype(np.int32))
        return MLAPrefillMetadata(
            query_start_loc=to_device(loc_cpu, device),
            query_start_loc_cpu=loc_cpu,
            seq_lens_cpu=torch.from_numpy(host.seq_lens[num_decodes:].astype(np.int32)),
            context_lens_cpu=torch.from_numpy(context.astype(np.int32)),
            max_query_len=int((loc[1:] - loc[:-1]).max()),
            block_table=cm.block_table_tensor[num_decodes : cm.num_reqs],
            chunks=chunks,
        )


def _chunk(
    slots: np.ndarray, pieces: tuple[MLAChunkPiece, ...], num_prefills: int, device: torch.device
) -> MLAContextChunk:
    """A planned chunk with its per-request row offsets (`MLAContextChunk.cu_seq_lens`)."""
    seq_lens = np.zeros(num_prefills, dtype=np.int32)
    for piece in pieces:
        seq_lens[piece.request] += piece.row_len
    cu_seq_lens = torch.from_numpy(np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32))
    return MLAContextChunk(
        num_tokens=int(slots.size),
        slots=to_device(slots, device),
        slots_cpu=torch.from_numpy(slots),
        pieces=pieces,
        cu_seq_lens=to_device(cu_seq_lens, device),
        cu_seq_lens_cpu=cu_seq_lens,
        max_seq_len=int(seq_lens.max()),
    )
