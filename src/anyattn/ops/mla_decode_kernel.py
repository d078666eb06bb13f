"""The Triton kernels of `anyattn.ops.mla_decode` (the launch, its checks and the tile choice
live there).

`mla_decode_kernel`: one program handles one decode row (one request's one query token), a
tile of `BLOCK_H` query heads and one of `NUM_SPLITS` chunks of the request's keys. Every
latent row `[c_kv (L), k_pe (R)]` it reads from the paged cache serves all the heads of its
tile at once: the scores are `q_latent @ c_kv^T + q_pe @ k_pe^T` (two `tl.dot`s into one
`[BLOCK_H, TILE_N]` tile, so the rope part is folded into the same scores) and the values are
the same `c_kv` rows (`acc += p @ c_kv`). Keys are walked `TILE_N` at a time through the block
table, so tiles are independent of the cache block size; the online softmax runs in float32 in
the exp2 domain. An fp8 cache is read as stored (fp8 values are exact in fp16/bf16) and its
per-layer scale is folded into the score scale and the output.

With `NUM_SPLITS == 1` a program writes the normalised output and the natural-log LSE; with
more, it writes its partial output and base-2 LSE into the float32 workspace, which
`mla_reduce_kernel` merges (weights `exp2(lse_s - max)`; a split with no key weighs 0, a row
with no key at all gets zeros and LSE -inf).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = ["mla_decode_kernel", "mla_reduce_kernel"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    _INTERPRETED = tl.constexpr(_INTERPRETED)

    @triton.jit
    def _attend_tile(
        acc, m_i, l_i, q_lat, q_rope, kv_cache, block_table_row, tile, seq_len,
        kv_lora_rank, rope_dim, qk_scale_log2,
        stride_cb, stride_cs, stride_cd,
        LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr, IEEE_DOT: tl.constexpr,
    ):  # fmt: skip
        """One key tile of the online softmax, for every head of the program's tile."""
        offs_n = tl.arange(0, TILE_N)
        offs_l = tl.arange(0, LATENT_PAD)
        offs_r = tl.arange(0, ROPE_PAD)
        keys = tile * TILE_N + offs_n  # [TILE_N] key positions in the request
        key_ok = keys < seq_len
        blocks = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_ok, other=0)
        rows = blocks.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE).to(tl.int64) * stride_cs
        # c_kv: [TILE_N, LATENT_PAD], the keys' latent part and the values at once.
        c_kv = tl.load(
            kv_cache + rows[:, None] + offs_l[None, :] * stride_cd,
            mask=key_ok[:, None] & (offs_l < kv_lora_rank)[None, :],
            other=0.0,
        ).to(q_lat.dtype)
        # k_pe: [TILE_N, ROPE_PAD], the rope key shared by every head.
        k_pe = tl.load(
            kv_cache + rows[:, None] + (kv_lora_rank + offs_r)[None, :] * stride_cd,
            mask=key_ok[:, None] & (offs_r < rope_dim)[None, :],
            other=0.0,
        ).to(q_lat.dtype)
        if IEEE_DOT:
            s = tl.dot(q_lat, tl.trans(c_kv), input_precision="ieee")
            s += tl.dot(q_rope, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c_kv))
            s += tl.dot(q_rope, tl.trans(k_pe))
        s = tl.where(key_ok[None, :], s * qk_scale_log2, float("-inf"))  # [BLOCK_H, TILE_N]
        # Every tile walked holds at least one key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv)
        return acc, m_new, l_i

    @triton.jit
    def mla_decode_kernel(
        q_latent, q_pe, kv_cache, output, output_lse, partial_out, partial_lse,
        block_table, seq_lens, k_scale,
        num_heads, kv_lora_rank, rope_dim, qk_scale_log2,
        stride_qt, stride_qh, stride_qd,
        stride_pt, stride_ph, stride_pd,
        stride_cb, stride_cs, stride_cd,
        stride_ot, stride_oh, stride_od,
        stride_lh, stride_lt,
        stride_wt, stride_wh, stride_ws, stride_wd,
        stride_wlt, stride_wlh, stride_wls,
        stride_bt,
        LATENT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        HAS_KV_SCALE: tl.constexpr, HAS_LSE: tl.constexpr, IEEE_DOT: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        head_ok = heads < num_heads
        offs_l = tl.arange(0, LATENT_PAD)
        offs_r = tl.arange(0, ROPE_PAD)
        l_ok = offs_l < kv_lora_rank
        # The program's queries, loaded once: q_lat [BLOCK_H, LATENT_PAD], q_rope [BLOCK_H,
        # ROPE_PAD].
        q_lat = tl.load(
            q_latent + row * stride_qt + heads[:, None] * stride_qh + offs_l[None, :] * stride_qd,
            mask=head_ok[:, None] & l_ok[None, :],
            other=0.0,
        )
        q_rope = tl.load(
            q_pe + row * stride_pt + heads[:, None] * stride_ph + offs_r[None, :] * stride_pd,
            mask=head_ok[:, None] & (offs_r < rope_dim)[None, :],
            other=0.0,
        )
        kv_scale = 1.0
        if HAS_KV_SCALE:
            kv_scale = tl.load(k_scale)
        qk = qk_scale_log2 * kv_scale

        seq_len = tl.load(seq_lens + row)
        num_tiles = tl.cdiv(seq_len, TILE_N)
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
        block_table_row = block_table + row * stride_bt

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, LATENT_PAD], dtype=tl.float32)
        if _INTERPRETED:
            # The interpreter cannot take a runtime range bound with NumPy 2; a while loop
            # reads the same. Compiled code keeps the pipelined for loop.
            tile = tile_lo
            while tile < tile_hi:
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q_lat, q_rope, kv_cache, block_table_row, tile, seq_len,
                    kv_lora_rank, rope_dim, qk, stride_cb, stride_cs, stride_cd,
                    LATENT_PAD, ROPE_PAD, BLOCK_SIZE, TILE_N, IEEE_DOT,
                )  # fmt: skip
                tile += 1
        else:
            for tile in tl.range(tile_lo, tile_hi):
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q_lat, q_rope, kv_cache, block_table_row, tile, seq_len,
                    kv_lora_rank, rope_dim, qk, stride_cb, stride_cs, stride_cd,
                    LATENT_PAD, ROPE_PAD, BLOCK_SIZE, TILE_N, IEEE_DOT,
                )  # fmt: skip

        has_mass = l_i > 0.0
        out = acc / tl.where(has_mass, l_i, 1.0)[:, None] * kv_scale
        lse2 = tl.where(has_mass, m_i + tl.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        if NUM_SPLITS > 1:
            w_off = row * stride_wt + heads * stride_wh + split * stride_ws
            tl.store(
                partial_out + w_off[:, None] + offs_l[None, :] * stride_wd,
                out,
                mask=head_ok[:, None] & l_ok[None, :],
            )
            tl.store(
                partial_lse + row * stride_wlt + heads * stride_wlh + split * stride_wls,
                lse2,
                mask=head_ok,
            )
        else:
            tl.store(
                output + row * stride_ot + heads[:, None] * stride_oh + offs_l[None, :] * stride_od,
                out.to(output.dtype.element_ty),
                mask=head_ok[:, None] & l_ok[None, :],
            )
            if HAS_LSE:
                tl.store(
                    output_lse + heads * stride_lh + row * stride_lt,
                    lse2 * 0.6931471805599453,
                    mask=head_ok,
                )

    @triton.jit
    def mla_reduce_kernel(
        output, output_lse, partial_out, partial_lse, kv_lora_rank,
        stride_ot, stride_oh, stride_od,
        stride_lh, stride_lt,
        stride_wt, stride_wh, stride_ws, stride_wd,
        stride_wlt, stride_wlh, stride_wls,
        LATENT_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
        HAS_LSE: tl.constexpr,
    ):  # fmt: skip
        """Merge the splits of one (row, head): weights exp2(lse_s - max)."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS_PAD)
        lse = tl.load(
            partial_lse + row * stride_wlt + head * stride_wlh + splits * stride_wls,
            mask=splits < NUM_SPLITS,
            other=float("-inf"),
        )
        m = tl.max(lse, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m_safe)  # empty splits weigh 0
        total = tl.sum(w, axis=0)
        offs_l = tl.arange(0, LATENT_PAD)
        ok = (splits[:, None] < NUM_SPLITS) & (offs_l[None, :] < kv_lora_rank) & (w[:, None] > 0)
        parts = tl.load(
            partial_out
            + row * stride_wt
            + head * stride_wh
            + splits[:, None] * stride_ws
            + offs_l[None, :] * stride_wd,
            mask=ok,
            other=0.0,
        )
        out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            output + row * stride_ot + head * stride_oh + offs_l * stride_od,
            out.to(output.dtype.element_ty),
            mask=offs_l < kv_lora_rank,
        )
        if HAS_LSE:
            lse_out = tl.where(
                total > 0, m_safe + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf")
            )
            tl.store(output_lse + head * stride_lh + row * stride_lt, lse_out * 0.6931471805599453)
