"""CPU stand-ins for FlashAttention entry points, with the real signatures.

Each fake has the parameter list of the installed function it imitates (FA4 4.0.0b36
`flash_attn.cute.flash_attn_varlen_func`, upstream FA2 `flash_attn_varlen_func`, upstream FA3
`flash_attn_with_kvcache`), so the version detection reads the same signature, and computes
FlashAttention's semantics in float32 (paged or contiguous keys, bottom-right causal alignment,
window `(left, right)`, soft cap, FA2's ALiBi `-slope * |i + Lk - Lq - j|`, sinks folded into the
LSE). They let the FLASH_ATTN builder and impl run on the CPU through the conformance kit.

`install(monkeypatch, *interfaces)` makes the backend see exactly those interfaces installed.
"""

from __future__ import annotations

import math

import pytest
import torch

from anyattn.backends import flash_attn_versions as versions
from anyattn.backends.flash_attn_entry_point import (
    FlashAttnInterface,
    FlashAttnVersion,
    interface_from_function,
)


def _reference(
    q, k, v, cu_seqlens_q, *, seq_lens=None, cu_seqlens_k=None, page_table=None, scale,
    causal=False, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None,
    q_descale=None, k_descale=None, v_descale=None,
):  # fmt: skip
    """out `[total_q, H, D]` (q's dtype, bf16 for fp8 q) and lse `[H, total_q]` (float32)."""
    total_q, num_heads, head_size = q.shape
    num_kv_heads = k.shape[-2]
    group = num_heads // num_kv_heads
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    out = torch.zeros(total_q, num_heads, head_size, dtype=torch.float32)
    lse = torch.full((num_heads, total_q), -math.inf)
    batch = cu_seqlens_q.shape[0] - 1
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if page_table is not None:
            length = (
                int(seq_lens[b])
                if seq_lens is not None
                else int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            )
            page = k.shape[1]
            pages = page_table[b, : -(-length // page)].long()
            kb = k[pages].reshape(-1, num_kv_heads, head_size)[:length].float()
            vb = v[pages].reshape(-1, num_kv_heads, head_size)[:length].float()
        else:
            k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
            kb, vb, length = k[k0:k1].float(), v[k0:k1].float(), k1 - k0
        qb = q[q0:q1].float()
        if q_descale is not None:
            qb = qb * q_descale[b].repeat_interleave(group).view(1, -1, 1)
            kb = kb * k_descale[b].view(1, -1, 1)
            vb = vb * v_descale[b].view(1, -1, 1)
        kb = kb.repeat_interleave(group, dim=1)
        vb = vb.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * scale  # [H, Lq, Lk]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        lq = q1 - q0
        # query i sits at key position i + Lk - Lq (bottom-right alignment)
        diag = torch.arange(lq).view(-1, 1) + (length - lq)
        j = torch.arange(length).view(1, -1)
        if alibi_slopes is not None:
            scores = scores - alibi_slopes.float().view(-1, 1, 1) * (diag - j).abs()
        left, right = window
        right = 0 if causal else right
        allowed = torch.ones(lq, length, dtype=torch.bool)
        if right >= 0:
            allowed &= j <= diag + right
        if left >= 0:
            allowed &= j >= diag - left
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().view(-1, 1, 1).expand(-1, lq, 1)], dim=-1)
            vb = torch.cat([vb, vb.new_zeros(1, num_heads, head_size)])
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]
        probs = torch.exp(scores - row_lse.unsqueeze(-1)).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, vb)
        lse[:, q0:q1] = row_lse
    return out.to(out_dtype), lse


def fa4_varlen(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
    gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
    block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
    scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
    gather_bwd_recompute_p=False, gather_bwd_token_chunk=None,
):  # fmt: skip
    """FA4's signature (interface.py:4214); returns `(out, lse)` like FlashAttnVarlenFunc."""
    assert page_table is None or cu_seqlens_k is None, (
        "page_table is not supported with cu_seqlens_k"
    )
    assert page_table is None or page_table.dtype == torch.int32
    assert page_table is None or page_table.stride(-1) == 1
    window = tuple(-1 if w is None else w for w in window_size)
    out, lse = _reference(
        q, k, v, cu_seqlens_q, seq_lens=seqused_k, cu_seqlens_k=cu_seqlens_k,
        page_table=page_table, scale=softmax_scale, causal=causal, window=window,
        softcap=softcap, sinks=learnable_sink,
    )  # fmt: skip
    return out, (lse if return_lse else None)


def fa4_forward(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None,
    softmax_scale=None, causal=False, softcap=None, window_size_left=None,
    window_size_right=None, learnable_sink=None, tile_mn=None, mma_pv_is_rs=None,
    intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None, _arch=None,
    score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None,
    lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None,
    v_descale=None, gather_kv_indices=None, scheduler_metadata=None, seqlen_k_per_split=None,
    disable_scheduler_metadata=False, gather_bwd_recompute_p=False,
):  # fmt: skip
    """FA4's forward (`flash_attn.cute.interface._flash_attn_fwd`, interface.py:678): writes
    into `out` when given; returns `(out, lse, p, row_max, o_lo)`."""
    window = tuple(-1 if w is None else w for w in (window_size_left, window_size_right))
    result, row_lse = _reference(
        q, k, v, cu_seqlens_q, seq_lens=seqused_k, cu_seqlens_k=cu_seqlens_k,
        page_table=page_table, scale=softmax_scale, causal=causal, window=window,
        softcap=softcap or 0.0, sinks=learnable_sink,
    )  # fmt: skip
    if out is None:
        out = result
    else:
        assert out.shape == result.shape and out.dtype == result.dtype
        out.copy_(result)
    return out, (row_lse if return_lse else None), None, None, None


def fa2_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    deterministic=False, return_attn_probs=False, block_table=None,
):  # fmt: skip
    """Upstream FA2's signature; `(out, lse, None)` with `return_attn_probs`, else `out`."""
    assert dropout_p == 0.0
    out, lse = _reference(
        q, k, v, cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, page_table=block_table,
        scale=softmax_scale, causal=causal, window=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes,
    )  # fmt: skip
    return (out, lse, None) if return_attn_probs else out


def fa3_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
    cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
    cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
    q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
    scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
    return_softmax_lse=False,
):  # fmt: skip
    """Upstream FA3's `flash_attn_with_kvcache` signature; `(out, lse)` with
    `return_softmax_lse`, else `out`."""
    assert k is None and v is None, "the backend never appends keys through the kernel"
    out, lse = _reference(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens=cache_seqlens, page_table=page_table,
        scale=softmax_scale, causal=causal, window=window_size, softcap=softcap,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
    )  # fmt: skip
    return (out, lse) if return_softmax_lse else out


def fa3_varlen_upstream(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
    seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False,
):  # fmt: skip
    """Upstream FA3's `flash_attn_varlen_func` signature: no page table (never called)."""
    raise AssertionError("FA3's varlen entry has no page table; the backend must not call it")


FV = FlashAttnVersion


def fa4() -> FlashAttnInterface:
    return interface_from_function(FV.FA4, "flash_attn.cute", "flash_attn_varlen_func", fa4_varlen)


def fa4_through_forward() -> FlashAttnInterface:
    """FA4 as detected when its forward takes `out`: declared by the public call, run through
    the forward."""
    return versions.fa4_forward_interface(fa4(), fa4_forward)


def fa2() -> FlashAttnInterface:
    return interface_from_function(
        FV.FA2, "flash_attn.flash_attn_interface", "flash_attn_varlen_func", fa2_varlen
    )


def fa3() -> FlashAttnInterface:
    return interface_from_function(
        FV.FA3, "flash_attn_interface", "flash_attn_with_kvcache", fa3_with_kvcache
    )


def install(monkeypatch: pytest.MonkeyPatch, *interfaces: FlashAttnInterface) -> None:
    """Make the backend see exactly `interfaces` installed (none: nothing importable)."""
    errors = () if interfaces else ("flash_attn.cute: not installed",)
    detection = versions.Detection(tuple(interfaces), errors)
    monkeypatch.setattr(versions, "detect", lambda: detection)
