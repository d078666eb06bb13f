"""Where FLEX_ATTENTION's forward time goes, part by part, next to FlexAttention called directly.

Issue 6 asks each wrapper to cost at most 3% over calling its library directly; FLEX_ATTENTION
took 1.6-2.0x in the fifth session (benchmarks/RESULTS.md; a symbolic storage offset and
unknown divisibility under dynamic shapes, since fixed). This times, on the cases of
`benchmarks/kernels.py` (requests ordered decodes first, as the builder asks and kernels.py
does), each part of one layer's forward alone, so that the gap can be attributed:

- the whole `forward` (the step's plans already made, as for every layer after the first);
- the K/V copy out of the paged cache into the workspace (`ops.gather_kv_rows`; on CUDA
  decodes read the cache in place, and only the other requests' keys are copied);
- the attention calls on the workspace, as the forward makes them (the decode layout's and
  the rows', compiled with dynamic shapes so that no step size recompiles), with their
  output copies and their query copies (none where the caller's query covers the padded
  rows or decode batch);
- the same compiled kernels alone, on queries already in their layout (no copies);
- FlexAttention called directly on keys laid out once (`kernels.prepare_flex`, the
  wrapper-cost peer).

GPU times by CUDA events (`_timing.median_us`). On the CPU (`--device cpu`, a tiny float32
layer) it only checks that every part runs: the benchmark's own test.

Run on the GPU machine: `PYTHONPATH=src python3 benchmarks/flex_breakdown.py [--cases
decode,prefill,mixed] [--block-size 16] [--reps 30]`. Prints a markdown table per case.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from collections.abc import Callable, Sequence

import kernels
import torch
from _timing import markdown_table, median_us, synchronize

from anyattn.backends import flex_attention as flex
from anyattn.backends import flex_attention_masks as masks
from anyattn.backends.flex_attention import FlexAttentionBackend
from anyattn.backends.flex_attention_paged import PagedDecodePlan
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing import layer_records
from anyattn.types import AttentionType

CASES = {spec.section: spec for spec in kernels.WRAPPER_CASES}
# A layer small enough for the CPU check (float32: exact enough to compare parts by eye).
TINY = kernels.Shape(num_heads=4, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float32)
TINY_CASES = {
    "decode": kernels.decode_case(3, 40),
    "prefill": kernels.prefill_case(2, 33),
    "mixed": kernels.mixed_case(3, 40, 1, 17, 20),
}


def parts(spec: kernels.CaseSpec, shape: kernels.Shape, device: torch.device) -> dict:
    """`{part name: run(slot)}` for one case, set up as an engine sets a layer up."""
    order = kernels.request_order(spec.query_lens, decode_threshold=1)
    spec = dataclasses.replace(
        spec,
        query_lens=tuple(spec.query_lens[r] for r in order),
        seq_lens=tuple(spec.seq_lens[r] for r in order),
    )
    data = kernels.make_case_data(spec, shape, device, num_slots=1)
    kv_spec = AttentionSpec(shape.block_size, shape.num_kv_heads, shape.head_size, shape.dtype)
    limits = BatchLimits(spec.num_reqs, spec.num_tokens, max(spec.seq_lens))
    builder = FlexAttentionBackend.get_builder_cls()(
        kv_spec, layer_records(kv_spec, ["l.0"]), limits, device
    )
    kv_cache = allocate_kv_cache(
        FlexAttentionBackend, data.num_blocks, shape.block_size, shape.num_kv_heads,
        shape.head_size, shape.dtype, device=device,
    )  # fmt: skip
    kv_cache.copy_(data.cache)
    common = make_common_attn_metadata(
        list(spec.query_lens), list(spec.seq_lens), data.block_table, shape.block_size, device
    )
    md = builder.build(0, common)
    impl = FlexAttentionBackend.get_impl_cls()(
        shape.num_heads, shape.head_size, shape.scale, shape.num_kv_heads, None, None, "auto",
        None, AttentionType.DECODER, None, None,
    )  # fmt: skip
    one = torch.ones((), dtype=torch.float32, device=device)
    layer = kernels._Layer("l.0", one, one)
    query = data.queries[0]
    output = torch.empty_like(query)
    impl.forward(layer, query, None, None, kv_cache, md, output)  # compiles, makes the plans

    # The kernels' own inputs, as the forward makes them (on CUDA decodes read the cache in
    # place, and only the other requests' keys are copied).
    mods = impl._mods_on(device)
    paged = impl._in_place(kv_cache, md, query.dtype)
    decode_plan, rows_plan = impl._plans(md, "sinks" in mods, device, paged)
    in_place = isinstance(decode_plan, PagedDecodePlan)
    skip = decode_plan.num_decodes if in_place else 0

    def load_kv(slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if rows_plan is None and in_place:
            return None  # a decode step read in place copies nothing
        return impl._load_kv(layer, None, None, kv_cache, md, query.dtype, skip)

    loaded = load_kv(0)
    k, v = (flex._as_kernel_rows(x.unsqueeze(0), device) for x in loaded) if loaded else (0, 0)
    heads = (shape.num_heads, shape.num_kv_heads)
    config = (device.type, query.dtype, shape.head_size, *heads, *sorted(mods))

    def attend(slot: int) -> None:
        if in_place:
            impl._attend_paged_decodes(query, paged, md, decode_plan, mods, config, output, None)
        elif decode_plan is not None:
            impl._attend_decodes(query, k, v, md, decode_plan, mods, config, output, None)
        if rows_plan is not None:
            impl._attend_rows(query, k, v, md, rows_plan, mods, config, output, None)

    # The kernels alone: their queries as the forward hands them over (a view of the caller's
    # query where it covers the padded rows or batch, else the workspace's copy).
    kernel_calls = []
    if decode_plan is not None:
        q = impl._decode_queries(query, md, decode_plan.num_decodes, decode_plan.batch)
    if in_place:
        kernel_calls.append(
            (impl._paged_kernel(q, paged, md, decode_plan, mods, config, False), None, None)
        )
    elif decode_plan is not None:
        kernel_calls.append(
            (flex._compiled_attend((*config, "decode"), False), flex._static_dims(q, (1, 2, 3)),
             decode_plan)
        )  # fmt: skip
    if rows_plan is not None:
        q = impl._rows_queries(query, md, rows_plan)
        kernel_calls.append((impl._rows_kernel(config, False, query), q, rows_plan))

    def kernels_alone(slot: int) -> None:
        for compiled, q, plan in kernel_calls:
            if plan is None:
                compiled()  # the paged decode, its inputs bound
            else:
                mod = masks.score_mod(impl._rows_mods(mods) if plan is rows_plan else mods, plan)
                compiled(q, k, v, plan.block_mask, mod, 1.0)

    peer = kernels.prepare_flex(data)
    # The parts compute the same attention: the forward's output against the direct call's
    # (checked before anything is timed), and the attention calls alone against the forward.
    tol = kernels.TOLERANCE[shape.dtype]
    impl.forward(layer, query, None, None, kv_cache, md, output)
    torch.testing.assert_close(peer.rows(peer.run(0)), output, atol=tol, rtol=tol)
    forward_output = output.clone()
    output.zero_()
    attend(0)
    torch.testing.assert_close(output, forward_output, atol=0, rtol=0)
    decodes = "paged decode" if in_place else "decode layout"
    layouts = [
        f"{decodes}: {decode_plan.num_decodes} requests" if decode_plan else None,
        f"rows: {rows_plan.num_rows} rows" if rows_plan else None,
    ]
    return {
        "forward (whole)": lambda s: impl.forward(layer, query, None, None, kv_cache, md, output),
        "K/V copy out of the paged cache": load_kv,
        "attention calls with their query and output copies ("
        + ", ".join(x for x in layouts if x)
        + ")": attend,
        "the compiled kernels alone (queries already in their layout)": kernels_alone,
        "FlexAttention directly (kernels.prepare_flex)": peer.run,
    }


def time_parts(
    runs: dict[str, Callable[[int], object]], device: torch.device, reps: int
) -> list[list[str]]:
    """One row per part: name, median us, and its share of the whole forward."""
    synchronize(device)
    times = {name: median_us(run, 1, 3, reps, device) for name, run in runs.items()}
    whole = times["forward (whole)"]
    return [[name, f"{us:.1f}", f"{us / whole:.2f}"] for name, us in times.items()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="decode,prefill,mixed")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--block-size", type=int, help="tokens per page (default: kernels.py's)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("flex_breakdown.py: no CUDA device; nothing to time (--device cpu to check it).")
        return 0
    shape, cases = (kernels.Shape(), CASES) if device.type == "cuda" else (TINY, TINY_CASES)
    if args.block_size:
        shape = dataclasses.replace(shape, block_size=args.block_size)
    failed = 0
    for name in args.cases.split(","):
        spec = cases[name]
        where = f"{device.type}, {shape.block_size}-token blocks"
        print(f"### FLEX_ATTENTION forward, {spec.section} {spec.label} ({where})\n")
        try:
            with torch.no_grad():
                rows = time_parts(parts(spec, shape, device), device, args.reps)
        except Exception as e:  # one case failing must not lose the others
            failed += 1
            traceback.print_exc()
            print(f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0]}\n", flush=True)
            continue
        print(markdown_table(["part", "us (median)", "of the forward"], rows) + "\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
