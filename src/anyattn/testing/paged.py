"""Build one step's batch for a backend: inputs, a shuffled paged KV cache, real metadata.

The kit writes each request's context (the tokens before this step) into the cache with its own
simple writer; the backend writes the step's new tokens itself. Blocks are shuffled, the null
block never assigned (`anyattn.testing.blocks`).

Caches must have the standard logical shape `(num_blocks, 2, block_size, num_kv_heads,
head_size)` (index 1: 0 = K, 1 = V); NHD and HND layouts differ only in strides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from anyattn.backend import AttentionBackend, AttentionMetadataBuilder, LayerParams
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import CommonAttentionMetadata, make_common_attn_metadata
from anyattn.slots import expand_block_table
from anyattn.testing.batch_spec import BatchSpec
from anyattn.testing.blocks import assign_blocks, cross_slot_mapping, token_slots
from anyattn.testing.cache_io import as_stored, write_kv
from anyattn.types import ENCODER_TYPES, AttentionType, KVCacheLayout

__all__ = ["PagedBatch", "PagedStep", "build_batch", "gather_rows", "layer_records"]


def layer_records(
    spec: AttentionSpec, names: Sequence[str] = ("layer.0",), num_heads: int | None = None,
    attn_type: AttentionType | str = AttentionType.DECODER,
) -> dict[str, LayerParams]:  # fmt: skip
    """Records of plain layers of `spec`'s group, for a builder's `layers` argument: `spec`'s
    KV heads, head size, cache dtype and window, `num_heads` query heads (default: as many as
    KV heads), scale `head_size ** -0.5`, no soft cap, ALiBi or sinks."""
    params = LayerParams(
        num_heads=spec.num_kv_heads if num_heads is None else num_heads,
        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, scale=spec.head_size**-0.5,
        attn_type=AttentionType(attn_type), kv_cache_dtype=spec.kv_cache_dtype,
        sliding_window=spec.sliding_window,
    )  # fmt: skip
    return dict.fromkeys(names, params)


@dataclass
class PagedStep:
    """What every kit step holds: a shuffled paged cache and the backend's metadata.

    Attributes:
        spec: the batch as laid out (decodes first when the builder asked for it); request i
            of it is request `order[i]` of the spec the batch was built from.
        block_size: kernel block size of `kv_cache` and `block_table` (int32 `[num_reqs,
            max_blocks]`, device).
        kv_cache: the layer's cache with the context written (the backend writes the rest), and
            expected_kv_cache as it must be once the backend has written the step's rows.
        common_attn_metadata: the step's metadata (`slot_mapping` -1 on padding rows), and
            attn_metadata what the backend's `builder` built from it.
        k_scale: float32 `[]` or `[num_kv_heads]` (device); kv_cache_dtype: the cache dtype name.
        num_actual_tokens: real query rows (`spec.num_tokens`).
    """

    spec: BatchSpec
    order: list[int]
    block_size: int
    kv_cache: torch.Tensor
    expected_kv_cache: torch.Tensor
    block_table: torch.Tensor
    common_attn_metadata: CommonAttentionMetadata
    attn_metadata: object
    builder: AttentionMetadataBuilder
    k_scale: torch.Tensor
    kv_cache_dtype: str
    num_actual_tokens: int


@dataclass
class PagedBatch(PagedStep):
    """One step, ready to hand to a backend, and what the oracle needs to judge it.

    Attributes:
        query: `[num_tokens + num_padding_tokens, num_heads, head_size]`, model dtype.
        key, value: what `forward` receives: the new tokens' K/V `[num_tokens (+ padding),
            num_kv_heads, head_size]`; for cross attention the encoder K/V of first-step
            requests, or None when no request is at its first step.
        kv_lens: keys per request (seq_lens, or encoder lengths for cross attention).
        oracle_key, oracle_value: float64 `[sum(kv_lens), num_kv_heads, head_size]`, the keys
            each request attends to, as stored (fp8 dequantised), computed by the kit.
        v_scale: float32 `[]` or `[num_kv_heads]` (device).
        attn_type: the attention type; causal: the metadata's causal flag.
    """

    query: torch.Tensor
    key: torch.Tensor | None
    value: torch.Tensor | None
    kv_lens: tuple[int, ...]
    oracle_key: torch.Tensor
    oracle_value: torch.Tensor
    v_scale: torch.Tensor
    attn_type: AttentionType
    causal: bool


def gather_rows(source: list[torch.Tensor], positions: list[torch.Tensor]) -> torch.Tensor:
    """The rows `positions[r]` of each `source[r]`, back to back."""
    return torch.cat([x[pos] for x, pos in zip(source, positions, strict=True)])


def build_batch(
    backend: type[AttentionBackend], spec: BatchSpec, *, num_heads: int, num_kv_heads: int,
    head_size: int, dtype: torch.dtype, device: torch.device | str = "cpu", block_size: int = 16,
    layout: KVCacheLayout | str = KVCacheLayout.NHD, kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    attn_type: AttentionType | str = AttentionType.DECODER, causal: bool = True,
    sliding_window: int | None = None, num_padding_tokens: int = 0,
    layers: Mapping[str, LayerParams] | None = None, seed: int = 0,
) -> PagedBatch:  # fmt: skip
    """Make inputs, a shuffled paged cache and the backend's own metadata for `spec`.

    The engine block size `block_size` must be accepted by the backend; when its kernel block
    size is smaller, blocks are split (`expand_block_table`) and the cache, the block table and
    the builder's `AttentionSpec` all use the kernel block size. When the builder sets
    `reorder_batch_threshold`, requests are reordered decodes first, as the engine would.

    Attention types: DECODER writes each request's context into the cache and passes the new
    tokens as key/value. ENCODER / ENCODER_ONLY leave the cache alone (key/value are all the
    request's tokens; metadata `causal=False`). ENCODER_DECODER keeps each request's encoder
    K/V in the cache: the kit writes them for requests past their first step, the backend for
    first-step requests (`key`/`value` hold them, and the metadata's slot mapping has one entry
    per such encoder token); `encoder_seq_lens` is set and `causal=False`.

    Args:
        spec: the batch; `common_prefix_len` > 0 shares the prefix's physical blocks.
        dtype: model dtype of query/key/value.
        k_scale, v_scale: float32 `[]` or `[num_kv_heads]` (default 1.0).
        causal: decoder causality (False: bidirectional over the cache).
        sliding_window: W, passed to the builder's `AttentionSpec`.
        num_padding_tokens: extra query/key/value rows past the real ones, with slot -1.
        layers: the group's layers and records (`{name: impl.layer_params()}`), given to the
            builder's constructor as an engine does; default one plain "layer.0"
            (`layer_records`).
        seed: fixes every random value and block assignment.

    Raises:
        ValueError: a block size the backend cannot take, or a spec the attention type cannot
            use (cross attention without encoder lengths).
    """
    device = torch.device(device)
    attn_type = AttentionType(attn_type)
    is_cross = attn_type is AttentionType.ENCODER_DECODER
    is_encoder = attn_type in ENCODER_TYPES
    if is_cross and spec.encoder_seq_lens is None:
        raise ValueError(
            f"build_batch: cross attention needs encoder_seq_lens (got none in {spec.name!r})."
        )
    if is_encoder and spec.seq_lens != spec.query_lens:
        raise ValueError(
            f"build_batch: encoder attention needs seq_lens == query_lens (got {spec.name!r})."
        )
    kernel_block_size = backend.get_kernel_block_size(block_size)
    one = torch.ones((), dtype=torch.float32)
    k_scale = (one if k_scale is None else k_scale.float()).to(device)
    v_scale = (one if v_scale is None else v_scale.float()).to(device)
    g = torch.Generator().manual_seed(seed)
    kv_lens = spec.encoder_seq_lens if is_cross else spec.seq_lens
    assert kv_lens is not None
    # Per request (given order): queries [q, H, D], keys and values [kv_len, H_kv, D]. A shared
    # prefix has one set of K/V: every request reads the same physical blocks.
    prefix = spec.common_prefix_len
    prefix_k, prefix_v = (torch.randn(prefix, num_kv_heads, head_size, generator=g) for _ in "kv")
    queries, keys, values = [], [], []
    for query_len, kv_len in zip(spec.query_lens, kv_lens, strict=True):
        queries.append(torch.randn(query_len, num_heads, head_size, generator=g))
        own = (kv_len - prefix, num_kv_heads, head_size)
        keys.append(torch.cat([prefix_k, torch.randn(own, generator=g)]))
        values.append(torch.cat([prefix_v, torch.randn(own, generator=g)]))
    padding = torch.randn(num_padding_tokens, num_heads + 2 * num_kv_heads, head_size, generator=g)

    limits = BatchLimits(
        max_num_reqs=spec.num_reqs, max_num_tokens=spec.num_tokens + num_padding_tokens,
        max_model_len=max(max(spec.seq_lens), max(kv_lens)),
    )  # fmt: skip
    kv_spec = AttentionSpec(
        kernel_block_size, num_kv_heads, head_size, dtype, kv_cache_dtype, sliding_window
    )
    if layers is None:
        layers = layer_records(kv_spec, num_heads=num_heads, attn_type=attn_type)
    builder = backend.get_builder_cls()(kv_spec, layers, limits, device)
    order = spec.decodes_first_order(builder.reorder_batch_threshold)
    spec, kv_lens = spec.permuted(order), tuple(kv_lens[i] for i in order)
    queries, keys, values = ([x[i].to(dtype) for i in order] for x in (queries, keys, values))
    padding_query, padding_k, padding_v = padding.to(dtype).split(
        [num_heads, num_kv_heads, num_kv_heads], 1
    )

    # Cross attention: as wide as the decoder's positions too, columns its keys never read.
    engine_table, num_engine_blocks = assign_blocks(
        kv_lens, block_size, common_prefix_len=spec.common_prefix_len,
        num_cols=-(-max(spec.seq_lens) // block_size), generator=g,
    )  # fmt: skip
    block_table = expand_block_table(engine_table, block_size, kernel_block_size)
    num_blocks = num_engine_blocks * (block_size // kernel_block_size)
    kv_cache = allocate_kv_cache(
        backend, num_blocks, kernel_block_size, num_kv_heads, head_size, dtype, kv_cache_dtype,
        layout, device,
    )  # fmt: skip

    # Per request, the key positions the kit writes now and those the step brings.
    kit_pos, step_pos = [], []
    for r, kv_len in enumerate(kv_lens):
        if is_encoder:
            cut = 0
        elif is_cross:
            cut = 0 if spec.is_first_step[r] else kv_len
        else:
            cut = spec.context_lens[r]
        kit_pos.append(torch.arange(cut))
        step_pos.append(torch.arange(cut, kv_len))
    scales = (kv_cache_dtype, k_scale, v_scale)

    def write(cache: torch.Tensor, positions: list[torch.Tensor]) -> None:
        slots = token_slots(block_table, positions, kernel_block_size).to(device)
        k, v = (gather_rows(x, positions).to(device) for x in (keys, values))
        write_kv(cache, k, v, slots, *scales)

    write(kv_cache, kit_pos)
    expected_kv_cache = kv_cache.clone()
    if not is_encoder:
        write(expected_kv_cache, step_pos)
    step_key, step_value = gather_rows(keys, step_pos), gather_rows(values, step_pos)
    if is_cross:
        key = step_key.to(device) if step_key.shape[0] else None
        value = step_value.to(device) if step_value.shape[0] else None
    else:
        key = torch.cat([step_key, padding_k]).to(device)
        value = torch.cat([step_value, padding_v]).to(device)

    slot_mapping = None  # from key's rows, except for cross attention's encoder tokens
    if is_cross:
        slot_mapping = cross_slot_mapping(
            block_table, kv_lens, spec.is_first_step, kernel_block_size
        )
    num_padded = spec.num_tokens + num_padding_tokens if num_padding_tokens else None
    common = make_common_attn_metadata(
        spec.query_lens, spec.seq_lens, block_table, kernel_block_size, device,
        causal=causal and attn_type is AttentionType.DECODER,
        encoder_seq_lens=spec.encoder_seq_lens if is_cross else None,
        num_padded_tokens=num_padded, slot_mapping=slot_mapping,
    )  # fmt: skip
    attn_metadata = builder.build(spec.common_prefix_len, common)

    all_key, all_value = torch.cat(keys).to(device), torch.cat(values).to(device)
    if is_encoder:
        # Encoder attention reads the step's own key/value, never the cache.
        oracle_key, oracle_value = all_key.double(), all_value.double()
    else:
        oracle_key = as_stored(all_key, kv_cache_dtype, kv_cache.dtype, k_scale)
        oracle_value = as_stored(all_value, kv_cache_dtype, kv_cache.dtype, v_scale)
    return PagedBatch(
        spec=spec, order=order, block_size=kernel_block_size,
        query=torch.cat([*queries, padding_query]).to(device), key=key, value=value,
        kv_cache=kv_cache, expected_kv_cache=expected_kv_cache, block_table=block_table.to(device),
        common_attn_metadata=common, attn_metadata=attn_metadata, builder=builder, kv_lens=kv_lens,
        oracle_key=oracle_key, oracle_value=oracle_value, k_scale=k_scale, v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype, attn_type=attn_type, causal=bool(common.causal),
        num_actual_tokens=spec.num_tokens,
    )  # fmt: skip
