"""`KVCacheGroup`: attention layers that share one backend and one KV-cache spec (an
`AttentionSpec`, or an `MLAAttentionSpec` for MLA's latent cache), and the one metadata builder
serving them (a plain model has one group; Gemma2's sliding and global layers make two). A
per-phase group also has a prefill backend and its builder: decode requests run on the first,
prefill requests on the second, over one cache per layer in the layout both take
(docs/per_phase.md). Every group reads the engine's block table and slot mapping; a group whose
kernel block is smaller than the engine block reads the table expanded to kernel blocks (slot
numbers are the same in both)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from anyattn.backend import AttentionBackend, AttentionMetadataBuilder
from anyattn.config import AttentionSpec
from anyattn.metadata import CommonAttentionMetadata, expand_block_table
from anyattn.types import KVCacheLayout

__all__ = ["KVCacheGroup", "in_kernel_blocks"]


@dataclass
class KVCacheGroup:
    """Layers that share a backend and a KV-cache spec, and the one builder serving them.

    `num_query_heads`: the most query heads of its layers (for the cascade cost model);
    `has_alibi`: whether any of them biases by ALiBi (which rules cascade attention out);
    `prefill_backend`, `prefill_builder`: the prefill rows' backend and builder of a per-phase
    group (None: one backend for every row); `layout`: the caches' physical layout (None: the
    backend's preferred one).
    """

    backend: type[AttentionBackend]
    spec: AttentionSpec
    layer_names: list[str]
    builder: AttentionMetadataBuilder
    kernel_block_size: int
    num_query_heads: int
    has_alibi: bool = False
    prefill_backend: type[AttentionBackend] | None = None
    prefill_builder: AttentionMetadataBuilder | None = None
    layout: KVCacheLayout | None = None

    def describe(self) -> str:
        """The backend name, or `"DEC (decode) + PRE (prefill)"` for a per-phase group."""
        name = self.backend.get_name()
        if self.prefill_backend is None:
            return name
        return f"{name} (decode) + {self.prefill_backend.get_name()} (prefill)"


def in_kernel_blocks(
    group: KVCacheGroup,
    common: CommonAttentionMetadata,
    block_size: int,
    device_table: torch.Tensor | None = None,
) -> CommonAttentionMetadata:
    """`common` with its block tables in `group`'s kernel blocks (`common` itself when they are
    the engine's `block_size`); `device_table`: the expanded device table when it is already
    made (a persistent buffer)."""
    if group.kernel_block_size == block_size:
        return common
    kernel = group.kernel_block_size
    if device_table is None:
        device_table = expand_block_table(common.block_table_tensor, block_size, kernel)
    cpu_table = expand_block_table(common.block_table_cpu, block_size, kernel)
    return replace(common, block_table_tensor=device_table, block_table_cpu=cpu_table)
