"""Build one step's MLA batch for a backend: inputs, weights, a shuffled latent cache, metadata.

The kit writes each request's context latents into the cache with its own writer; the backend
writes the step's new rows itself (`do_kv_cache_update`). Blocks are shuffled over a pool
larger than needed, the null block never assigned (`anyattn.testing.blocks`).

Random values are scaled like a real layer's: latents are RMS-normalised (entries ~ 1), the
up-projections `W_UK`, `W_UV` have entries ~ 1/sqrt(L) so that up-projected keys and values
have entries ~ 1, and scores are O(1) after the scale.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from anyattn.backend import AttentionBackend, LayerParams
from anyattn.config import BatchLimits, MLAAttentionSpec
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.slots import expand_block_table
from anyattn.testing.batch_spec import BatchSpec
from anyattn.testing.blocks import assign_blocks, token_slots
from anyattn.testing.cache_io import as_stored, write_latents
from anyattn.testing.mla_cases import MLAShape
from anyattn.testing.paged import PagedStep, gather_rows

__all__ = ["MLABatch", "build_mla_batch"]


@dataclass
class MLABatch(PagedStep):
    """One MLA step, ready to hand to a backend, and what the oracle needs to judge it; its
    `kv_cache` is `[num_blocks, block_size, L + R]`, `k_scale` the per-layer fp8 scale `[]`.

    Attributes:
        shape: the layer's sizes (L, R, P, Vd).
        q_nope: `[num_tokens + num_padding_tokens, num_heads, P]`, model dtype.
        q_pe: `[num_tokens + num_padding_tokens, num_heads, R]`, rope applied (random here).
        kv_c, k_pe: the step's new latents `[num_tokens + num_padding_tokens, L]` / `[.., R]`.
        w_uk, w_uv: `[num_heads, P, L]` / `[num_heads, Vd, L]`, model dtype.
        given_rows: per request, float64 `[seq_len, L + R]`: its latents as drawn (model dtype).
        stored_rows: per request, float64 `[seq_len, L + R]`: as the cache gives them back.
    """

    shape: MLAShape
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    given_rows: list[torch.Tensor]
    stored_rows: list[torch.Tensor]

    def oracle_latents(self, num_decodes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 `(kv_c [sum(seq_lens), L], k_pe [.., R])`: what each request attends to.

        The decode path (`forward_mqa`, the first `num_decodes` requests) reads every row from
        the cache; the prefill path (`forward_mha`) reads the context from the cache and takes
        the new tokens' latents as given (docs/mla.md). They differ only for fp8 caches.
        """
        rows = []
        for r, (stored, given) in enumerate(zip(self.stored_rows, self.given_rows, strict=True)):
            if r < num_decodes:
                rows.append(stored)
            else:
                context = self.spec.context_lens[r]
                rows.append(torch.cat([stored[:context], given[context:]]))
        latents = torch.cat(rows)
        return latents.split([self.shape.kv_lora_rank, self.shape.qk_rope_head_dim], dim=-1)


def build_mla_batch(
    backend: type[AttentionBackend], spec: BatchSpec, *, shape: MLAShape, num_heads: int,
    dtype: torch.dtype, device: torch.device | str = "cpu", block_size: int = 16,
    kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None, num_padding_tokens: int = 0,
    layers: Mapping[str, LayerParams], seed: int = 0,
) -> MLABatch:  # fmt: skip
    """Make inputs, weights, a shuffled latent cache and the backend's own metadata for `spec`,
    as `anyattn.testing.build_batch` does for decoder attention (block size, decodes first,
    padding, `layers` and `seed` alike; a block size the backend cannot take is a ValueError).

    Args:
        shape: the layer's sizes; the cache row is `L + R`.
        num_heads: query heads.
        dtype: model dtype of queries, latents and weights.
        k_scale: float32 `[]`, the per-layer fp8 scale (default 1.0).
    """
    device = torch.device(device)
    kernel_block_size = backend.get_kernel_block_size(block_size)
    k_scale = (torch.ones(()) if k_scale is None else k_scale.float()).to(device)
    g = torch.Generator().manual_seed(seed)
    rank, rope, nope = shape.kv_lora_rank, shape.qk_rope_head_dim, shape.qk_nope_head_dim
    queries, rows = [], []  # per request: [q, H, P + R] (q_nope, then q_pe) and [s, L + R]
    for query_len, seq_len in zip(spec.query_lens, spec.seq_lens, strict=True):
        queries.append(torch.randn(query_len, num_heads, nope + rope, generator=g))
        latents = torch.randn(seq_len, rank, generator=g)
        # RMS-normalised, as kv_a_layernorm leaves them.
        latents = latents / latents.pow(2).mean(-1, keepdim=True).sqrt()
        rows.append(torch.cat([latents, torch.randn(seq_len, rope, generator=g)], -1))
    padding = torch.randn(num_padding_tokens, num_heads * (nope + rope) + rank + rope, generator=g)
    w_uk = torch.randn(num_heads, nope, rank, generator=g) / math.sqrt(rank)
    w_uv = torch.randn(num_heads, shape.v_head_dim, rank, generator=g) / math.sqrt(rank)

    kv_spec = MLAAttentionSpec(
        block_size=kernel_block_size, num_kv_heads=1, head_size=shape.head_size, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
        v_head_dim=shape.v_head_dim,
    )  # fmt: skip
    limits = BatchLimits(
        max_num_reqs=spec.num_reqs, max_num_tokens=spec.num_tokens + num_padding_tokens,
        max_model_len=max(spec.seq_lens),
    )  # fmt: skip
    builder = backend.get_builder_cls()(kv_spec, layers, limits, device)
    order = spec.decodes_first_order(builder.reorder_batch_threshold)
    spec = spec.permuted(order)
    queries = [queries[i].to(dtype) for i in order]
    rows = [rows[i].to(dtype) for i in order]

    engine_table, num_engine_blocks = assign_blocks(spec.seq_lens, block_size, generator=g)
    block_table = expand_block_table(engine_table, block_size, kernel_block_size)
    num_blocks = num_engine_blocks * (block_size // kernel_block_size)
    kv_cache = allocate_kv_cache(
        backend, num_blocks, kernel_block_size, 1, shape.head_size, dtype, kv_cache_dtype, None,
        device,
    )  # fmt: skip
    context = [torch.arange(c) for c in spec.context_lens]
    new = [torch.arange(c, s) for c, s in zip(spec.context_lens, spec.seq_lens, strict=True)]

    def write(cache: torch.Tensor, positions: list[torch.Tensor]) -> None:
        latents = gather_rows(rows, positions).to(device).split([rank, rope], -1)
        slots = token_slots(block_table, positions, kernel_block_size).to(device)
        write_latents(cache, *latents, slots, kv_cache_dtype, k_scale)

    write(kv_cache, context)
    expected_kv_cache = kv_cache.clone()
    write(expected_kv_cache, new)
    new_rows = gather_rows(rows, new)
    num_padded = spec.num_tokens + num_padding_tokens if num_padding_tokens else None
    common = make_common_attn_metadata(
        spec.query_lens, spec.seq_lens, block_table, kernel_block_size, device,
        num_padded_tokens=num_padded,
    )  # fmt: skip
    attn_metadata = builder.build(0, common)

    qk = nope + rope
    query = torch.cat([*queries, padding[:, : num_heads * qk].view(-1, num_heads, qk).to(dtype)])
    step_rows = torch.cat([new_rows, padding[:, num_heads * qk :].to(dtype)])
    cache_dtype = kv_cache.dtype
    # Contiguous, as the layer hands them over.
    q_nope, q_pe = (x.contiguous().to(device) for x in query.split([nope, rope], -1))
    kv_c, k_pe = (x.contiguous().to(device) for x in step_rows.split([rank, rope], -1))
    return MLABatch(
        spec=spec, order=order, shape=shape, block_size=kernel_block_size, q_nope=q_nope,
        q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, w_uk=w_uk.to(dtype).to(device),
        w_uv=w_uv.to(dtype).to(device), kv_cache=kv_cache, expected_kv_cache=expected_kv_cache,
        block_table=block_table.to(device), common_attn_metadata=common,
        attn_metadata=attn_metadata, builder=builder,
        given_rows=[x.double().to(device) for x in rows],
        stored_rows=[as_stored(x.to(device), kv_cache_dtype, cache_dtype, k_scale) for x in rows],
        k_scale=k_scale, kv_cache_dtype=kv_cache_dtype, num_actual_tokens=spec.num_tokens,
    )  # fmt: skip
