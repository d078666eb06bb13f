"""Dense attention oracles, written from docs/semantics.md and docs/mla.md and nothing else.

They loop over requests and materialise every score, so they are slow but obviously right. Run
them in float64 for the reference and in the input dtype to measure how much rounding that dtype
alone causes (the tolerance rule of `anyattn.testing.tolerance` needs both).

`mla_oracle` is plain multi-head attention over keys and values up-projected from one latent per
token: head h's key is `[W_UK[h] c_kv[j], k_pe[j]]` (the rope part shared by every head) and its
value `W_UV[h] c_kv[j]`. It never computes the absorbed form (`q_lat = W_UK^T q_nope` against the
latent cache) that decode kernels use, so that it judges absorption instead of repeating it. In
the model dtype the up-projection rounds its keys and values to that dtype, as a model layer's
`up_project` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["attention_oracle", "mla_oracle", "mla_up_project"]


def attention_oracle(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_lens: Sequence[int],
    seq_lens: Sequence[int], *, scale: float, causal: bool = True,
    sliding_window: int | None = None, logits_soft_cap: float | None = None,
    alibi_slopes: Sequence[float] | torch.Tensor | None = None, sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention of every query row over its own request's keys.

    Request r has `query_lens[r]` query rows and `seq_lens[r]` keys; its query row i sits at
    absolute position `p = seq_lens[r] - query_lens[r] + i` and key j at position j. Per head h
    (KV head `h // (num_heads // num_kv_heads)`), in this order:
    `s = scale * q·k`; soft cap `s = cap * tanh(s / cap)`; ALiBi `s += slope_h * (j - p)`;
    causal keeps `j <= p`; a sliding window W keeps `p - W < j <= p`. The softmax denominator is
    `sum_j exp(s_j)` over the kept keys, plus `exp(sinks[h])` when sinks are given.

    LSE convention: a sink is treated as one more key whose value is zero, so the returned LSE
    is the log of the whole denominator, `log(sum_j exp(s_j) + exp(sink_h))`. Then
    `output == sum_j exp(s_j - lse) * v_j` holds with and without sinks, and partial results can
    be merged with `merge_attn_states` as long as the sink is counted in exactly one part.
    A row with no kept key outputs zeros; its LSE is -inf (or `sink_h` with sinks).

    Args:
        query: `[num_tokens, num_heads, head_size]`, the requests' query rows back to back.
        key: `[sum(seq_lens), num_kv_heads, head_size]`, each request's keys (context and
            new tokens; for cross attention its encoder tokens) back to back, already
            dequantised when the cache is fp8.
        value: `[sum(seq_lens), num_kv_heads, value_size]`, the keys' values; `value_size`
            is usually `head_size` (MLA's up-projected values may differ).
        query_lens, seq_lens: query rows and keys per request (context + new tokens; the encoder
            length for cross attention, with `causal=False`).
        scale, causal, sliding_window (needs causal), logits_soft_cap (None or 0: none),
            alibi_slopes (one per query head), sinks (`[num_heads]` logits): as above.
        compute_dtype: float64 for the reference; the model dtype to measure the rounding that
            dtype alone causes. Inputs are cast to it and every step's result is rounded to it
            (scores, soft cap, ALiBi, probabilities, output); the softmax itself is one fused
            step with float32 (or wider) internals, as in torch's and in attention kernels.

    Returns:
        `(output, lse)`: output `[num_tokens, num_heads, value_size]` in `compute_dtype`, lse
        `[num_heads, num_tokens]` (natural log) in `compute_dtype` or float32 if narrower.

    Raises:
        ValueError: inconsistent shapes or lengths, or a sliding window without causal masking.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, value_size = key.shape[1], value.shape[-1]
    if key.shape[-1] != head_size or value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"attention_oracle: key must be [num_keys, num_kv_heads, {head_size}] and value "
            f"[num_keys, num_kv_heads, value_size] (got key {tuple(key.shape)}, value "
            f"{tuple(value.shape)})."
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"attention_oracle: num_heads must be a multiple of num_kv_heads (got {num_heads} "
            f"and {num_kv_heads})."
        )
    if len(query_lens) != len(seq_lens):
        raise ValueError(
            f"attention_oracle: query_lens and seq_lens differ in length (got {len(query_lens)} "
            f"and {len(seq_lens)})."
        )
    if sum(query_lens) != num_tokens or sum(seq_lens) != key.shape[0]:
        raise ValueError(
            f"attention_oracle: lengths do not match the tensors (got sum(query_lens)="
            f"{sum(query_lens)} for {num_tokens} query rows, sum(seq_lens)={sum(seq_lens)} for "
            f"{key.shape[0]} keys)."
        )
    if sliding_window is not None and not causal:
        raise ValueError(
            "attention_oracle: a sliding window is defined for causal attention only (got "
            "causal=False). Pass causal=True or no sliding_window."
        )
    group = num_heads // num_kv_heads
    device = query.device
    slopes = None
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, dtype=torch.float64, device=device).view(-1, 1, 1)
    sink_logits = None if sinks is None else sinks.to(device, compute_dtype).view(-1, 1, 1)

    output = torch.zeros(num_tokens, num_heads, value_size, dtype=compute_dtype, device=device)
    lse_dtype = torch.promote_types(compute_dtype, torch.float32)
    lse = torch.full((num_heads, num_tokens), -math.inf, dtype=lse_dtype, device=device)
    q_start = k_start = 0
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        q_end, k_end = q_start + query_len, k_start + seq_len
        # q: [num_heads, query_len, head_size]; k, v: [num_heads, seq_len, head_size]
        q = query[q_start:q_end].to(compute_dtype).transpose(0, 1)
        k = key[k_start:k_end].to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        v = value[k_start:k_end].to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        positions = torch.arange(query_len, device=device) + (seq_len - query_len)
        key_positions = torch.arange(seq_len, device=device)
        # distance: [query_len, seq_len], j - p
        distance = key_positions.view(1, -1) - positions.view(-1, 1)

        scores = (q @ k.transpose(1, 2)) * scale  # [num_heads, query_len, seq_len]
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        if slopes is not None:
            scores = scores + (slopes * distance).to(compute_dtype)
        allowed = torch.ones(query_len, seq_len, dtype=torch.bool, device=device)
        if causal:
            allowed &= distance <= 0
        if sliding_window is not None:
            allowed &= distance > -sliding_window
        scores = scores.masked_fill(~allowed, -math.inf)
        if sink_logits is not None:
            # The sink is a key with a zero value: it only enlarges the denominator.
            scores = torch.cat([scores, sink_logits.expand(-1, query_len, 1)], dim=-1)
            v = torch.cat([v, v.new_zeros(num_heads, 1, value_size)], dim=1)

        out_r, lse_r = _softmax_times_value(scores, v)
        output[q_start:q_end] = out_r.transpose(0, 1)
        lse[:, q_start:q_end] = lse_r
        q_start, k_start = q_end, k_end
    return output, lse


def _softmax_times_value(
    scores: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim (-inf = masked) times v; all-masked rows give zeros, -inf.

    The softmax is one fused step, as torch's own softmax and attention kernels do it: internals
    in at least float32, probabilities rounded once to the compute dtype, then `probs @ v` in
    the compute dtype. The LSE stays in that internal precision (kernels return it in float32).
    """
    num_heads, query_len, num_keys = scores.shape
    work_dtype = torch.promote_types(scores.dtype, torch.float32)
    if num_keys == 0:
        empty_out = scores.new_zeros(num_heads, query_len, v.shape[-1])
        return empty_out, scores.new_full((num_heads, query_len), -math.inf, dtype=work_dtype)
    scores = scores.to(work_dtype)
    row_max = scores.amax(dim=-1, keepdim=True)
    # An all-masked row has max -inf; shifting by 0 instead keeps exp() at 0 rather than NaN.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    has_key = denom > 0
    probs = weights / torch.where(has_key, denom, torch.ones_like(denom))
    out = probs.to(v.dtype) @ v
    lse = (row_max + torch.log(denom)).squeeze(-1)
    return out, lse


def mla_up_project(
    kv_c: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values from latents `kv_c [num_keys, L]`: `k_nope[j, h] = W_UK[h]
    c_kv[j]` `[num_keys, num_heads, P]` and `v[j, h] = W_UV[h] c_kv[j]` `[num_keys, num_heads,
    Vd]`, for `w_uk [num_heads, P, L]` and `w_uv [num_heads, Vd, L]` (else a ValueError). In a
    narrower `compute_dtype` the products are accumulated in float32 (as matmuls are) and
    rounded once to it."""
    fits = kv_c.dim() == 2 and w_uk.dim() == w_uv.dim() == 3 and w_uk.shape[0] == w_uv.shape[0]
    if not fits or not kv_c.shape[1] == w_uk.shape[2] == w_uv.shape[2]:
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
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
    w_uk: torch.Tensor, w_uv: torch.Tensor, query_lens: Sequence[int], seq_lens: Sequence[int], *,
    scale: float, compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
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
        scale, compute_dtype: as for `attention_oracle`.

    Returns:
        `(output [num_tokens, num_heads, v_head_dim], lse)` as `attention_oracle` returns them.

    Raises:
        ValueError: shapes that do not fit together, or lengths that do not match the tensors.
    """

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
    rows, rope = kv_c.shape[0], q_pe.shape[2]
    ok = tuple(k_pe.shape) == (rows, rope)
    require(ok, "k_pe", f"[{rows}, {rope}] (one rope key per latent)", k_pe)
    if sum(query_lens) != q_nope.shape[0] or sum(seq_lens) != rows:
        raise ValueError(
            f"mla_oracle: lengths do not match the tensors (got sum(query_lens)={sum(query_lens)} "
            f"for {q_nope.shape[0]} query rows, sum(seq_lens)={sum(seq_lens)} for {rows} latents)."
        )
    k_nope, v = mla_up_project(kv_c, w_uk, w_uv, compute_dtype)
    num_heads = w_uk.shape[0]
    # q, k: [rows, num_heads, qk_nope_head_dim + qk_rope_head_dim]; the rope key is every head's.
    rope_keys = k_pe.to(compute_dtype).unsqueeze(1).expand(-1, num_heads, -1)
    key = torch.cat([k_nope, rope_keys], dim=-1)
    query = torch.cat([q_nope.to(compute_dtype), q_pe.to(compute_dtype)], dim=-1)
    return attention_oracle(
        query, key, v, query_lens, seq_lens, scale=scale, compute_dtype=compute_dtype
    )
