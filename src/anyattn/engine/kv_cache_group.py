"""`KVCacheGroup`: attention layers that share one backend and one KV-cache spec (an
`AttentionSpec`, or an `MLAAttentionSpec` for MLA's latent cache), and the one metadata builder
serving them (Gemma2's sliding and global layers make two groups). A group whose kernel block is
smaller than the engine block reads the block table expanded to kernel blocks (slot numbers are
the same in both).

A per-phase group (docs/per_phase.md) also has a prefill backend and builder over the same
caches. Its step is laid out decodes first (`ModelRunner._order`), so the decode requests are
the leading rows; each part gets its own `CommonAttentionMetadata` (`split_by_phase`) and
builder's metadata, and the layer writes K/V once for the whole step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from anyattn.backend import AttentionBackend, AttentionMetadataBuilder
from anyattn.config import AttentionSpec
from anyattn.metadata import (
    CommonAttentionMetadata,
    expand_block_table,
    split_decodes_and_prefills,
)
from anyattn.phase_metadata import PhaseSplitMetadata, split_by_phase
from anyattn.types import KVCacheLayout

__all__ = ["KVCacheGroup", "build_by_phase", "in_kernel_blocks"]


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


def build_by_phase(
    group: KVCacheGroup,
    common: CommonAttentionMetadata,
    decode_threshold: int,
    cascade_len: Callable[[AttentionMetadataBuilder, np.ndarray], int],
) -> tuple[PhaseSplitMetadata, int]:
    """Build one step of the per-phase `group`: `common` in its kernel blocks, ordered decodes
    (query length <= `decode_threshold`) first; `cascade_len(builder, query_lens)` is the shared
    prefix a part's builder runs by cascade (0: none). Returns the layers' `PhaseSplitMetadata`
    and the longest shared prefix a part ran by cascade."""
    assert group.prefill_builder is not None, "a per-phase group has a prefill builder"
    num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(common, decode_threshold)
    decode, prefill = split_by_phase(common, num_decodes)
    query_lens = common.host_batch.query_lens
    parts = (
        (group.builder, decode, query_lens[:num_decodes]),
        (group.prefill_builder, prefill, query_lens[num_decodes:]),
    )
    built: list[object | None] = []
    used_prefix = 0
    for builder, part, lens in parts:
        if part is None:
            built.append(None)
            continue
        prefix = cascade_len(builder, lens)
        built.append(builder.build(prefix, part))
        used_prefix = max(used_prefix, prefix)
    return PhaseSplitMetadata(common, num_decode_tokens, built[0], built[1]), used_prefix
