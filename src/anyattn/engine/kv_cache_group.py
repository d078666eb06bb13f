"""`KVCacheGroup`: attention layers that share one backend and one `AttentionSpec`, and the one
metadata builder serving them (a plain model has one group; Gemma2's sliding and global layers
make two). Every group reads the engine's block table and slot mapping; a group whose kernel
block is smaller than the engine block gets the table expanded to kernel blocks."""

from __future__ import annotations

from dataclasses import dataclass

from anyattn.backend import AttentionBackend, AttentionMetadataBuilder
from anyattn.config import AttentionSpec

__all__ = ["KVCacheGroup"]


@dataclass
class KVCacheGroup:
    """Layers that share a backend and a KV-cache spec, and the one builder serving them.

    `num_query_heads` is the query heads of its layers (the spec holds only the KV heads); the
    largest, should they differ, for the cascade cost model. `has_alibi`: whether any of them
    biases by ALiBi (position-dependent, which rules cascade attention out).
    """

    backend: type[AttentionBackend]
    spec: AttentionSpec
    layer_names: list[str]
    builder: AttentionMetadataBuilder
    kernel_block_size: int
    num_query_heads: int
    has_alibi: bool = False
