"""FlashInfer's XQA decode against its planned decode wrapper, called directly (H200).

`FlashInferMetadataBuilder.decode_kernel = "auto"` runs a step's decodes through XQA, which
needs no plan, only at block sizes where XQA was measured as fast as the planned tensor-core
decode wrapper (`flashinfer_xqa.AUTO_MIN_BLOCK_SIZE`). This is that measurement: first XQA's
output against a float32 reference read out of the cache by block table (NHD and HND memory
orders, a sliding window, sinks, blocks of 16 and 64, an fp8 e4m3 cache), then both kernels'
GPU time on the same paged batches (CUDA events, `_timing.median_us`, each case twice,
interleaved), and XQA's host time per call.

Run on a CUDA machine with FlashInfer 0.7.2.post1:
`PYTHONPATH=src python3 benchmarks/xqa_decode.py [--blocks 16,32,64]`. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _timing import cpu_times_us, markdown_table, median_us

HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 128
SCALE = HEAD_SIZE**-0.5
WORKSPACE_BYTES = 128 * 1024 * 1024
CASES = ((64, 4096), (256, 2048), (8, 32768), (1, 8192))


def paged_batch(batch: int, keys: int, block_size: int, layout: str, cache_dtype, slots: int):
    """A cache `[blocks, 2, block_size, KVH, D]` (or HND), shuffled block tables, lengths
    `keys` (every third request 5 shorter) and `slots` query sets `[batch, H, D]`."""
    device = torch.device("cuda")
    pages = -(-keys // block_size)
    num_blocks = batch * pages + 7
    shape = (block_size, KV_HEADS) if layout == "NHD" else (KV_HEADS, block_size)
    cache = torch.randn(num_blocks, 2, *shape, HEAD_SIZE, device=device).to(cache_dtype)
    table = (torch.randperm(num_blocks - 7, device=device)[: batch * pages].int() + 7).view(
        batch, pages
    )
    lens = torch.full((batch,), keys, dtype=torch.int32, device=device)
    lens[::3] = keys - 5
    queries = [
        torch.randn(batch, HEADS, HEAD_SIZE, device=device, dtype=torch.bfloat16)
        for _ in range(slots)
    ]
    return cache, table, lens, queries


def reference(query, cache, table, lens, block_size, layout, window_left=-1, sinks=None):
    """float32 attention of each request's query over its keys, read by block table."""
    out = torch.empty_like(query, dtype=torch.float32)
    group = HEADS // KV_HEADS
    for b in range(query.shape[0]):
        n = int(lens[b])
        blocks = cache[table[b, : -(-n // block_size)].long()].float()
        if layout == "HND":
            blocks = blocks.transpose(2, 3)
        k, v = (blocks[:, i].reshape(-1, KV_HEADS, HEAD_SIZE)[:n] for i in (0, 1))
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", query[b].float(), k) * SCALE
        if window_left >= 0:
            scores[:, : max(0, n - 1 - window_left)] = float("-inf")
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None]], 1)
        probs = scores.softmax(-1)[:, :n]
        out[b] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def xqa(query, cache, table, lens, layout, workspace, out, window_left=-1, sinks=None):
    """FlashInfer's XQA decode called directly (the longest sequence the table allows is
    what XQA takes as its bound)."""
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    block_size = cache.shape[2] if layout == "NHD" else cache.shape[3]
    xqa_batch_decode_with_kv_cache(
        query, cache, workspace, table, lens, table.shape[1] * block_size, bmm1_scale=SCALE,
        window_left=window_left, out=out, sinks=sinks, kv_layout=layout,
    )  # fmt: skip


def planned_wrapper(cache, table, lens, block_size, layout):
    """FlashInfer's decode wrapper (tensor cores) planned for the batch."""
    import flashinfer

    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=cache.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout,
                                                            use_tensor_cores=True)  # fmt: skip
    counts = (lens + block_size - 1) // block_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = counts.cpu().cumsum(0)
    pages = torch.cat([table[b, : int(counts[b])] for b in range(len(lens))])
    last = ((lens - 1) % block_size + 1).int()
    wrapper.plan(indptr.to(cache.device), pages, last, HEADS, KV_HEADS, HEAD_SIZE, block_size,
                 q_data_type=torch.bfloat16, kv_data_type=cache.dtype, sm_scale=SCALE)  # fmt: skip
    return wrapper


def check() -> str:
    checks = [
        ("NHD", 16, -1, False, torch.bfloat16),
        ("HND", 16, -1, False, torch.bfloat16),
        ("NHD", 16, 100, False, torch.bfloat16),
        ("NHD", 16, -1, True, torch.bfloat16),
        ("HND", 64, -1, False, torch.bfloat16),
        ("NHD", 16, -1, False, torch.float8_e4m3fn),
    ]
    rows = []
    for layout, block_size, window_left, with_sinks, cache_dtype in checks:
        cache, table, lens, (query,) = paged_batch(5, 700, block_size, layout, cache_dtype, 1)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=cache.device)
        sinks = torch.randn(HEADS, device=cache.device) if with_sinks else None
        out = torch.empty_like(query)
        xqa(query, cache, table, lens, layout, workspace, out, window_left, sinks)
        ref = reference(query, cache, table, lens, block_size, layout, window_left, sinks)
        error = (out.float() - ref).abs().max().item()
        dtype = str(cache_dtype).removeprefix("torch.")
        rows.append((layout, block_size, window_left, with_sinks, dtype, f"{error:.4f}"))
    headers = ["layout", "block", "window_left", "sinks", "cache", "max abs error vs fp32"]
    return markdown_table(headers, rows)


def bench(blocks) -> str:
    device = torch.device("cuda")
    rows = []
    for batch, keys in CASES:
        for block_size in blocks:
            cache, table, lens, queries = paged_batch(batch, keys, block_size, "NHD",
                                                      torch.bfloat16, 3)  # fmt: skip
            outs = [torch.empty_like(q) for q in queries]
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            wrapper = planned_wrapper(cache, table, lens, block_size, "NHD")

            def run_wrapper(s, wrapper=wrapper, cache=cache, queries=queries, outs=outs):
                wrapper.run(queries[s], cache, out=outs[s])

            def run_xqa(s, cache=cache, table=table, lens=lens, queries=queries, outs=outs,
                        workspace=workspace):  # fmt: skip
                xqa(queries[s], cache, table, lens, "NHD", workspace, outs[s])

            times = [median_us(fn, 3, 5, 30, device) for fn in (run_wrapper, run_xqa) * 2]
            host = cpu_times_us(lambda run_xqa=run_xqa: run_xqa(0), 50)
            torch.cuda.synchronize()
            wrapper_us, xqa_us = min(times[0], times[2]), min(times[1], times[3])
            rows.append((
                f"{batch} x {keys}", block_size, f"{times[0]:.1f} / {times[2]:.1f}",
                f"{times[1]:.1f} / {times[3]:.1f}", f"{xqa_us / wrapper_us:.3f}",
                f"{statistics.median(host):.1f}",
            ))  # fmt: skip
    headers = ["case", "block", "wrapper us", "XQA us", "XQA / wrapper", "XQA host us/call"]
    return markdown_table(headers, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="16,64", help="block sizes to time (default 16,64)")
    args = parser.parse_args()
    import flashinfer

    print(f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}\n")  # fmt: skip
    print("### XQA against a float32 reference\n\n" + check() + "\n")
    blocks = tuple(int(b) for b in args.blocks.split(","))
    print("### GPU time, bf16, 32 / 8 heads of 128 (min of two medians each)\n")
    print(bench(blocks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
