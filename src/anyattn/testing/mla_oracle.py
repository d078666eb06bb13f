"""A dense MLA oracle, written from the definitions in docs/mla.md.

Multi-head latent attention is plain multi-head attention over keys and values that are
up-projected from one latent per token: head h's key is `[W_UK[h] c_kv[j], k_pe[j]]` (the rope
part shared by every head) and its value `W_UV[h] c_kv[j]`. The oracle computes exactly that,
the up-projected form, and never the absorbed one (`q_lat = W_UK^T q_nope` against the latent
cache) that decode kernels use, so that it judges absorption instead of repeating it. No paging:
it takes each request's latents in position order.

Run it in float64 for the reference and in the model dtype for the rounding that dtype alone
causes (`anyattn.testing.tolerance`): then the up-projection rounds its keys and values to that
dtype, as a model layer's `up_project` does, and the attention rounds as `attention_oracle`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from anyattn.testing.oracle import attention_oracle

__all__ = ["mla_oracle", "mla_up_project"]


def _check_shapes(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
) -> None:
    api = "mla_oracle"
    if w_uk.dim() != 3 or w_uv.dim() != 3:
        raise ValueError(
            f"{api}: w_uk must be [num_heads, qk_nope_head_dim, kv_lora_rank] and w_uv "
            f"[num_heads, v_head_dim, kv_lora_rank] (got {tuple(w_uk.shape)} and "
            f"{tuple(w_uv.shape)})."
        )
    num_heads, nope, rank = w_uk.shape
    if w_uv.shape[0] != num_heads or w_uv.shape[2] != rank:
        raise ValueError(
            f"{api}: w_uv must be [{num_heads}, v_head_dim, {rank}] to match w_uk "
            f"{tuple(w_uk.shape)} (got {tuple(w_uv.shape)})."
        )
    if q_nope.dim() != 3 or tuple(q_nope.shape[1:]) != (num_heads, nope):
        raise ValueError(
            f"{api}: q_nope must be [num_tokens, {num_heads}, {nope}] (from w_uk) "
            f"(got {tuple(q_nope.shape)})."
        )
    if q_pe.dim() != 3 or tuple(q_pe.shape[:2]) != tuple(q_nope.shape[:2]):
        raise ValueError(
            f"{api}: q_pe must be [{q_nope.shape[0]}, {num_heads}, qk_rope_head_dim] "
            f"(got {tuple(q_pe.shape)})."
        )
    rope = q_pe.shape[2]
    if kv_c.dim() != 2 or kv_c.shape[1] != rank:
        raise ValueError(
            f"{api}: kv_c must be [num_keys, {rank}] (kv_lora_rank from w_uk) "
            f"(got {tuple(kv_c.shape)})."
        )
    if tuple(k_pe.shape) != (kv_c.shape[0], rope):
        raise ValueError(
            f"{api}: k_pe must be [{kv_c.shape[0]}, {rope}] (one rope key per latent) "
            f"(got {tuple(k_pe.shape)})."
        )
    if sum(query_lens) != q_nope.shape[0] or sum(seq_lens) != kv_c.shape[0]:
        raise ValueError(
            f"{api}: lengths do not match the tensors (got sum(query_lens)={sum(query_lens)} "
            f"for {q_nope.shape[0]} query rows, sum(seq_lens)={sum(seq_lens)} for "
            f"{kv_c.shape[0]} latents)."
        )


def mla_up_project(
    kv_c: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values from latents: `k_nope[j, h] = W_UK[h] c_kv[j]`,
    `v[j, h] = W_UV[h] c_kv[j]`.

    In a narrower `compute_dtype` the products are accumulated in float32 (as matmuls are) and
    rounded once to it.

    Args:
        kv_c: `[num_keys, kv_lora_rank]`.
        w_uk: `[num_heads, qk_nope_head_dim, kv_lora_rank]`.
        w_uv: `[num_heads, v_head_dim, kv_lora_rank]`.

    Returns:
        `(k_nope, v)`: `[num_keys, num_heads, qk_nope_head_dim]` and
        `[num_keys, num_heads, v_head_dim]` in `compute_dtype`.

    Raises:
        ValueError: `kv_c`, `w_uk`, `w_uv` whose latent sizes or head counts differ.
    """
    if (
        kv_c.dim() != 2
        or w_uk.dim() != 3
        or w_uv.dim() != 3
        or w_uk.shape[0] != w_uv.shape[0]
        or not kv_c.shape[1] == w_uk.shape[2] == w_uv.shape[2]
    ):
        raise ValueError(
            f"mla_up_project: kv_c must be [num_keys, L], w_uk [num_heads, P, L] and w_uv "
            f"[num_heads, Vd, L] (got {tuple(kv_c.shape)}, {tuple(w_uk.shape)} and "
            f"{tuple(w_uv.shape)})."
        )
    work = torch.promote_types(compute_dtype, torch.float32)
    latents = kv_c.to(compute_dtype).to(work)
    k_nope = torch.einsum("nl,hpl->nhp", latents, w_uk.to(compute_dtype).to(work))
    v = torch.einsum("nl,hvl->nhv", latents, w_uv.to(compute_dtype).to(work))
    return k_nope.to(compute_dtype), v.to(compute_dtype)


def mla_oracle(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal MLA of every query row over its own request's tokens, up-projected.

    Request r has `query_lens[r]` query rows and `seq_lens[r]` tokens (context, then its new
    tokens); query row i sits at position `seq_lens[r] - query_lens[r] + i` and attends to the
    request's tokens at positions up to its own:
    `o[t, h] = sum_j softmax_j(scale * (q_nope[t, h] . W_UK[h] c_kv[j] + q_pe[t, h] . k_pe[j]))
    W_UV[h] c_kv[j]`.

    Args:
        q_nope: `[num_tokens, num_heads, qk_nope_head_dim]`, the requests' rows back to back.
        q_pe: `[num_tokens, num_heads, qk_rope_head_dim]`, rope already applied.
        kv_c: `[sum(seq_lens), kv_lora_rank]`, each request's latents in position order
            (already dequantised when they come from an fp8 cache).
        k_pe: `[sum(seq_lens), qk_rope_head_dim]`, the shared rope keys, rope applied.
        w_uk: `[num_heads, qk_nope_head_dim, kv_lora_rank]`, the key half of `kv_b_proj`.
        w_uv: `[num_heads, v_head_dim, kv_lora_rank]`, its value half.
        query_lens, seq_lens: rows and tokens per request.
        scale: multiplies the scores.
        compute_dtype: float64 for the reference; the model dtype to measure its rounding.

    Returns:
        `(output, lse)`: output `[num_tokens, num_heads, v_head_dim]` in `compute_dtype`, lse
        `[num_heads, num_tokens]` (natural log) in `compute_dtype` or float32 if narrower.

    Raises:
        ValueError: shapes that do not fit together, or lengths that do not match the tensors.
    """
    _check_shapes(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, query_lens, seq_lens)
    k_nope, v = mla_up_project(kv_c, w_uk, w_uv, compute_dtype)
    num_heads = w_uk.shape[0]
    # q, k: [rows, num_heads, qk_nope_head_dim + qk_rope_head_dim]; the rope key is every head's.
    rope_keys = k_pe.to(compute_dtype).unsqueeze(1).expand(-1, num_heads, -1)
    key = torch.cat([k_nope, rope_keys], dim=-1)
    query = torch.cat([q_nope.to(compute_dtype), q_pe.to(compute_dtype)], dim=-1)
    return attention_oracle(
        query, key, v, query_lens, seq_lens, scale=scale, compute_dtype=compute_dtype
    )
