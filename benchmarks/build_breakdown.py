"""Where the host time of `build` goes, part by part, for the batch of issue 6's build target
(256 decodes of 2048 keys, block 16, bf16, 32 query / 8 KV heads, head_size 128).

`benchmarks/kernels.py` times each backend's whole `build`; this splits FLASHINFER's and
FLEX_ATTENTION's into their steps, each timed alone (median of `--reps` calls, after a warm-up),
so that the cost left over can be attributed. FLASHINFER's parts: the split of a decode-only
step (`decode_step_arrays`, and `plan_step` without the decode wrapper's host arrays for
comparison), the decode layout made on the device (`DecodeLayouts.make`: page
offsets, last-page lengths and pages in one launch, into a buffer the builder keeps),
`keep_schedule` (what a steady-state step of 256 decodes over 8 KV heads does to the wrapper;
`replan_decode` keeping the schedule for comparison), and what a step whose schedule is
planned adds: `plan_step`'s decode arrays, `replan_decode` with FlashInfer's C++ planner, and
the planner call with its arguments alone; and the whole build once more with
`keep_fixed_schedules` off, so that every step runs the C++ planner. Making the step's
`CommonAttentionMetadata` (its checks) is timed for comparison: it is not part of `build`.

Run on a CUDA machine with FlashInfer 0.7.2.post1: `python3 benchmarks/build_breakdown.py`
(`--varied`: lengths spread over `seq_len / 2 ... 3 * seq_len / 2`, as `kernels.py` times them
too). Prints a markdown table.

`--xqa` splits instead FLASHINFER's build with 64-token blocks on SM90+, where XQA runs the
decodes and nothing is planned: the eager and the CUDA-graph replay build, `plan_step`
without decode arrays, XQA's eager inputs (views of the step's table and lengths) and a replay
step's copy into the graph's fixed buffers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
from collections.abc import Callable

import torch
from _timing import cpu_times_us

from anyattn.backends import flashinfer as fi_backend
from anyattn.backends.flashinfer_plan import decode_step_arrays, plan_step
from anyattn.backends.flashinfer_replan import keep_schedule, planner_arguments, replan_decode
from anyattn.backends.flashinfer_xqa import XqaGraphBuffers
from anyattn.backends.flex_attention import FlexAttentionMetadataBuilder
from anyattn.backends.flex_attention_plan import lay_out_step
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.metadata import CommonAttentionMetadata, make_common_attn_metadata
from anyattn.ops.graph_decode_inputs import GraphDecodeInputsLaunch
from anyattn.testing import assign_blocks, layer_records


def median_us(fn: Callable[[], object], reps: int) -> float:
    """Median host microseconds of `reps` calls of `fn`, after one warm-up call."""
    fn()
    return statistics.median(cpu_times_us(fn, reps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--num-reqs", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--varied", action="store_true", help="lengths seq_len/2 .. 3*seq_len/2")
    parser.add_argument("--xqa", action="store_true", help="FLASHINFER's XQA path, block 64")
    args = parser.parse_args()
    n, seq_len, block_size = args.num_reqs, args.seq_len, 64 if args.xqa else 16
    device = torch.device("cuda")
    seq_lens = [seq_len] * n
    if args.varied:  # the spread of kernels.py's varied-length build timing
        seq_lens = [seq_len // 2 + (i * 997) % seq_len for i in range(n)]
    table, _ = assign_blocks(seq_lens, block_size)
    cm = make_common_attn_metadata([1] * n, seq_lens, table, block_size, device)
    spec = AttentionSpec(block_size, 8, 128, torch.bfloat16)
    limits = BatchLimits(max_num_reqs=n, max_num_tokens=n, max_model_len=max(seq_lens))
    rows: list[tuple[str, float]] = []
    if args.xqa:
        rows = xqa_rows(cm, spec, limits, args.reps)
        return print_rows(rows, n, seq_len, args)

    impl = fi_backend.FlashInferImpl(32, 128, 128**-0.5, 8)
    layers = {"l": impl.layer_params()}
    builder = fi_backend.FlashInferMetadataBuilder(spec, layers, limits, device)
    md = builder.build(0, cm)  # plan() once: compiles, sets the wrapper up
    md = builder.build(0, cm)
    wrapper = md.step.planned[impl.plan_key].decode
    qsl, seq = cm.query_start_loc_cpu[: n + 1].numpy(), cm.seq_lens_cpu[:n].numpy()
    host = cm.host_batch
    width = cm.block_table_tensor.shape[1]

    def arrays(decode_arrays=True):
        return plan_step(qsl, seq, block_size, width, decode_arrays=decode_arrays)

    decode = arrays().decode
    table = cm.block_table_tensor

    def make_layout():
        return builder._decode_layout(table, cm.seq_lens, host, n, None, 0)

    layout = make_layout()
    layer = dict(num_qo_heads=32, num_kv_heads=8, head_size=128, page_size=block_size,
                 window_left=-1)  # fmt: skip

    def replan(run_planner=True):
        call = functools.partial(
            replan_decode, wrapper, layout, decode if run_planner else None, **layer,
            **builder._qo_indptr(n), run_planner=run_planner)  # fmt: skip
        if run_planner:
            builder._staged_plan(wrapper, call)
        else:
            call()

    rebuilt = fi_backend.FlashInferMetadataBuilder(spec, layers, limits, device)
    rebuilt.keep_fixed_schedules = False
    rows += [
        ("FLASHINFER build (whole)", median_us(lambda: builder.build(0, cm), args.reps)),
        ("  the same, the schedule re-planned every step", median_us(
            lambda: rebuilt.build(0, cm), args.reps)),
        ("  (the metadata made and checked, for comparison)", median_us(
            lambda: dataclasses.replace(cm), args.reps)),
        ("  decode_step_arrays (the split of a decode-only step)", median_us(
            lambda: decode_step_arrays(n, host.max_seq_len, block_size, width), args.reps)),
        ("  (plan_step without decode arrays, numpy, for comparison)", median_us(
            lambda: arrays(False), args.reps)),
        ("  the decode layout on the device (DecodeLayouts.make: one launch)", median_us(
            make_layout, args.reps)),
        ("  keep_schedule (the wrapper pointed at the layout)", median_us(
            lambda: keep_schedule(wrapper, layout), args.reps)),
        ("  (replan_decode keeping the schedule, for comparison)", median_us(
            lambda: replan(False), args.reps)),
        ("  where the planner runs: plan_step's decode arrays (numpy)", median_us(
            arrays, args.reps)),
        ("  where the planner runs: replan_decode (with the pool's lending)", median_us(
            replan, args.reps)),
    ]  # fmt: skip
    plan_kwargs = dict(**layer, qo_indptr_host=builder._qo_indptr(n)["qo_indptr_host"])

    def planner_alone():
        # (its arguments are made inside: between plans the wrapper holds no page-locked
        # buffer, the builder's pool lends it one for each plan)
        builder._staged_plan(wrapper, lambda: wrapper._cached_module.plan(
            *planner_arguments(wrapper, decode, **plan_kwargs)))  # fmt: skip

    rows.append(("    C++ planner, its arguments and the pool's lending", median_us(
        planner_alone, args.reps)))  # fmt: skip

    flex = FlexAttentionMetadataBuilder(spec, layer_records(spec, ["l"]), limits, device)
    nct = cm.num_computed_tokens_cpu[:n].numpy()
    rows += [
        ("FLEX_ATTENTION build (whole)", median_us(lambda: flex.build(0, cm), args.reps)),
        ("  lay_out_step (numpy)", median_us(lambda: lay_out_step(qsl, seq, nct), args.reps)),
    ]
    return print_rows(rows, n, seq_len, args)


def xqa_rows(
    cm: CommonAttentionMetadata, spec: AttentionSpec, limits: BatchLimits, reps: int
) -> list[tuple[str, float]]:
    """The parts of FLASHINFER's build when XQA runs the decodes (see the module docstring)."""
    n, device = cm.num_reqs, cm.block_table_tensor.device
    graphs = dataclasses.replace(limits, cudagraph_capture_sizes=(n,))
    layers = {"l": fi_backend.FlashInferImpl(32, 128, 128**-0.5, 8).layer_params()}
    eager = fi_backend.FlashInferMetadataBuilder(spec, layers, limits, device)
    replay = fi_backend.FlashInferMetadataBuilder(spec, layers, graphs, device)
    replay.build_for_cudagraph_capture(cm)
    md = eager.build(0, cm)
    if md.step.xqa is None:
        raise SystemExit("build_breakdown --xqa: XQA does not run these decodes (needs SM90+)")
    host = cm.host_batch
    copy = GraphDecodeInputsLaunch(device, "build_breakdown")
    buffers = XqaGraphBuffers(n, -(-limits.max_model_len // spec.block_size), device, copy)
    most = -(-int(host.seq_lens.max()) // spec.block_size)
    table = cm.block_table_tensor
    return [
        ("FLASHINFER build, XQA decodes (whole)", median_us(lambda: eager.build(0, cm), reps)),
        ("FLASHINFER build, CUDA-graph replay (whole)", median_us(
            lambda: replay.build(0, cm), reps)),
        ("  (the metadata made and checked, for comparison)", median_us(
            lambda: dataclasses.replace(cm), reps)),
        ("  plan_step (no decode arrays)", median_us(lambda: plan_step(
            host.query_start_loc, host.seq_lens, spec.block_size, table.shape[1],
            decode_arrays=False), reps)),
        ("  XQA inputs, eager (table and lengths checked, views)", median_us(
            lambda: eager._xqa_inputs(cm, host, n, None), reps)),
        ("  replay: copy into the graph's buffers (one launch)", median_us(
            lambda: buffers.fill(table, cm.seq_lens, n, most), reps)),
    ]  # fmt: skip


def print_rows(rows: list[tuple[str, float]], n: int, seq_len: int, args) -> int:
    keys = f"{seq_len // 2}-{seq_len * 3 // 2 - 1}" if args.varied else seq_len
    block = 64 if args.xqa else 16
    print(f"| part ({n} decodes x {keys} keys, block {block}) | host us (median of {args.reps}) |")
    print("|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
