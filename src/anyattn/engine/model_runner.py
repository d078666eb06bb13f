"""ModelRunner: lays out each step's batch, builds attention metadata once per KV-cache group,
runs the model, and returns the logits of the requests that need a next token.

KV-cache groups are the attention layers that share one backend and one `AttentionSpec`
(a plain model has one; Gemma2's sliding and global layers make two). Every group reads the same
block table and slot mapping (in engine blocks); a backend whose kernel block is smaller gets
the table expanded to kernel blocks, which leaves slot numbers unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import numpy as np
import torch

from anyattn.backend import AttentionBackend, AttentionMetadataBuilder
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.layer import Attention
from anyattn.metadata import (
    CommonAttentionMetadata,
    apply_swaps,
    expand_block_table,
    make_common_attn_metadata,
    reorder_batch_to_split_decodes_and_prefills,
)
from anyattn.types import AttentionCGSupport

logger = logging.getLogger(__name__)

__all__ = ["KVCacheGroup", "ModelRunner", "StepOutput"]


@dataclass
class KVCacheGroup:
    """Layers that share a backend and a KV-cache spec, and the one builder serving them."""

    backend: type[AttentionBackend]
    spec: AttentionSpec
    layer_names: list[str]
    builder: AttentionMetadataBuilder
    kernel_block_size: int


@dataclass
class StepOutput:
    """What one step produced.

    Attributes:
        order: the batch positions (into the scheduled batch) in the order the step ran them.
        sample_rows: indices into the scheduled batch of the requests that get a next token.
        logits: float32 `[len(sample_rows), vocab_size]`, in `sample_rows` order.
        common_prefix_len: tokens of shared prefix run once (cascade), 0 when none.
    """

    order: list[int]
    sample_rows: list[int]
    logits: torch.Tensor
    common_prefix_len: int = 0


class ModelRunner:
    """Owns the KV caches and the builders; `execute` runs one scheduled step.

    Args:
        model: a model from `anyattn.engine.models` (`attention_layers()`, `forward`,
            `compute_logits`).
        num_blocks: engine blocks per layer cache (block 0 is the null block).
        block_size: engine block size.
        limits: the engine's batch limits (passed to every builder).
        device: where the model and caches live.
        dtype: the model dtype.
        kv_cache_dtype: "auto" or an fp8 / half cache dtype.
    """

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
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.limits = limits
        self.device = torch.device(device)
        self.dtype = dtype
        self.groups = self._make_groups(model.attention_layers(), kv_cache_dtype)
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
                    device=self.device,
                )
        self._log_cudagraph_support()

    def _make_groups(self, layers: list[Attention], kv_cache_dtype: str) -> list[KVCacheGroup]:
        by_key: dict[tuple, list[str]] = {}
        for layer in layers:
            kernel = layer.backend.get_kernel_block_size(self.block_size)
            spec = AttentionSpec(
                block_size=kernel,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_size,
                dtype=self.dtype,
                kv_cache_dtype=kv_cache_dtype,
                sliding_window=layer.sliding_window,
            )
            by_key.setdefault((layer.backend, spec), []).append(layer.layer_name)
        groups = []
        for (backend, spec), names in by_key.items():
            builder = backend.get_builder_cls()(spec, names, self.limits, self.device)
            groups.append(KVCacheGroup(backend, spec, names, builder, spec.block_size))
        return groups

    def _log_cudagraph_support(self) -> None:
        if self.device.type != "cuda":
            return
        levels = {
            group.backend.get_name(): group.backend.get_cudagraph_support(group.spec, self.limits)
            for group in self.groups
        }
        weakest = min(levels.values())
        if weakest == AttentionCGSupport.NEVER:
            names = ", ".join(n for n, lvl in levels.items() if lvl == AttentionCGSupport.NEVER)
            logger.info("CUDA graphs off, running eager: backend %s supports NEVER", names)

    @property
    def backend_names(self) -> list[str]:
        return sorted({g.backend.get_name() for g in self.groups})

    def _order(self, query_lens: list[int]) -> list[int]:
        """Batch order that every builder accepts: decodes first when one asks for it."""
        order = list(range(len(query_lens)))
        thresholds = [g.builder.reorder_batch_threshold for g in self.groups]
        thresholds = [t for t in thresholds if t is not None]
        if thresholds:
            # One layout serves every group; the smallest threshold keeps each group's
            # leading decodes within its own threshold.
            swaps = reorder_batch_to_split_decodes_and_prefills(query_lens, min(thresholds))
            apply_swaps(order, swaps)
        return order

    def _common_prefix_len(self, block_tables: Seq[Seq[int]], contexts: Seq[int]) -> int:
        """Leading KV blocks shared by every request, within every request's context."""
        if len(block_tables) < 2:
            return 0
        shared = 0
        for column in zip(*block_tables, strict=False):
            if column[0] == 0 or any(b != column[0] for b in column):
                break
            shared += 1
        return min(shared * self.block_size, min(contexts) // self.block_size * self.block_size)

    def execute(
        self,
        token_ids: Seq[Seq[int]],
        num_computed: Seq[int],
        num_new: Seq[int],
        block_tables: Seq[Seq[int]],
        needs_sample: Seq[bool],
    ) -> StepOutput:
        """Run one step.

        Args:
            token_ids: every request's known tokens (prompt + output so far).
            num_computed: tokens of each request already in the KV cache.
            num_new: tokens of each request to run this step (its query length).
            block_tables: each request's physical blocks (engine block size), covering
                `num_computed + num_new` tokens.
            needs_sample: whether the request's step ends at its last known token.

        Returns:
            A `StepOutput`: the order the step ran the requests in, the requests to sample and
            their float32 logits `[num_sampled, vocab_size]`, and the cascade prefix length.
        """
        order = self._order(list(num_new))
        query_lens = [num_new[i] for i in order]
        seq_lens = [num_computed[i] + num_new[i] for i in order]
        ids = np.concatenate(
            [
                np.asarray(token_ids[i][num_computed[i] : num_computed[i] + num_new[i]])
                for i in order
            ]
        )
        positions = np.concatenate(
            [np.arange(num_computed[i], num_computed[i] + num_new[i]) for i in order]
        )
        width = max(len(block_tables[i]) for i in order)
        table = torch.zeros(len(order), width, dtype=torch.int32)
        for row, i in enumerate(order):
            table[row, : len(block_tables[i])] = torch.tensor(block_tables[i], dtype=torch.int32)
        common = make_common_attn_metadata(
            query_lens, seq_lens, table, self.block_size, self.device
        )
        prefix_len = self._common_prefix_len(
            [block_tables[i] for i in order], [num_computed[i] for i in order]
        )
        attn_metadata, used_prefix = self._build(common, prefix_len, np.asarray(query_lens))
        input_ids = torch.from_numpy(ids).to(self.device, torch.long)
        pos = torch.from_numpy(positions).to(self.device, torch.long)
        with torch.inference_mode():
            hidden = self.model(input_ids, pos, attn_metadata, self.kv_caches)
            last = common.query_start_loc_cpu[1:].long() - 1
            rows = [row for row, i in enumerate(order) if needs_sample[i]]
            logits = self.model.compute_logits(hidden[last[rows].to(self.device)])
        return StepOutput(order, [order[r] for r in rows], logits, used_prefix)

    def _build(
        self, common: CommonAttentionMetadata, prefix_len: int, query_lens: np.ndarray
    ) -> tuple[dict[str, object], int]:
        metadata: dict[str, object] = {}
        used_prefix = 0
        for group in self.groups:
            group_common = common
            if group.kernel_block_size != self.block_size:
                table = expand_block_table(
                    common.block_table_tensor, self.block_size, group.kernel_block_size
                )
                group_common = replace(common, block_table_tensor=table)
            cascade = prefix_len > 0 and group.builder.use_cascade_attention(
                prefix_len,
                query_lens,
                num_query_heads=0,
                num_kv_heads=group.spec.num_kv_heads,
                use_alibi=False,
                use_sliding_window=group.spec.sliding_window is not None,
                use_local_attention=False,
                num_sms=0,
                dcp_world_size=1,
            )
            built = group.builder.build(prefix_len if cascade else 0, group_common)
            used_prefix = max(used_prefix, prefix_len if cascade else 0)
            for name in group.layer_names:
                metadata[name] = built
        return metadata, used_prefix
