"""`anyattn explain`: which backend the selector picks for one layer configuration, and why
every other backend was not picked (capability judged for `--device`, availability for this
machine). With `--measure` it also times every backend that fits on this machine and shows
the fastest per phase (`anyattn.cli_measure`). Exit status 0: a backend was chosen; 1: nothing
fits, the requested backend is unknown or does not fit, or no backend could be measured; 2: bad
arguments.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, fields

from rich import box
from rich.table import Table
from rich.text import Text

from anyattn.cli_common import arg_type, backend_request, make_console, positive_int, print_error
from anyattn.cli_measure import add_measure_arguments, print_measurement, run_measure
from anyattn.config import AttentionSelectorConfig
from anyattn.measure import Measurement
from anyattn.selector import ENV_VAR, Explanation, NoBackendError, explain
from anyattn.types import AttentionType, DeviceInfo, parse_cache_dtype, parse_dtype

__all__ = ["add_explain_parser", "run_explain"]

# Help of the boolean fields of AttentionSelectorConfig, each exposed as `--field-name`.
_FLAG_HELP = {
    "use_mla": "multi-head latent attention (compressed KV cache)",
    "has_sink": "per-head attention sinks",
    "use_sparse": "sparse (top-k) attention",
    "has_sliding_window": "sliding-window attention",
    "has_alibi": "ALiBi position biases",
    "has_logits_soft_cap": "a soft cap on the attention logits",
    "use_non_causal": "bidirectional attention in a decoder layer",
    "use_per_head_quant_scales": "fp8 KV scales per KV head instead of per tensor",
    "use_batch_invariant": "results must not depend on how requests are batched",
    "needs_lse": "return each row's log-sum-exp (for merging partial results)",
}


def add_explain_parser(commands: argparse._SubParsersAction) -> None:
    """Add the `explain` command to the `anyattn` parser's subcommands."""
    ex = commands.add_parser(
        "explain",
        help="show which backend a layer gets and why the others were not chosen",
        description=(
            "Run the selector for one layer configuration and print its verdict on every "
            "backend. Capability reasons are judged for --device; availability (installed "
            "packages) for this machine. Exit status 0: a backend was chosen; 1: nothing fits, "
            "or the requested backend is unknown or does not fit; 2: bad arguments."
        ),
    )
    ex.add_argument("--head-size", type=positive_int, metavar="N", required=True,
                    help="size of each attention head")  # fmt: skip
    ex.add_argument("--dtype", metavar="DTYPE", default="bfloat16",
                    type=arg_type(lambda s: parse_dtype(s, argument="--dtype"), "--dtype"),
                    help="model dtype: float32, float16, bfloat16 (default: bfloat16)")  # fmt: skip
    ex.add_argument("--kv-cache-dtype", default="auto",
                    type=arg_type(lambda s: parse_cache_dtype(s, argument="--kv-cache-dtype"),
                                  "--kv-cache-dtype"),
                    help="KV-cache dtype: auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2 "
                    "(default: auto)")  # fmt: skip
    for flag, text in (
        ("--block-size", "engine KV block size (default: backend's choice)"),
        ("--num-heads", "query heads of the layer"),
        ("--num-kv-heads", "KV heads of the layer"),
    ):
        ex.add_argument(flag, type=positive_int, metavar="N", help=text)
    ex.add_argument("--attn-type", choices=[t.value for t in AttentionType],
                    default=AttentionType.DECODER.value,
                    help="what the queries attend to (default: decoder)")  # fmt: skip
    for name in AttentionSelectorConfig.flag_names():
        flag = f"--{name.replace('_', '-')}"
        ex.add_argument(flag, dest=name, action="store_true", help=_FLAG_HELP.get(name, name))
    limited = (
        "for backends whose prefill limits it; --measure times the layer with it (default 128)"
    )
    for flag, text in (
        ("--qk-rope-head-dim", "the rope part R of the latent row --head-size = L + R, which "
         "tells splits apart (576 = 512 + 64 or 448 + 128)"),
        ("--qk-nope-head-dim", "the no-rope part P of the up-projected query and key rows "
         f"(their size is P + R), {limited}"),
        ("--v-head-dim", f"the size Vd of the up-projected value rows, {limited}"),
    ):  # fmt: skip
        ex.add_argument(flag, type=positive_int, metavar="N", help=f"MLA (--use-mla): {text}")
    ex.add_argument("--backend", metavar="NAME", help="require this backend (error if it does "
                    f"not fit); else ${ENV_VAR} if set")  # fmt: skip
    ex.add_argument("--device", type=arg_type(DeviceInfo.parse, "device"),
                    help="cpu, cuda (this machine's GPU), or a capability: sm80, sm90, sm100 "
                    "(default: this machine)")  # fmt: skip
    ex.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_measure_arguments(ex)


def _config_summary(config: AttentionSelectorConfig) -> str:
    """The config's fields that differ from their defaults (head_size and dtype always)."""
    parts = []
    for f in fields(config):
        value = getattr(config, f.name)
        if f.default is MISSING or value != f.default:
            if f.name == "dtype":
                value = str(value).removeprefix("torch.")
            parts.append(f"{f.name}={value}")
    return " ".join(parts)


def run_explain(args: argparse.Namespace) -> int:
    """Run `anyattn explain`; returns the exit status."""
    try:
        config = AttentionSelectorConfig(
            **{f.name: getattr(args, f.name) for f in fields(AttentionSelectorConfig)}
        )
    except (TypeError, ValueError) as error:
        print_error("explain", f"invalid configuration: {error}")
        return 2
    try:
        backend_request(args.backend)  # an unknown name, told with where it came from
    except ValueError as error:
        print_error("explain", str(error))
        return 1
    try:
        result = explain(config, args.device, args.backend)
    # A plugin may fail in ways the selector does not catch (e.g. a RuntimeError raised while
    # importing); report it in one line instead of a traceback.
    except Exception as error:
        print_error("explain", f"backend selection failed ({type(error).__name__}: {error}).")
        return 1
    measured: Measurement | None = None
    if args.measure and result.chosen is not None:
        try:
            measured = run_measure(args, config)
        except (NoBackendError, TypeError, ValueError) as error:
            print_error("explain", f"--measure: {error}")
            return 1
    if args.json:
        data = result.to_dict()
        if measured is not None:
            data["measurement"] = measured.to_dict()
        print(json.dumps(data, indent=2))
    else:
        _print_explanation(result)
        if measured is not None:
            print_measurement(make_console(), measured)
    if measured is not None and measured.overall is None:
        print_error("explain", "--measure: no backend passed the oracle check and timing.")
        return 1
    if result.chosen is not None:
        return 0
    if result.requested is not None:
        print_error("explain", f"requested backend {result.requested} (from {_by(result)}) does "
                    f"not fit this config on {result.device}; see its reasons above.")  # fmt: skip
    else:
        print_error("explain", f"no backend fits this config on {result.device}; see the reasons "
                    "above.")  # fmt: skip
    return 1


def _by(result: Explanation) -> str:
    """Who requested the backend, as the command line names it."""
    return "--backend" if result.requested_by == "argument" else str(result.requested_by)


def _print_explanation(result: Explanation) -> None:
    console = make_console()
    console.print(Text(f"device: {result.device}"))
    console.print(Text(f"config: {_config_summary(result.config)}"))
    if result.requested is not None:
        console.print(Text(f"requested: {result.requested} (from {_by(result)})"))
    chosen = (result.chosen, "bold green") if result.chosen else ("none", "bold red")
    console.print(Text.assemble("chosen: ", chosen))
    table = Table(box=box.SIMPLE_HEAD, expand=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("backend", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    # Two-line headers leave the width to the reasons.
    table.add_column(f"capability\n(for {result.device})", overflow="fold")
    table.add_column("availability\n(this machine)", overflow="fold")
    for verdict in result.verdicts:
        capability = "\n".join(verdict.reasons) if verdict.reasons else "ok"
        if verdict.name == result.chosen:
            label = Text("chosen", style="bold green")
        elif verdict.fits and verdict.not_automatic:
            label = Text("on request", style="green")
            capability = f"ok; taken only on request ({verdict.not_automatic})"
        elif verdict.fits:
            label = Text("fits", style="green")
        elif verdict.reasons:
            label = Text("rejected", style="red")
        else:
            label = Text("unavailable", style="yellow")
        availability = Text(verdict.unavailable or "ok")
        table.add_row(str(verdict.priority), verdict.name, label, Text(capability), availability)
    console.print(table)
    if result.hints:
        console.print("hints:")
        # A grid keeps a wrapped hint indented under its own bullet.
        hints = Table.grid(padding=(0, 1))
        hints.add_column(no_wrap=True)
        hints.add_column(overflow="fold")
        for hint in result.hints:
            hints.add_row("  -", Text(hint))
        console.print(hints)
