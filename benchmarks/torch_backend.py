"""TORCH backend on the CPU against plain SDPA over the same data laid out contiguously.

Decode: 8 requests x 512 context, one new token each. Prefill: 8 fresh requests x 512 tokens.
GQA 32 query / 8 KV heads, head_size 128, float32, block 16, shuffled blocks. Prints the best
of N milliseconds (the least disturbed run on a shared machine) and the ratio TORCH / SDPA
(lower is better; the decode target is 2x).

Run: `.venv/bin/python benchmarks/torch_backend.py [--repeats N] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from anyattn.backends.torch_attn import TorchAttentionBackend
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing import layer_records

NUM_REQS, CONTEXT, HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 8, 512, 32, 8, 128, 16


class _Layer:
    layer_name = "bench"
    k_scale = torch.tensor(1.0)
    v_scale = torch.tensor(1.0)


def _best_ms(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Best-of-`repeats` milliseconds of each function, calls interleaved so that every one
    sees the same background load on a shared machine."""
    for fn in fns:
        for _ in range(3):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
    return best


def _case(query_len: int, repeats: int) -> dict[str, float]:
    """Time one step where every request has `query_len` new tokens and 512 keys in total."""
    gen = torch.Generator().manual_seed(0)
    context = CONTEXT - query_len if query_len > 1 else CONTEXT
    seq_len = context + query_len
    blocks_per_req = -(-seq_len // BLOCK)
    num_blocks = NUM_REQS * blocks_per_req * 2 + 1
    block_ids = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: NUM_REQS * blocks_per_req]
    block_table = block_ids.view(NUM_REQS, blocks_per_req).int()
    cm = make_common_attn_metadata([query_len] * NUM_REQS, [seq_len] * NUM_REQS, block_table, BLOCK)
    k = torch.randn(NUM_REQS, seq_len, KV_HEADS, HEAD_SIZE, generator=gen)
    v = torch.randn(NUM_REQS, seq_len, KV_HEADS, HEAD_SIZE, generator=gen)
    q = torch.randn(NUM_REQS * query_len, HEADS, HEAD_SIZE, generator=gen)
    cache = allocate_kv_cache(
        TorchAttentionBackend, num_blocks, BLOCK, KV_HEADS, HEAD_SIZE, torch.float32
    )
    # every token of every request goes into its pages
    all_slots = make_common_attn_metadata(
        [seq_len] * NUM_REQS, [seq_len] * NUM_REQS, block_table, BLOCK
    ).slot_mapping
    impl = TorchAttentionBackend.get_impl_cls()(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
    impl.do_kv_cache_update(_Layer(), k.flatten(0, 1), v.flatten(0, 1), cache, all_slots)
    spec = AttentionSpec(BLOCK, KV_HEADS, HEAD_SIZE, torch.float32)
    builder = TorchAttentionBackend.get_builder_cls()(
        spec,
        layer_records(spec, ["bench"]),
        BatchLimits(NUM_REQS, NUM_REQS * seq_len, seq_len),
        "cpu",
    )
    md = builder.build(0, cm)
    key = k[:, context:].flatten(0, 1)
    value = v[:, context:].flatten(0, 1)
    out = torch.empty_like(q)

    def paged() -> None:
        impl.forward(_Layer(), q, key, value, cache, md, out)

    # contiguous SDPA on the same data: q [B, H, Lq, D], k/v [B, KVH, L, D]
    q_c = q.view(NUM_REQS, query_len, HEADS, HEAD_SIZE).transpose(1, 2).contiguous()
    k_c = k.transpose(1, 2).contiguous()
    v_c = v.transpose(1, 2).contiguous()

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_c, k_c, v_c, is_causal=query_len > 1, enable_gqa=True, scale=HEAD_SIZE**-0.5
        )

    paged()
    expected = contiguous().transpose(1, 2).reshape_as(out)
    max_err = (out - expected).abs().max().item()
    assert max_err < 1e-4, f"TORCH and SDPA disagree (max error {max_err})"
    t_paged, t_sdpa = _best_ms([paged, contiguous], repeats)
    return {"torch_ms": t_paged, "sdpa_ms": t_sdpa, "ratio": t_paged / t_sdpa, "max_err": max_err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {
        f"decode {NUM_REQS}x{CONTEXT}": _case(1, args.repeats),
        f"prefill {NUM_REQS}x{CONTEXT}": _case(CONTEXT, max(3, args.repeats // 4)),
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32, GQA 32/8, D=128")
    print(f"{'case':<16} {'TORCH ms':>9} {'SDPA ms':>9} {'ratio':>6}")
    for name, r in results.items():
        print(f"{name:<16} {r['torch_ms']:>9.2f} {r['sdpa_ms']:>9.2f} {r['ratio']:>6.2f}")


if __name__ == "__main__":
    main()
