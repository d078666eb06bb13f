"""`anyattn explain --measure`: the measured selection for one layer configuration, printed:
the steps (from the engine's limits), each candidate's summed time per phase and first-call
seconds, the rejections, the choices, KV-cache sharing, what the engine runs, and what the cache
did (docs/measured_selection.md).
"""

from __future__ import annotations

import argparse

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from anyattn.cli_common import positive_int
from anyattn.config import AttentionSelectorConfig, BatchLimits
from anyattn.measure import OVERALL, Measurement, Phase
from anyattn.selector import measure_backends

__all__ = ["add_measure_arguments", "limits_from_args", "print_measurement", "run_measure"]

# The engine's defaults (`anyattn.engine.LLM`), so that `explain --measure` times its steps.
_DEFAULT_LIMITS = {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "max_model_len": 4096}


def add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--measure`, the limits and `--no-measure-cache` to `explain`'s parser."""
    group = parser.add_argument_group("measured selection (--measure)")
    group.add_argument(
        "--measure",
        action="store_true",
        help="time every backend that fits on this machine (after a float64 oracle check) and "
        "show the fastest per phase; needs --num-heads (and --num-kv-heads unless --use-mla)",
    )
    for name, default in _DEFAULT_LIMITS.items():
        help = f"engine limit the timed steps come from (default: {default})"
        group.add_argument(
            f"--{name.replace('_', '-')}",
            type=positive_int,
            metavar="N",
            default=default,
            help=help,
        )
    group.add_argument(
        "--num-layers", type=positive_int, metavar="N", default=None,
        help="the model's layers of this configuration, which share each step's metadata "
        "build: the build is then counted, 1/N per layer call, as the engine does (default: "
        "not counted)",
    )  # fmt: skip
    group.add_argument(
        "--no-measure-cache",
        action="store_true",
        help="neither read nor write the measurement cache (see ANYATTN_CACHE_DIR)",
    )


def limits_from_args(args: argparse.Namespace) -> BatchLimits:
    return BatchLimits(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len)


def run_measure(args: argparse.Namespace, config: AttentionSelectorConfig) -> Measurement:
    """Measure for `explain --measure` (progress bar on stderr).

    Raises:
        ValueError, NoBackendError: as `anyattn.selector.measure_backends`.
    """
    return measure_backends(
        config, limits_from_args(args), args.device, use_cache=not args.no_measure_cache,
        progress=True, layers_per_step=args.num_layers,
    )  # fmt: skip


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.1f} us"


def print_measurement(console: Console, measured: Measurement) -> None:
    """Print the measurement's steps, times, choices and cache use."""
    console.print(Text(f"measured on: {measured.device}"))
    if measured.from_cache:
        console.print(Text(f"cache: {measured.cache_note} (no timing done)"))
    else:
        first = sum(measured.first_calls_s(b) for b in measured.timings)
        took = f"took {measured.check_s + measured.timing_s:.1f} s: oracle checks "
        took += f"{measured.check_s:.1f} s and first calls {first:.1f} s (compilation, paid once), "
        took += f"timing {max(measured.timing_s - first, 0.0):.1f} s; cache: {measured.cache_note}"
        console.print(Text(took))
    steps = Table(box=box.SIMPLE_HEAD, title="steps", title_justify="left")
    for column in ("phase", "step", "shape"):
        steps.add_column(column, no_wrap=column != "shape")
    for step in measured.steps:
        steps.add_row(step.phase.value, step.name, step.describe())
    console.print(steps)
    labels = [p.value for p in Phase if p.value in measured.choices] + [OVERALL]
    title = "summed time per phase"
    if measured.layers_per_step is not None:
        title += f" (each step's build counted over {measured.layers_per_step} layers)"
    times = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left")
    times.add_column("backend", no_wrap=True)
    for label in labels:
        times.add_column(label, justify="right", no_wrap=True)
    times.add_column("first calls", justify="right", no_wrap=True)
    choices = [measured.choices.get(label) for label in labels]
    for name in (n for n in measured.order if n not in measured.rejected):
        row = [
            Text(
                _us(c and c.totals_us.get(name)),
                style="bold green" if c and c.backend == name else "",
            )
            for c in choices
        ]
        times.add_row(name, *row, f"{measured.first_calls_s(name):.2f} s")
    console.print(times)
    for name, why in measured.rejected.items():
        console.print(Text(f"rejected {name}: {why}", style="red"))
    for label, choice in zip(labels, choices, strict=True):
        if choice is None:
            continue
        line = f"{label}: {choice.backend}"
        if len(choice.tied) > 1:
            line += f" (within the run's noise or 2%: {', '.join(choice.tied)}; static order)"
        console.print(Text(line))
    shared = "yes" if measured.kv_cache_shared else "no"
    console.print(
        Text(f"decode and prefill choices share one KV cache: {shared} ({measured.kv_cache_note})")
    )
    console.print(Text(f"engine: {measured.pair_note()}"))
