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
    def require(ok: bool, name: str, shape: str, got: torch.Tensor) -> None:
        if not ok:
            raise ValueError(f"mla_oracle: {name} must be {shape} (got {tuple(got.shape)}).")

    require(w_uk.dim() == 3, "w_uk", "[num_heads, qk_nope_head_dim, kv_lora_rank]", w_uk)
    num_heads, nope, rank = w_uk.shape
    ok = w_uv.dim() == 3 and w_uv.shape[0] == num_heads and w_uv.shape[2] == rank
    require(ok, "w_uv", f"[{num_heads}, v_head_dim, {rank}] to match w_uk", w_uv)
    ok = q_nope.dim() == 3 and tuple(q_nope.shape[1:]) == (num_heads, nope)
    require(ok, "q_nope", f"[num_tokens, {num_heads}, {nope}] (from w_uk)", q_nope)
    ok = q_pe.dim() == 3 and q_pe.shape[:2] == q_nope.shape[:2]
    require(ok, "q_pe", f"[{q_nope.shape[0]}, {num_heads}, qk_rope_head_dim]", q_pe)
    ok = kv_c.dim() == 2 and kv_c.shape[1] == rank
    require(ok, "kv_c", f"[num_keys, {rank}] (kv_lora_rank from w_uk)", kv_c)
    want = (kv_c.shape[0], q_pe.shape[2])
    require(
        tuple(k_pe.shape) == want, "k_pe", f"[{want[0]}, {want[1]}] (one rope key per latent)", k_pe
    )
    if sum(query_lens) != q_nope.shape[0] or sum(seq_lens) != kv_c.shape[0]:
        raise ValueError(
            f"mla_oracle: lengths do not match the tensors (got sum(query_lens)={sum(query_lens)} "
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
