"""Tile-shape sweep of the unified attention kernel on a CUDA GPU, beside its peers.

Checks the kernel against `unified_attention_ref` (bf16, fp8, features, split-KV), then times
variants of (TILE_M, TILE_N, num_warps, num_stages, num_splits) on kernels.py's decode and prefill
shapes with FlashInfer / FlashAttention-4 measured in the same run when importable. Used to
choose `_choose_config` and the builder's split heuristic; `benchmarks/kernels.py` is the
benchmark of record.

    python benchmarks/unified_attention_tune.py [--quick]
"""

# ruff: noqa: B023 - each timing lambda is called at once, inside its loop iteration
from __future__ import annotations

import argparse
import sys

import torch

from anyattn.ops.unified_attention import (
    UnifiedAttentionParams,
    split_kv_workspace_shape,
    unified_attention,
    unified_attention_ref,
)

H, HKV, D, BS = 32, 8, 128, 16


def paged(q_lens, seq_lens, layout="NHD", dtype=torch.bfloat16, h=H, hkv=HKV, d=D, bs=BS):
    """A random batch over shuffled blocks (block 0 is the null block)."""
    dev = "cuda"
    nblk = [(s + bs - 1) // bs for s in seq_lens]
    total = sum(nblk)
    perm = torch.randperm(total + 16, device=dev)[:total] + 1
    bt = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32, device=dev)
    at = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = perm[at : at + n].int()
        at += n
    shape = (total + 17, 2, bs, hkv, d) if layout == "NHD" else (total + 17, 2, hkv, bs, d)
    kv = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    if layout == "HND":
        kv = kv.permute(0, 1, 3, 2, 4)
    kv = kv.to(dtype)
    tokens = sum(q_lens)
    q = torch.randn(tokens, h, d, device=dev, dtype=torch.bfloat16)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return q, kv, qsl.to(dev), sl.to(dev), bt


def check() -> None:
    """The kernel against the reference on the GPU, bf16 and fp8."""
    torch.manual_seed(0)
    cases = [
        ([1] * 5 + [37, 200], [300, 17, 1, 64, 1000, 37, 700], {}),
        ([1] * 5 + [37, 200], [300, 17, 1, 64, 1000, 37, 700], {"sliding_window": 100}),
        ([3, 64], [90, 64], {"logits_soft_cap": 30.0, "causal": False}),
        ([1, 9], [500, 60], {"alibi": True, "sinks": True}),
    ]
    worst = 0.0
    for layout in ("NHD", "HND"):
        for q_lens, seq_lens, kw in cases:
            for splits in (1, 4):
                for fp8 in (False, True):
                    q, kv, qsl, sl, bt = paged(q_lens, seq_lens, layout)
                    extra = dict(kw)
                    if extra.pop("alibi", False):
                        extra["alibi_slopes"] = torch.rand(H, device="cuda")
                    if extra.pop("sinks", False):
                        extra["sinks"] = torch.randn(H, device="cuda")
                    if fp8:
                        kv = (kv.float() / 0.5).to(torch.float8_e4m3fn)
                        extra["k_scale"] = torch.tensor(0.5, device="cuda")
                        extra["v_scale"] = torch.full((HKV,), 0.5, device="cuda")
                    p = UnifiedAttentionParams(scale=D**-0.5, **extra)
                    out = torch.zeros_like(q)
                    lse = torch.zeros(H, q.shape[0], device="cuda")
                    ws = None
                    if splits > 1:
                        a, b = split_kv_workspace_shape(q.shape[0], H, D, splits)
                        ws = (torch.empty(a, device="cuda"), torch.empty(b, device="cuda"))
                    unified_attention(
                        q, kv, out, qsl, sl, bt, len(q_lens), max(q_lens), p,
                        output_lse=lse, num_splits=splits, workspace=ws,
                    )  # fmt: skip
                    ref = torch.zeros_like(q, dtype=torch.float32)
                    rlse = torch.zeros_like(lse)
                    unified_attention_ref(q, kv, ref, qsl, sl, bt, len(q_lens), p, output_lse=rlse)
                    err = (out.float() - ref).abs().max().item()
                    lerr = (lse - rlse).abs().max().item()
                    worst = max(worst, err)
                    if err > 2e-2 or lerr > 1e-2:
                        print(f"FAIL {layout} {q_lens} {kw} splits={splits} fp8={fp8} "
                              f"err={err:.3g} lse={lerr:.3g}")  # fmt: skip
    print(f"check: worst output error vs reference {worst:.3g}")


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def decode_peers(q, kv, sl, bt, seq_len):
    peers = {}
    try:
        import flashinfer

        num_reqs = q.shape[0]
        nb = (seq_len + BS - 1) // BS
        indptr = torch.arange(num_reqs + 1, dtype=torch.int32) * nb
        indices = bt[:, :nb].reshape(-1).cpu()
        last = torch.full((num_reqs,), seq_len - (nb - 1) * BS, dtype=torch.int32)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(indptr, indices, last, H, HKV, D, BS, q_data_type=torch.bfloat16)
        peers["flashinfer"] = lambda: w.run(q, kv)
    except Exception as e:  # a missing peer is reported, not fatal
        print(f"  flashinfer decode unavailable: {type(e).__name__}: {e}")
    return peers


def prefill_peers(q, k, v, cu, max_len):
    peers = {}
    try:
        from flash_attn.cute import flash_attn_varlen_func

        peers["fa4"] = lambda: flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
            max_seqlen_k=max_len, causal=True,
        )  # fmt: skip
    except Exception as e:
        print(f"  fa4 unavailable: {type(e).__name__}: {e}")
    return peers


def sweep_decode(quick: bool) -> None:
    variants = [(16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 4, 4), (16, 32, 4, 4), (16, 128, 8, 3)]
    split_opts = (1, 2, 4, 8, 16)
    if quick:
        variants, split_opts = variants[:2], (1, 4)
    for batch, seq_len in ((64, 4096), (256, 2048), (8, 32768)):
        for layout in ("NHD", "HND"):
            q, kv, qsl, sl, bt = paged([1] * batch, [seq_len] * batch, layout)
            gb = batch * seq_len * HKV * D * 2 * 2 / 1e9
            p = UnifiedAttentionParams(scale=D**-0.5)
            out = torch.empty_like(q)
            a, b = split_kv_workspace_shape(batch, H, D, 32)
            ws = (torch.empty(a, device="cuda"), torch.empty(b, device="cuda"))
            row = []
            for tiles in variants:
                for splits in split_opts:
                    ms = bench(lambda: unified_attention(
                        q, kv, out, qsl, sl, bt, batch, 1, p, num_splits=splits,
                        workspace=ws, tiles=tiles))  # fmt: skip
                    row.append((gb / ms, tiles, splits))
            row.sort(reverse=True)
            peer_txt = ""
            if layout == "NHD":
                for name, fn in decode_peers(q, kv, sl, bt, seq_len).items():
                    peer_txt += f" {name}={gb / bench(fn):.2f}"
            best = ", ".join(f"{tbs:.2f}TB/s {t} s{s}" for tbs, t, s in row[:4])
            print(f"decode {batch}x{seq_len} {layout}: {best} |{peer_txt}")


def sweep_prefill(quick: bool) -> None:
    """Paged-gather vs TMA-from-input variants (the latter checked equal to the former)."""
    from anyattn.ops.reshape_and_cache import reshape_and_cache

    paged_variants = [(128, 128, 8, 2), (128, 32, 4, 3)]
    input_variants = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3),
                      (128, 64, 8, 4), (128, 64, 4, 3), (128, 64, 4, 2, True),
                      (128, 64, 4, 3, True), (128, 128, 4, 2, True), (128, 64, 8, 3, True),
                      (128, 128, 8, 3, True), (64, 64, 4, 2, True)]  # fmt: skip
    if quick:
        paged_variants, input_variants = paged_variants[:1], input_variants[:2]
    for batch, length in ((16, 1024), (4, 4096), (1, 16384)):
        q, kv, qsl, sl, bt = paged([length] * batch, [length] * batch, "NHD")
        k = torch.randn(batch * length, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pos = torch.arange(length, device="cuda")
        slots = (bt[:, pos // BS].long() * BS + pos % BS).reshape(-1)
        reshape_and_cache(k, v, kv, slots)
        tflop = 4 * batch * H * length * length * D / 2 / 1e12
        p = UnifiedAttentionParams(scale=D**-0.5)
        ref = torch.empty_like(q)
        unified_attention(q, kv, ref, qsl, sl, bt, batch, length, p)
        row = []
        for tiles in paged_variants + [(*t, "in") for t in input_variants]:
            from_input = tiles[-1] == "in"
            t = tiles[:-1] if from_input else tiles
            kw = {"key": k, "value": v} if from_input else {}
            out = torch.empty_like(q)
            try:
                unified_attention(q, kv, out, qsl, sl, bt, batch, length, p, tiles=t, **kw)
                err = (out.float() - ref.float()).abs().max().item()
                ms = bench(lambda: unified_attention(
                    q, kv, out, qsl, sl, bt, batch, length, p, tiles=t, **kw))  # fmt: skip
                row.append((tflop / ms * 1e3, tiles, err))
            except Exception as e:  # e.g. out of shared memory
                print(f"  {tiles}: {type(e).__name__}: {str(e)[:200]}")
        row.sort(reverse=True, key=lambda x: x[0])
        peer_txt = ""
        for name, fn in prefill_peers(q, k, v, qsl, length).items():
            peer_txt += f" {name}={tflop / bench(fn) * 1e3:.0f}"
        best = ", ".join(f"{t:.0f}TF {c} e{e:.2g}" for t, c, e in row)
        print(f"prefill {batch}x{length}: {best} |{peer_txt}")


def sweep_mixed(quick: bool) -> None:
    """48 decodes of 4096 context + 2 chunked prefills of 512 new tokens (1536 context), one
    launch: which tile shape serves both kinds best."""
    variants = [(16, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3),
                (128, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)]  # fmt: skip
    if quick:
        variants = variants[:2]
    q_lens, seq_lens = [1] * 48 + [512] * 2, [4096] * 48 + [2048] * 2
    q, kv, qsl, sl, bt = paged(q_lens, seq_lens, "NHD")
    gb = (48 * 4096 + 2 * 2048) * HKV * D * 2 * 2 / 1e9
    p = UnifiedAttentionParams(scale=D**-0.5)
    ref = torch.empty_like(q)
    unified_attention(q, kv, ref, qsl, sl, bt, 50, 512, p)
    row = []
    for tiles in variants:
        out = torch.empty_like(q)
        unified_attention(q, kv, out, qsl, sl, bt, 50, 512, p, tiles=tiles)
        err = (out.float() - ref.float()).abs().max().item()
        ms = bench(lambda: unified_attention(q, kv, out, qsl, sl, bt, 50, 512, p, tiles=tiles))
        row.append((ms * 1e3, tiles, err))
    row.sort(key=lambda x: x[0])
    print("mixed 48x4096 + 2x512: " + ", ".join(
        f"{us:.0f}us ({gb / us * 1e3:.2f}TB/s) {t} e{e:.2g}" for us, t, e in row))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("unified_attention_tune: needs a CUDA GPU; nothing to do here.")
        sys.exit(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if "check" not in args.skip:
        check()
    if "decode" not in args.skip:
        sweep_decode(args.quick)
    if "prefill" not in args.skip:
        sweep_prefill(args.quick)
    if "mixed" not in args.skip:
        sweep_mixed(args.quick)


if __name__ == "__main__":
    main()
