"""Measured selection ("fastest") against every single backend on the kernel table's cases, in
one run, and `anyattn explain --measure` twice over one cache folder.

1. The table. Five cases of `benchmarks/kernels.py` (bf16, 32 query / 8 KV heads, head size
   128, block 16): decode 64 x 4096 and 8 x 32768 (TB/s of K+V), prefill 16 x 1024 and 4 x 4096
   (TFLOP/s), mixed 48 decodes of 4096 keys + 2 chunked prefills of 512 new tokens after 1536
   (us). For each case:
   - `anyattn.selector.measure_backends(config, limits)`, the measurement behind
     `select_backend(config, policy="fastest", limits=...)` and `LLM(backend="fastest")`, under
     engine limits whose steps of the case's phase contain the case's batch (`case_limits`; the
     mixed step has the case's decodes and its prefill tokens as one chunk). Its choice for the
     case's phase is what "fastest" picks there; it measures without reading the cache.
   - FLASH_ATTN, FLASHINFER, TRITON (`--backends`) and the pick, each set up as an engine does
     (`kernels.prepare_backend`: registry, builder, `build` once, K/V written) and checked
     against float64 rows; then only `impl.forward` is timed, as a user calls it: CUDA events
     behind a hold kernel (device time), the contenders in alternating rounds.
   - The verdict: the pick's median over the best single backend's median at most 1.03, or
     their difference within the sum of both medians' absolute deviations (this run's spread).
   The mixed case also times the decode and prefill choices as a per-phase pair when they differ
   and can share a cache (docs/per_phase.md): the decode rows on the decode choice and the
   prefill rows on the prefill choice over one cache (`--pair D,P` names another pair); the
   engine runs such a pair only when the measurement predicts it pays (its note says).
2. `anyattn explain --measure` (its entry point, `anyattn.cli.main`, in this process, after the
   table: kernels are compiled by then) twice with `ANYATTN_CACHE_DIR` a fresh folder: the first
   run checks and times (the calls into the timing and the oracle check are counted), the second
   reads the cache and must count none and print "(no timing done)".

GPU: `PYTHONPATH=src:<FlashInfer, FA4> python3 benchmarks/fastest.py [--quick] [--only
table,explain] [--cases decode-64x4096,...] [--json PATH]`. Markdown to stdout, progress to
stderr. CPU smoke run (tiny fp32 layer, TORCH and FLEX_ATTENTION): `--device cpu --quick`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import kernels
import torch
from _timing import gpu_times_us, markdown_table, synchronize
from fastest_explain import ExplainRun, explain_report, explain_twice
from fastest_pair import prepare_pair

from anyattn.config import BatchLimits
from anyattn.measure import Measurement
from anyattn.selector import measure_backends

GPU_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON")
CPU_BACKENDS = ("TORCH", "FLEX_ATTENTION")
GPU_CASES: dict[str, kernels.CaseSpec] = {
    "decode-64x4096": kernels.decode_case(64, 4096),
    "decode-8x32768": kernels.decode_case(8, 32768),
    "prefill-16x1024": kernels.prefill_case(16, 1024),
    "prefill-4x4096": kernels.prefill_case(4, 4096),
    "mixed": kernels.mixed_case(),
}
# The same five kinds of batch at sizes the CPU runs in seconds.
CPU_CASES: dict[str, kernels.CaseSpec] = {
    "decode-64x4096": kernels.decode_case(4, 64),
    "decode-8x32768": kernels.decode_case(2, 256),
    "prefill-16x1024": kernels.prefill_case(4, 32),
    "prefill-4x4096": kernels.prefill_case(2, 64),
    "mixed": kernels.mixed_case(6, 64, 2, 8, 24),
}
CPU_SHAPE = kernels.Shape(
    num_heads=4, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.float32
)
RATIO_TARGET = 1.03
# The token budget of the engine whose limits a decode case is measured under (a usual chunk).
DECODE_CASE_TOKENS = 2048


def case_limits(spec: kernels.CaseSpec) -> BatchLimits:
    """Engine limits under which the measurement's steps of the case's phase contain the case:
    decode N x S: N requests, a model length of 2S (decode steps of 1, N/4 and N requests over
    contexts 1024 and S); prefill N x L: N requests of L tokens (the prefill step is the case);
    mixed: twice its decodes as requests, its decodes plus its prefill tokens as the budget and
    twice the decodes' length (the mixed step: the decodes, then the prefill tokens as one
    chunk over half the decodes' context)."""
    longest = max(spec.seq_lens)
    if spec.section == "decode":
        budget = max(spec.num_reqs, min(DECODE_CASE_TOKENS, 2 * longest))
        return BatchLimits(spec.num_reqs, budget, 2 * longest)
    if spec.section == "prefill":
        return BatchLimits(spec.num_reqs, spec.num_tokens, longest)
    decodes = [s for q, s in zip(spec.query_lens, spec.seq_lens, strict=True) if q == 1]
    prefill_tokens = spec.num_tokens - len(decodes)
    return BatchLimits(2 * len(decodes), len(decodes) + prefill_tokens, 2 * max(decodes))


def _mad(times: Sequence[float]) -> float:
    middle = statistics.median(times)
    return statistics.median(abs(t - middle) for t in times)


def verdict(picked: Sequence[float], best: Sequence[float]) -> tuple[float, str]:
    """(median ratio, "met" | "met (within spread)" | "MISSED") of the picked backend's times
    against the best single backend's (microseconds of the same calls in the same run)."""
    ratio = statistics.median(picked) / statistics.median(best)
    if ratio <= RATIO_TARGET:
        return ratio, "met"
    if statistics.median(picked) - statistics.median(best) <= _mad(picked) + _mad(best):
        return ratio, "met (within spread)"
    return ratio, "MISSED"


@dataclass
class Timed:
    """One contender on one case: status ok / wrong (off the reference: timed, not ranked) /
    skip / error, its times (us), max abs error against float64, set-up and first call
    seconds, the kernel path that ran."""

    status: str
    times_us: list[float] = field(default_factory=list)
    error: float = math.nan
    message: str = ""
    setup_s: float = math.nan
    path: str = ""

    @property
    def median_us(self) -> float:
        return statistics.median(self.times_us) if self.times_us else math.nan


@dataclass
class CaseOutcome:
    """One case: its limits, the measurement (None when it failed: `error`), the pick for the
    case's phase, the pair timed on the mixed case, every contender's `Timed`."""

    key: str
    spec: kernels.CaseSpec
    limits: BatchLimits
    measured: Measurement | None
    pick: str | None
    pair: tuple[str, str] | None
    timed: dict[str, Timed]
    singles: list[str]
    error: str = ""

    @property
    def best(self) -> str | None:
        """The fastest single backend that matched the reference."""
        ok = [n for n in self.singles if n in self.timed and self.timed[n].status == "ok"]
        return min(ok, key=lambda n: self.timed[n].median_us, default=None)

    def compare(self, name: str | None) -> tuple[str, str]:
        """(ratio to the best single backend, verdict) of a contender, or why there is none."""
        best = self.best
        found = self.timed.get(name or "")
        if best is None or found is None or found.status != "ok":
            why = "no pick" if name is None else f"{name}: {found.status if found else 'not run'}"
            return "-", f"n/a ({why})"
        ratio, said = verdict(found.times_us, self.timed[best].times_us)
        return f"{ratio:.3f}", said


@dataclass(frozen=True, slots=True)
class Options:
    rounds: int = 5
    reps: int = 20


def time_case(
    key: str,
    spec: kernels.CaseSpec,
    shape: kernels.Shape,
    device: torch.device,
    backends: Sequence[str],
    options: Options,
    pair: tuple[str, str] | None = None,
) -> CaseOutcome:
    """Measure, then check and time every contender on one case (module docstring, 1)."""
    limits = case_limits(spec)
    config = kernels.selector_config(shape)
    measured, failed = None, ""
    try:
        measured = measure_backends(config, limits, device, use_cache=False, progress=True)
    except Exception as error:  # report it with the case; the single backends still run
        failed = kernels._first_line(error)
        kernels._log(f"[{key}] measure_backends failed: {failed}")
    pick = None if measured is None else measured.choice(spec.section)
    if spec.section != "mixed":
        pair = None
    elif pair is None and measured is not None:
        # Whether or not the engine would run it (its note says), so that the table shows
        # what a pair costs.
        pair = measured.possible_pair
    singles = list(dict.fromkeys([*backends, *([pick] if pick else [])]))
    prepare = {name: functools.partial(kernels.prepare_backend, name) for name in singles}
    if pair is not None:
        prepare["+".join(pair)] = functools.partial(prepare_pair, *pair)
    data = kernels.make_case_data(
        spec, shape, device, num_slots=4 if spec.section == "decode" else 2
    )
    reference = kernels.make_reference(data)
    timed: dict[str, Timed] = {}
    ready = {}
    for name, make in prepare.items():
        start = time.perf_counter()
        try:
            prepared = make(data)
            rows = prepared.rows(prepared.run(0))
            synchronize(device)
            error, ok = kernels.compare(rows, reference, shape.dtype)
            setup_s = time.perf_counter() - start
            timed[name] = Timed("ok" if ok else "wrong", [], error, "", setup_s, prepared.path())
            ready[name] = prepared
        except kernels.Skip as skip:
            timed[name] = Timed("skip", message=str(skip))
        except Exception as error:  # one failing contender must not end the run
            timed[name] = Timed("error", message=kernels._first_line(error))
        kernels._log(f"[{key}] {name}: {timed[name].status} {timed[name].message}")
    for _ in range(options.rounds):  # alternating rounds: every contender sees the same clocks
        for name, prepared in list(ready.items()):
            try:
                times = gpu_times_us(prepared.run, len(data.queries), 2, options.reps, device)
            except Exception as error:
                timed[name] = Timed("error", message=kernels._first_line(error))
                del ready[name]
                continue
            timed[name].times_us += times
    del data, ready
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return CaseOutcome(key, spec, limits, measured, pick, pair, timed, singles, failed)


def _cell(outcome: CaseOutcome, name: str, shape: kernels.Shape) -> str:
    found = outcome.timed.get(name)
    if found is None:
        return "-"
    if found.status in ("skip", "error"):
        return f"{found.status}: {found.message[:80]}"
    spec, t = outcome.spec, found.median_us
    spread = f"±{_mad(found.times_us):.1f}"
    if spec.section == "decode":
        text = f"{kernels.kv_bytes(spec, shape) / t / 1e6:.2f} TB/s ({t:.1f} us {spread})"
    elif spec.section == "prefill":
        text = f"{kernels.case_flops(spec, shape) / t / 1e6:.0f} TFLOP/s ({t:.1f} us {spread})"
    else:
        text = f"{t:.1f} us {spread}"
    return text if found.status == "ok" else f"{text} WRONG ({found.error:.1e})"


def table_report(outcomes: Sequence[CaseOutcome], shape: kernels.Shape) -> str:
    """The comparison table, the engine's run of the mixed case, and what each measurement
    chose (markdown)."""
    names = list(dict.fromkeys(n for o in outcomes for n in o.singles))
    rows = []
    for o in outcomes:
        ratio, said = o.compare(o.pick)
        cells = [_cell(o, n, shape) if n in o.singles else "-" for n in names]
        pick = f"{o.pick} ({o.spec.section})" if o.pick else "none"
        rows.append([f"{o.spec.section} {o.spec.label}", *cells, o.best or "-", pick, ratio, said])
    headers = ["case", *names, "best", '"fastest" picks', "pick / best", "verdict (<= 1.03)"]
    text = [markdown_table(headers, rows)]
    for o in outcomes:
        engine = "measurement failed" if o.measured is None else o.measured.pair_note()
        if o.spec.section == "mixed" and o.pair is None:
            text.append(f"Mixed case, engine: {engine}.")
        elif o.pair is not None:
            name = "+".join(o.pair)
            ratio, said = o.compare(name)
            text.append(
                f"Mixed case, per-phase pair {o.pair[0]} (decodes) + {o.pair[1]} (prefills), "
                f"forward of each part: {_cell(o, name, shape)}; pair / best single {ratio} "
                f"({said}). Engine: {engine}."
            )
    for o in (o for o in outcomes if o.measured is None):
        text.append(f"{o.spec.section} {o.spec.label}: measure_backends failed: {o.error}.")
    rows = []
    for o in (o for o in outcomes if o.measured is not None):
        m, lim = o.measured, o.limits
        steps = ", ".join(s.name for s in m.steps if s.phase.value == o.spec.section)
        first = ", ".join(f"{b} {m.first_calls_s(b):.1f}" for b in m.timings)
        rejected = "; ".join(f"{b}: {why[:60]}" for b, why in m.rejected.items()) or "-"
        rows.append(
            [
                f"{o.spec.section} {o.spec.label}",
                f"{lim.max_num_reqs} / {lim.max_num_tokens} / {lim.max_model_len}",
                steps,
                *(m.choice(p) or "-" for p in ("decode", "prefill", "mixed", "overall")),
                f"{m.timing_s:.1f}",
                first,
                rejected,
            ]
        )
    headers = [
        "case",
        "limits (reqs / tokens / model len)",
        "its phase's steps",
        "decode",
        "prefill",
        "mixed",
        "overall",
        "measure s",
        "first calls s",
        "rejected",
    ]
    text.append("Measurements (`measure_backends`, no cache):\n\n" + markdown_table(headers, rows))
    return "\n\n".join(text)


def header(device: torch.device, shape: kernels.Shape, argv: Sequence[str]) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name} (sm{props.major}{props.minor}, {props.multi_processor_count} SMs)"
    else:
        where = f"CPU ({torch.get_num_threads()} threads)"
    versions = (
        f"torch {torch.__version__}, triton {kernels._version('triton', 'triton')}, "
        f"flashinfer {kernels._version('flashinfer-python', 'flashinfer')}, "
        f"flash_attn (FA4) {kernels._version('flash-attn-4', 'flash_attn.cute')}"
    )
    dtype = str(shape.dtype).removeprefix("torch.")
    return (
        f'## Measured selection ("fastest") against single backends (`benchmarks/fastest.py`)'
        f"\n\n{now}, {where}, {versions}.\nCommand: `python3 benchmarks/fastest.py "
        f"{' '.join(argv)}`.\n{dtype}, {shape.num_heads} query / {shape.num_kv_heads} KV heads, "
        f"head size {shape.head_size}, block {shape.block_size}; only `impl.forward` is timed "
        "(CUDA events behind a hold kernel on a GPU), contenders in alternating rounds; cells "
        "give the median and its absolute deviation."
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and calls")
    parser.add_argument("--only", default="table,explain", help="table, explain (comma list)")
    parser.add_argument("--cases", default=",".join(GPU_CASES), help="comma list of cases")
    parser.add_argument("--backends", default=None, help="single backends (comma list)")
    parser.add_argument(
        "--pair", default=None, metavar="D,P", help="the mixed case's pair (default: measured)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    for flag, valid in (("only", ("table", "explain")), ("cases", tuple(GPU_CASES))):
        parts = kernels._split(getattr(args, flag))
        unknown = [p for p in parts if p not in valid]
        if unknown:
            parser.error(f"--{flag}: unknown {', '.join(unknown)} (expected {', '.join(valid)})")
        setattr(args, flag, parts)
    if args.pair is not None:
        parts = kernels._split(args.pair)
        if len(parts) != 2:
            parser.error(f"--pair: two backends, decode then prefill (got {args.pair!r})")
        args.pair = (parts[0].upper(), parts[1].upper())
    return args


def _to_json(outcomes: Sequence[CaseOutcome], explained: Sequence[ExplainRun]) -> dict:
    cases = {
        o.key: {
            "label": f"{o.spec.section} {o.spec.label}",
            "pick": o.pick,
            "best": o.best,
            "verdict": o.compare(o.pick),
            "pair": o.pair,
            "error": o.error,
            "measurement": None if o.measured is None else o.measured.to_dict(),
            "timed": {n: t.__dict__ for n, t in o.timed.items()},
        }
        for o in outcomes
    }
    runs = [{k: v for k, v in r.__dict__.items() if k != "output"} for r in explained]
    return {"cases": cases, "explain": runs}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    shape, cases = (kernels.Shape(), GPU_CASES) if on_gpu else (CPU_SHAPE, CPU_CASES)
    default = GPU_BACKENDS if on_gpu else CPU_BACKENDS
    backends = [b.upper() for b in kernels._split(args.backends)] if args.backends else default
    options = Options(2, 5) if args.quick else Options()
    started = time.perf_counter()
    print(header(device, shape, argv) + "\n", flush=True)
    outcomes: list[CaseOutcome] = []
    explained: list[ExplainRun] = []
    interrupted = False
    try:
        with torch.no_grad():
            for key in args.cases if "table" in args.only else []:
                outcome = time_case(key, cases[key], shape, device, backends, options, args.pair)
                outcomes.append(outcome)
                ratio, said = outcome.compare(outcome.pick)
                kernels._log(f"[{key}] picks {outcome.pick}: {ratio} of {outcome.best}, {said}")
        if "explain" in args.only:
            explained = explain_twice(shape, device)
    except KeyboardInterrupt:  # a timeout's SIGINT: report what is done
        interrupted = True
    if outcomes:
        print(f"### the table\n\n{table_report(outcomes, shape)}\n", flush=True)
    if explained:
        print(f"### `anyattn explain --measure`, twice\n\n{explain_report(explained)}\n")
    if interrupted:
        print(f"Interrupted after {len(outcomes)} of the table's cases.\n")
    if args.json is not None:
        args.json.write_text(json.dumps(_to_json(outcomes, explained), indent=1, default=str))
    print(f"Total wall time {time.perf_counter() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
