"""The Triton kernel of `anyattn.ops.unified_attention` (which holds the launch).

One program handles one query tile of one request and one KV head: `TILE_M` rows made of
`BLOCK_Q` consecutive query tokens times the query heads that share the KV head (GQA packing).
It walks the request's keys `TILE_N` at a time through the block table (tiles are independent
of the cache block size), with an online softmax in fp32 (exp2 domain).

Request r owns tile ids `[query_start_loc[r] // BLOCK_Q + r, query_start_loc[r + 1] // BLOCK_Q +
r + 1)`, so `num_tokens // BLOCK_Q + num_reqs` programs cover any batch and each finds its
request by binary search. With `NUM_SPLITS > 1` a program handles one chunk of its request's
keys and writes a partial output and its base-2 LSE into the workspace.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = ["unified_attention_kernel"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    from anyattn.ops.soft_cap import apply_soft_cap

    _INTERPRETED = tl.constexpr(_INTERPRETED)

    @triton.jit
    def _find_request(query_start_loc, num_reqs, tile_id, BLOCK_Q: tl.constexpr):
        """The request whose tile ids contain `tile_id` (binary search, see module doc)."""
        lo = 0
        hi = num_reqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_tile = tl.load(query_start_loc + mid) // BLOCK_Q + mid
            if first_tile <= tile_id:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _attend_tile(
        acc,
        m_i,
        l_i,
        q,
        key_cache,
        value_cache,
        block_table_row,
        tile,
        kv_head,
        seq_len,
        q_pos,
        slopes,
        qk_scale,
        soft_cap,
        window,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        k_desc,
        v_desc,
        kv_row0,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        MASKED: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        HAS_ALIBI: tl.constexpr,
        IEEE_DOT: tl.constexpr,
        KV_FROM_INPUT: tl.constexpr,
    ):
        """One key tile of the online softmax."""
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        offs_n = tl.arange(0, TILE_N)
        keys = tile * TILE_N + offs_n  # [TILE_N] absolute key positions
        key_ok = keys < seq_len
        if KV_FROM_INPUT:
            # A fresh prefill's keys are its own new tokens: TMA tiles of the input K/V.
            row = kv_row0 + tile * TILE_N
            k = tl.trans(k_desc.load([row, kv_head * HEAD_SIZE]))  # [HEAD_PAD, TILE_N]
            v = v_desc.load([row, kv_head * HEAD_SIZE])  # [TILE_N, HEAD_PAD]
            if MASKED:  # rows past the request belong to others: 0 * NaN would leak
                v = tl.where((keys < seq_len)[:, None], v, 0.0)
        else:
            blocks = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_ok, other=0)
            blocks = blocks.to(tl.int64)
            within = (keys % BLOCK_SIZE).to(tl.int64)
            k_off = (
                blocks[None, :] * stride_kb
                + within[None, :] * stride_ks
                + kv_head * stride_kh
                + offs_d[:, None] * stride_kd
            )  # [HEAD_PAD, TILE_N]
            v_off = (
                blocks[:, None] * stride_vb
                + within[:, None] * stride_vs
                + kv_head * stride_vh
                + offs_d[None, :] * stride_vd
            )  # [TILE_N, HEAD_PAD]
            if MASKED:
                k = tl.load(key_cache + k_off, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
                v = tl.load(value_cache + v_off, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            else:
                k = tl.load(key_cache + k_off, mask=d_ok[:, None], other=0.0)
                v = tl.load(value_cache + v_off, mask=d_ok[None, :], other=0.0)
        k = k.to(q.dtype)
        if IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if HAS_SOFTCAP or HAS_ALIBI:
            s = s * qk_scale  # scale * k_scale
            if HAS_SOFTCAP:
                # float32 inputs (IEEE_DOT) need the accurate form to meet their error bound.
                s = apply_soft_cap(s, soft_cap, IEEE_DOT)
            if HAS_ALIBI:
                s += slopes[:, None] * (keys[None, :] - q_pos[:, None]).to(tl.float32)
            s = s * 1.4426950408889634  # to the exp2 domain
        else:
            s = s * (qk_scale * 1.4426950408889634)  # one multiply: scale and exp2 domain
        if MASKED:
            allowed = key_ok[None, :]
            if IS_CAUSAL:
                allowed = allowed & (keys[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (keys[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 there, never -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = v.to(q.dtype)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        key_cache,
        value_cache,
        block_table_row,
        tile_lo,
        tile_hi,
        kv_head,
        seq_len,
        q_pos,
        slopes,
        qk_scale,
        soft_cap,
        window,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        k_desc,
        v_desc,
        kv_row0,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        MASKED: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        HAS_ALIBI: tl.constexpr,
        IEEE_DOT: tl.constexpr,
        KV_FROM_INPUT: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
    ):
        """Online softmax over key tiles [tile_lo, tile_hi); MASKED=False only for tiles every
        row sees completely (keys below the tile's first causal position)."""
        if _INTERPRETED:
            # The interpreter cannot take a runtime range bound (a 1-element array) with
            # NumPy 2; a while loop reads the same. Compiled code keeps the pipelined for loop.
            tile = tile_lo
            while tile < tile_hi:
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, key_cache, value_cache, block_table_row, tile, kv_head,
                    seq_len, q_pos, slopes, qk_scale, soft_cap, window,
                    stride_kb, stride_ks, stride_kh, stride_kd,
                    stride_vb, stride_vs, stride_vh, stride_vd, k_desc, v_desc, kv_row0,
                    HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED, IS_CAUSAL, HAS_WINDOW,
                    HAS_SOFTCAP, HAS_ALIBI, IEEE_DOT, KV_FROM_INPUT,
                )  # fmt: skip
                tile += 1
        else:
            for tile in tl.range(tile_lo, tile_hi, warp_specialize=WARP_SPECIALIZE):
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, key_cache, value_cache, block_table_row, tile, kv_head,
                    seq_len, q_pos, slopes, qk_scale, soft_cap, window,
                    stride_kb, stride_ks, stride_kh, stride_kd,
                    stride_vb, stride_vs, stride_vh, stride_vd, k_desc, v_desc, kv_row0,
                    HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED, IS_CAUSAL, HAS_WINDOW,
                    HAS_SOFTCAP, HAS_ALIBI, IEEE_DOT, KV_FROM_INPUT,
                )  # fmt: skip
        return acc, m_i, l_i

    @triton.jit
    def unified_attention_kernel(
        query,
        key_cache,
        value_cache,
        k_desc,
        v_desc,
        output,
        output_lse,
        partial_out,
        partial_lse,
        block_table,
        seq_lens,
        query_start_loc,
        alibi_slopes,
        sinks,
        k_scale,
        v_scale,
        num_reqs,
        scale,
        soft_cap,
        window,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
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
        stride_bt,
        stride_ks_scale,
        stride_vs_scale,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        QUERIES_PER_KV: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        IS_CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        HAS_ALIBI: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        HAS_KV_SCALE: tl.constexpr,
        HAS_LSE: tl.constexpr,
        IEEE_DOT: tl.constexpr,
        KV_FROM_INPUT: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
    ):
        # Longest tiles first (the last query tiles of causal requests see the most keys).
        tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        req = _find_request(query_start_loc, num_reqs, tile_id, BLOCK_Q)
        q_start = tl.load(query_start_loc + req)
        query_len = tl.load(query_start_loc + req + 1) - q_start
        q_tile = tile_id - (q_start // BLOCK_Q + req)
        if q_tile * BLOCK_Q >= query_len:
            return
        seq_len = tl.load(seq_lens + req)
        context_len = seq_len - query_len

        # Rows: token-major, then the query heads of this KV head (GQA packing).
        rows = tl.arange(0, TILE_M)
        row_token = q_tile * BLOCK_Q + rows // QUERIES_PER_KV  # index among the new tokens
        row_head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
        row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (row_token < query_len)
        q_pos = context_len + row_token
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        tok = (q_start + row_token).to(tl.int64)
        q = tl.load(
            query
            + tok[:, None] * stride_qt
            + row_head[:, None] * stride_qh
            + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )

        qk_scale = scale
        if HAS_KV_SCALE:
            qk_scale = qk_scale * tl.load(k_scale + kv_head * stride_ks_scale)
        slopes = tl.zeros([TILE_M], dtype=tl.float32)
        if HAS_ALIBI:
            slopes = tl.load(alibi_slopes + row_head, mask=row_ok, other=0.0)

        # Keys this tile can see: [key_lo, key_hi).
        first_pos = context_len + q_tile * BLOCK_Q
        last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
        key_hi = seq_len
        if IS_CAUSAL:
            key_hi = last_pos + 1
        key_lo = 0
        if HAS_WINDOW:
            key_lo = tl.maximum(first_pos - window + 1, 0)
        tile_lo = key_lo // TILE_N
        tile_hi = tl.cdiv(key_hi, TILE_N)
        if NUM_SPLITS > 1:
            per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
            tile_lo = tile_lo + split * per_split
            tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

        m_i = tl.full([TILE_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([TILE_M], dtype=tl.float32)
        if HAS_SINKS:
            if split == 0:  # the sink joins the denominator once, in the first split
                m_i = (
                    tl.load(sinks + row_head, mask=row_ok, other=float("-inf")) * 1.4426950408889634
                )
                l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        acc = tl.zeros([TILE_M, HEAD_PAD], dtype=tl.float32)
        block_table_row = block_table + req.to(tl.int64) * stride_bt
        kv_row0 = q_start  # KV_FROM_INPUT: a fresh prefill's key j is input row q_start + j

        # Tiles wholly below every row's causal limit (and with no window) need no mask.
        tile_full = tile_lo
        if IS_CAUSAL and not HAS_WINDOW:
            tile_full = tl.maximum(tl.minimum((first_pos + 1) // TILE_N, tile_hi), tile_lo)
        for masked in tl.static_range(2):
            lo = tile_lo if masked == 0 else tile_full
            hi = tile_full if masked == 0 else tile_hi
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q, key_cache, value_cache, block_table_row, lo, hi,
                kv_head, seq_len, q_pos, slopes, qk_scale, soft_cap, window,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, k_desc, v_desc, kv_row0,
                HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE_N, masked == 1, IS_CAUSAL, HAS_WINDOW,
                HAS_SOFTCAP, HAS_ALIBI, IEEE_DOT, KV_FROM_INPUT, WARP_SPECIALIZE,
            )  # fmt: skip

        has_mass = l_i > 0.0
        out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
        if HAS_KV_SCALE:
            out = out * tl.load(v_scale + kv_head * stride_vs_scale)
        lse2 = tl.where(has_mass, m_i + tl.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        if NUM_SPLITS > 1:
            p_off = tok * stride_pt + row_head * stride_ph + split * stride_ps
            tl.store(
                partial_out + p_off[:, None] + offs_d[None, :] * stride_pd,
                out,
                mask=row_ok[:, None] & d_ok[None, :],
            )
            l_off = tok * stride_plt + row_head * stride_plh + split * stride_pls
            tl.store(partial_lse + l_off, lse2, mask=row_ok)
        else:
            tl.store(
                output
                + tok[:, None] * stride_ot
                + row_head[:, None] * stride_oh
                + offs_d[None, :] * stride_od,
                out.to(output.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )
            if HAS_LSE:
                tl.store(
                    output_lse + row_head * stride_lh + tok * stride_lt,
                    lse2 * 0.6931471805599453,
                    mask=row_ok,
                )
