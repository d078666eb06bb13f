"""A per-phase group's step: its decode requests built by the decode builder, the rest by the
prefill builder (docs/per_phase.md).

The runner lays every step out decodes first (`ModelRunner._order`, at the same threshold
passed here), so the decode requests are the leading rows and the prefill requests (fresh or
chunked) the rest. Each part gets its own `CommonAttentionMetadata` (`split_by_phase`) and
its own builder's metadata; the layer writes K/V once for the whole step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from anyattn.backend import AttentionMetadataBuilder
from anyattn.engine.kv_cache_group import KVCacheGroup
from anyattn.metadata import CommonAttentionMetadata, split_decodes_and_prefills
from anyattn.phase_metadata import PhaseSplitMetadata, split_by_phase

__all__ = ["CascadeLen", "build_by_phase", "split_threshold"]

CascadeLen = Callable[[AttentionMetadataBuilder, np.ndarray], int]
"""`cascade_len(builder, query_lens) -> common_prefix_len` for one part's requests (0: none)."""


def split_threshold(group: KVCacheGroup) -> int:
    """The query length at or below which a per-phase group's request is a decode: the decode
    builder's `reorder_batch_threshold`, else 1."""
    threshold = group.builder.reorder_batch_threshold
    return 1 if threshold is None else threshold


def build_by_phase(
    group: KVCacheGroup,
    common: CommonAttentionMetadata,
    decode_threshold: int,
    cascade_len: CascadeLen,
) -> tuple[PhaseSplitMetadata, int]:
    """Build one step of the per-phase `group`.

    Args:
        group: a group with a `prefill_builder`.
        common: the step in the group's kernel blocks, decodes (query length at most
            `decode_threshold`) first.
        decode_threshold: the threshold the step was ordered by.
        cascade_len: the shared-prefix length each part's builder runs by cascade (0: none).

    Returns:
        `(metadata, common_prefix_len)`: the layers' `PhaseSplitMetadata` and the longest shared
        prefix a part ran by cascade.
    """
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
