"""The merge of split-KV partial results (flash-decoding's second kernel).

`reduce_splits_kernel` weighs each of a (token, head)'s `num_splits` partial outputs by
`exp2(lse_s - max)` and writes the merged row (and, when asked, the natural-log LSE). A split
with no key weighs 0; a row with no key gets zeros and LSE -inf; padding rows are untouched.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = ["reduce_splits_kernel"]

if triton is not None:

    @triton.jit
    def reduce_splits_kernel(
        output,
        output_lse,
        partial_out,
        partial_lse,
        query_start_loc,
        num_reqs,
        stride_ot,
        stride_oh,
        stride_od,
        stride_lh,
        stride_lt,
        stride_pt,
        stride_ph,
        stride_ps,
        stride_pd,
        stride_plt,
        stride_plh,
        stride_pls,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HAS_LSE: tl.constexpr,
    ):
        """Merge the splits of one (token, head): weights exp2(lse_s - max)."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        if token >= tl.load(query_start_loc + num_reqs):
            return  # padding rows stay untouched
        token64 = token.to(tl.int64)
        splits = tl.arange(0, SPLITS_PAD)
        lse = tl.load(
            partial_lse + token64 * stride_plt + head * stride_plh + splits * stride_pls,
            mask=splits < NUM_SPLITS,
            other=float("-inf"),
        )
        m = tl.max(lse, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m_safe)  # empty splits weigh 0
        total = tl.sum(w, axis=0)
        offs_d = tl.arange(0, HEAD_PAD)
        ok = (splits[:, None] < NUM_SPLITS) & (offs_d[None, :] < HEAD_SIZE) & (w[:, None] > 0)
        parts = tl.load(
            partial_out
            + token64 * stride_pt
            + head * stride_ph
            + splits[:, None] * stride_ps
            + offs_d[None, :] * stride_pd,
            mask=ok,
            other=0.0,
        )
        out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            output + token64 * stride_ot + head * stride_oh + offs_d * stride_od,
            out.to(output.dtype.element_ty),
            mask=offs_d < HEAD_SIZE,
        )
        if HAS_LSE:
            lse_out = tl.where(
                total > 0, m_safe + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf")
            )
            tl.store(
                output_lse + head * stride_lh + token64 * stride_lt, lse_out * 0.6931471805599453
            )
