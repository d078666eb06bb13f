"""The Triton kernels of `anyattn.ops.mla_decode` (the launch, its checks and the tile choice
live there).

`mla_decode_kernel`: one program handles one decode row (one request's one query token), a
tile of `BLOCK_H` query heads and one of `num_splits` chunks of the request's keys. Every
latent row `[c_kv (L), k_pe (R)]` it reads from the paged cache serves all the heads of its
tile at once: the scores are `q_latent @ c_kv^T + q_pe @ k_pe^T` (`tl.dot`s into one
`[BLOCK_H, TILE_N]` tile, so the rope part is folded into the same scores) and the values are
the same `c_kv` rows (`acc += p @ c_kv`). Keys are walked `TILE_N` at a time through the block
table; the online softmax runs in float32 in the exp2 domain. An fp8 cache is read as stored
(fp8 values are exact in fp16/bf16) and its per-layer scale is folded into the score scale and
the output.

How a tile of latent rows is read (`KV_LOAD`):
- `KV_GATHER`: a block-table entry per key and masked pointer loads; any block size.
- `KV_BLOCK`: `BLOCK_SIZE % TILE_N == 0`, so a tile lies in one cache block: one block-table
  entry per tile and, for the tiles before a request's last partial one, loads without a key
  mask (the partial tile is read as in `KV_GATHER`).
- `KV_TMA`: as `KV_BLOCK`, but full tiles come through TMA tensor descriptors over the cache
  flattened to `[num_blocks * block_size, L + R]` rows (the partial tile as in `KV_GATHER`,
  so that slots past the request's keys, possibly never written, are not read).

`LATENT_SPLITS == 2` gives each head tile two programs: both compute the full scores (each
reads every latent column), each accumulates half of the `L` output columns. That halves the
`[BLOCK_H, L]` float32 accumulator per program at the cost of computing the scores twice.

With `IS_SPLIT_KV` false a program writes the normalised output and the natural-log LSE; with
it, the program writes its partial output and base-2 LSE into the float32 workspace, which
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

__all__ = ["KV_BLOCK", "KV_GATHER", "KV_TMA", "mla_decode_kernel", "mla_reduce_kernel"]

KV_GATHER = 0
KV_BLOCK = 1
KV_TMA = 2

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    _INTERPRETED = tl.constexpr(_INTERPRETED)
    _KV_GATHER = tl.constexpr(KV_GATHER)
    _KV_TMA = tl.constexpr(KV_TMA)

    @triton.jit
    def _dot(a, b, acc, IEEE_DOT: tl.constexpr):
        if IEEE_DOT:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _load_rows(
        kv_cache, rows, key_ok, col, limit, stride_cd,
        WIDTH: tl.constexpr, IS_FULL: tl.constexpr, DTYPE: tl.constexpr,
    ):  # fmt: skip
        """Columns `[col, col + WIDTH)` (those below `limit`) of the cache rows at offsets
        `rows`: `[TILE_N, WIDTH]` in `DTYPE`, zeros where masked."""
        cols = col + tl.arange(0, WIDTH)
        ptrs = kv_cache + rows[:, None] + cols[None, :] * stride_cd
        if IS_FULL:
            x = tl.load(ptrs, mask=(cols < limit)[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=key_ok[:, None] & (cols < limit)[None, :], other=0.0)
        return x.to(DTYPE)

    @triton.jit
    def _load_tile(
        kv_cache, c_kv_desc, k_pe_desc, block_table_row, tile, seq_len, col_own, col_other,
        kv_lora_rank, rope_dim, stride_cb, stride_cs, stride_cd,
        LATENT_TILE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr, LATENT_SPLITS: tl.constexpr, KV_LOAD: tl.constexpr,
        IS_FULL: tl.constexpr, DTYPE: tl.constexpr,
    ):  # fmt: skip
        """The latent rows of key tile `tile` in `DTYPE`: `c_own`, `c_other` `[TILE_N,
        LATENT_TILE]` (the program's latent columns, also the values, and the other half's;
        `c_other` is `c_own` without latent splits), `k_pe` `[TILE_N, ROPE_PAD]` and the key
        mask `[TILE_N]`. `IS_FULL`: every key of the tile is below `seq_len` and the tile lies
        in one cache block (never with `KV_GATHER`)."""
        offs_n = tl.arange(0, TILE_N)
        keys = tile * TILE_N + offs_n  # [TILE_N] key positions in the request
        key_ok = keys < seq_len
        first = tile * TILE_N
        if IS_FULL and KV_LOAD == _KV_TMA:
            row = tl.load(block_table_row + first // BLOCK_SIZE) * BLOCK_SIZE + first % BLOCK_SIZE
            c_own = c_kv_desc.load([row, col_own]).to(DTYPE)
            c_other = c_own
            if LATENT_SPLITS == 2:
                c_other = c_kv_desc.load([row, col_other]).to(DTYPE)
            k_pe = k_pe_desc.load([row, 0]).to(DTYPE)
        else:
            if IS_FULL:
                block = tl.load(block_table_row + first // BLOCK_SIZE).to(tl.int64)
                rows = block * stride_cb + (first % BLOCK_SIZE + offs_n).to(tl.int64) * stride_cs
            else:
                blocks = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_ok, other=0)
                rows = (
                    blocks.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE).to(tl.int64) * stride_cs
                )
            c_own = _load_rows(kv_cache, rows, key_ok, col_own, kv_lora_rank, stride_cd,
                               LATENT_TILE, IS_FULL, DTYPE)  # fmt: skip
            c_other = c_own
            if LATENT_SPLITS == 2:
                c_other = _load_rows(kv_cache, rows, key_ok, col_other, kv_lora_rank, stride_cd,
                                     LATENT_TILE, IS_FULL, DTYPE)  # fmt: skip
            k_pe = _load_rows(kv_cache, rows + kv_lora_rank * stride_cd, key_ok, 0, rope_dim,
                              stride_cd, ROPE_PAD, IS_FULL, DTYPE)  # fmt: skip
        return c_own, c_other, k_pe, key_ok

    @triton.jit
    def _attend_tile(
        acc, m_i, l_i, q_own, q_other, q_rope, kv_cache, c_kv_desc, k_pe_desc,
        block_table_row, tile, seq_len, col_own, col_other, kv_lora_rank, rope_dim, qk,
        stride_cb, stride_cs, stride_cd,
        LATENT_TILE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr, LATENT_SPLITS: tl.constexpr, KV_LOAD: tl.constexpr,
        IEEE_DOT: tl.constexpr, IS_FULL: tl.constexpr,
    ):  # fmt: skip
        """One key tile of the online softmax, for every head of the program's tile."""
        c_own, c_other, k_pe, key_ok = _load_tile(
            kv_cache, c_kv_desc, k_pe_desc, block_table_row, tile, seq_len, col_own, col_other,
            kv_lora_rank, rope_dim, stride_cb, stride_cs, stride_cd, LATENT_TILE, ROPE_PAD,
            BLOCK_SIZE, TILE_N, LATENT_SPLITS, KV_LOAD, IS_FULL, q_own.dtype,
        )  # fmt: skip
        s = tl.zeros([q_own.shape[0], TILE_N], dtype=tl.float32)  # [BLOCK_H, TILE_N]
        s = _dot(q_own, tl.trans(c_own), s, IEEE_DOT)
        if LATENT_SPLITS == 2:
            s = _dot(q_other, tl.trans(c_other), s, IEEE_DOT)
        s = _dot(q_rope, tl.trans(k_pe), s, IEEE_DOT)
        if IS_FULL:
            s = s * qk
        else:
            s = tl.where(key_ok[None, :], s * qk, float("-inf"))
        # Every tile walked holds at least one key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(q_own.dtype), c_own, acc * alpha[:, None], IEEE_DOT)
        return acc, m_new, l_i

    @triton.jit
    def _attend_tiles(
        acc, m_i, l_i, q_own, q_other, q_rope, kv_cache, c_kv_desc, k_pe_desc,
        block_table_row, tile_lo, tile_hi, seq_len, col_own, col_other, kv_lora_rank,
        rope_dim, qk, stride_cb, stride_cs, stride_cd,
        LATENT_TILE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr, LATENT_SPLITS: tl.constexpr, KV_LOAD: tl.constexpr,
        IEEE_DOT: tl.constexpr, IS_FULL: tl.constexpr,
    ):  # fmt: skip
        """`_attend_tile` over tiles `[tile_lo, tile_hi)`."""
        if _INTERPRETED:
            # The interpreter cannot take a runtime range bound with NumPy 2; a while loop
            # reads the same. Compiled code keeps the pipelined for loop.
            tile = tile_lo
            while tile < tile_hi:
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q_own, q_other, q_rope, kv_cache, c_kv_desc, k_pe_desc,
                    block_table_row, tile, seq_len, col_own, col_other, kv_lora_rank, rope_dim,
                    qk, stride_cb, stride_cs, stride_cd, LATENT_TILE, ROPE_PAD, BLOCK_SIZE,
                    TILE_N, LATENT_SPLITS, KV_LOAD, IEEE_DOT, IS_FULL,
                )  # fmt: skip
                tile += 1
        else:
            for tile in tl.range(tile_lo, tile_hi):
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q_own, q_other, q_rope, kv_cache, c_kv_desc, k_pe_desc,
                    block_table_row, tile, seq_len, col_own, col_other, kv_lora_rank, rope_dim,
                    qk, stride_cb, stride_cs, stride_cd, LATENT_TILE, ROPE_PAD, BLOCK_SIZE,
                    TILE_N, LATENT_SPLITS, KV_LOAD, IEEE_DOT, IS_FULL,
                )  # fmt: skip
        return acc, m_i, l_i

    @triton.jit
    def mla_decode_kernel(
        q_latent, q_pe, kv_cache, c_kv_desc, k_pe_desc, output, output_lse, partial_out,
        partial_lse, block_table, seq_lens, k_scale,
        num_heads, kv_lora_rank, rope_dim, qk_scale_log2, num_splits,
        stride_qt, stride_qh, stride_qd,
        stride_pt, stride_ph, stride_pd,
        stride_cb, stride_cs, stride_cd,
        stride_ot, stride_oh, stride_od,
        stride_lh, stride_lt,
        stride_wt, stride_wh, stride_ws, stride_wd,
        stride_wlt, stride_wlh, stride_wls,
        stride_bt,
        LATENT_TILE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, LATENT_SPLITS: tl.constexpr,
        KV_LOAD: tl.constexpr, IS_SPLIT_KV: tl.constexpr, HAS_KV_SCALE: tl.constexpr,
        HAS_LSE: tl.constexpr, IEEE_DOT: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) // LATENT_SPLITS * BLOCK_H + tl.arange(0, BLOCK_H)
        part = tl.program_id(1) % LATENT_SPLITS  # which LATENT_TILE columns it accumulates
        split = tl.program_id(2)
        head_ok = heads < num_heads
        col_own = part * LATENT_TILE
        col_other = (1 - part) * LATENT_TILE
        offs_w = tl.arange(0, LATENT_TILE)
        offs_r = tl.arange(0, ROPE_PAD)
        own_ok = col_own + offs_w < kv_lora_rank
        # The program's queries, loaded once: q_own (its latent columns) and q_other (the
        # other half, LATENT_SPLITS == 2) [BLOCK_H, LATENT_TILE], q_rope [BLOCK_H, ROPE_PAD].
        q_row = q_latent + row * stride_qt + heads[:, None] * stride_qh
        q_own = tl.load(
            q_row + (col_own + offs_w)[None, :] * stride_qd,
            mask=head_ok[:, None] & own_ok[None, :],
            other=0.0,
        )
        q_other = q_own
        if LATENT_SPLITS == 2:
            q_other = tl.load(
                q_row + (col_other + offs_w)[None, :] * stride_qd,
                mask=head_ok[:, None] & (col_other + offs_w < kv_lora_rank)[None, :],
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
        per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
        block_table_row = block_table + row * stride_bt

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, LATENT_TILE], dtype=tl.float32)
        if KV_LOAD == _KV_GATHER:
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q_own, q_other, q_rope, kv_cache, c_kv_desc, k_pe_desc,
                block_table_row, tile_lo, tile_hi, seq_len, col_own, col_other, kv_lora_rank,
                rope_dim, qk, stride_cb, stride_cs, stride_cd, LATENT_TILE, ROPE_PAD,
                BLOCK_SIZE, TILE_N, LATENT_SPLITS, KV_LOAD, IEEE_DOT, False,
            )  # fmt: skip
        else:
            # The tiles before the request's last partial one need no key mask; that one (if
            # this split holds it) is read masked, first: its dot operands then leave the
            # registers before the loop (tile order does not matter to the online softmax).
            full_hi = tl.minimum(tile_hi, seq_len // TILE_N)
            if (full_hi < tile_hi) & (tile_lo < tile_hi):
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q_own, q_other, q_rope, kv_cache, c_kv_desc, k_pe_desc,
                    block_table_row, tile_hi - 1, seq_len, col_own, col_other, kv_lora_rank,
                    rope_dim, qk, stride_cb, stride_cs, stride_cd, LATENT_TILE, ROPE_PAD,
                    BLOCK_SIZE, TILE_N, LATENT_SPLITS, KV_LOAD, IEEE_DOT, False,
                )  # fmt: skip
            acc, m_i, l_i = _attend_tiles(
                acc, m_i, l_i, q_own, q_other, q_rope, kv_cache, c_kv_desc, k_pe_desc,
                block_table_row, tile_lo, full_hi, seq_len, col_own, col_other, kv_lora_rank,
                rope_dim, qk, stride_cb, stride_cs, stride_cd, LATENT_TILE, ROPE_PAD,
                BLOCK_SIZE, TILE_N, LATENT_SPLITS, KV_LOAD, IEEE_DOT, True,
            )  # fmt: skip

        has_mass = l_i > 0.0
        out = acc / tl.where(has_mass, l_i, 1.0)[:, None] * kv_scale
        lse2 = tl.where(has_mass, m_i + tl.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        out_mask = head_ok[:, None] & own_ok[None, :]
        lse_mask = head_ok & (part == 0)  # both latent parts hold the same LSE
        if IS_SPLIT_KV:
            w_off = row * stride_wt + heads * stride_wh + split * stride_ws
            tl.store(
                partial_out + w_off[:, None] + (col_own + offs_w)[None, :] * stride_wd,
                out,
                mask=out_mask,
            )
            tl.store(
                partial_lse + row * stride_wlt + heads * stride_wlh + split * stride_wls,
                lse2,
                mask=lse_mask,
            )
        else:
            o_off = row * stride_ot + heads[:, None] * stride_oh
            tl.store(
                output + o_off + (col_own + offs_w)[None, :] * stride_od,
                out.to(output.dtype.element_ty),
                mask=out_mask,
            )
            if HAS_LSE:
                tl.store(
                    output_lse + heads * stride_lh + row * stride_lt,
                    lse2 * 0.6931471805599453,
                    mask=lse_mask,
                )

    @triton.jit
    def mla_reduce_kernel(
        output, output_lse, partial_out, partial_lse, kv_lora_rank, num_splits,
        stride_ot, stride_oh, stride_od,
        stride_lh, stride_lt,
        stride_wt, stride_wh, stride_ws, stride_wd,
        stride_wlt, stride_wlh, stride_wls,
        LATENT_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_LSE: tl.constexpr,
    ):  # fmt: skip
        """Merge the splits of one (row, head): weights exp2(lse_s - max)."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS_PAD)
        lse = tl.load(
            partial_lse + row * stride_wlt + head * stride_wlh + splits * stride_wls,
            mask=splits < num_splits,
            other=float("-inf"),
        )
        m = tl.max(lse, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m_safe)  # empty splits weigh 0
        total = tl.sum(w, axis=0)
        offs_l = tl.arange(0, LATENT_PAD)
        ok = (splits[:, None] < num_splits) & (offs_l[None, :] < kv_lora_rank) & (w[:, None] > 0)
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
