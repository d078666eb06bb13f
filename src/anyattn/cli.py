"""Command line: `anyattn backends | explain | env | generate`.

`backends` lists what every registered backend declares, `explain` shows which backend the
selector picks for a layer configuration and why every other one was not picked, `env` reports
the versions and devices that selection depends on, `generate` (in `anyattn.engine.cli`) runs a
model through the engine. Tables are for people; `--json` prints plain JSON for programs. Exit
status: 0 success (for `explain`: a backend was chosen), 1 nothing fits or the requested backend
is unknown or does not fit, 2 a usage error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import MISSING, fields

from rich import box
from rich.table import Table
from rich.text import Text

import anyattn
from anyattn.cli_common import (
    ArgumentParser,
    arg_type,
    backend_request,
    make_console,
    positive_int,
    print_error,
)
from anyattn.config import AttentionSelectorConfig
from anyattn.registry import ENTRY_POINT_GROUP, backend_names, get_backend_class
from anyattn.selector import ENV_VAR, Explanation, explain
from anyattn.types import AttentionType, DeviceInfo, parse_cache_dtype, parse_dtype

__all__ = ["main"]

# Packages whose versions decide which backends can run; each with the distribution names it
# is published under (the first one installed is reported).
_PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "flash-attn": ("flash-attn", "flash-attn-4"),
}

# The boolean fields of AttentionSelectorConfig, each exposed as `--field-name` (store_true).
# (Field types are strings under `from __future__ import annotations`, classes otherwise.)
_FLAG_FIELDS = tuple(f.name for f in fields(AttentionSelectorConfig) if f.type in ("bool", bool))
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


def _build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="anyattn",
        description="Attention backends for LLM inference: what exists, what is chosen, why.",
    )
    parser.add_argument("--version", action="version", version=f"anyattn {anyattn.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    backends = commands.add_parser(
        "backends", help="list every registered backend and what it declares"
    )
    backends.add_argument("--json", action="store_true", help="print JSON instead of tables")

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
    ex.add_argument(
        "--head-size",
        type=positive_int,
        metavar="N",
        required=True,
        help="size of each attention head",
    )
    ex.add_argument(
        "--dtype",
        type=arg_type(lambda s: parse_dtype(s, argument="--dtype"), "--dtype"),
        metavar="DTYPE",
        default="bfloat16",
        help="model dtype: float32, float16, bfloat16 (default: bfloat16)",
    )
    ex.add_argument(
        "--kv-cache-dtype",
        type=arg_type(
            lambda s: parse_cache_dtype(s, argument="--kv-cache-dtype"), "--kv-cache-dtype"
        ),
        default="auto",
        help="KV-cache dtype: auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2 (default: auto)",
    )
    ex.add_argument(
        "--block-size",
        type=positive_int,
        metavar="N",
        help="engine KV block size (default: backend's choice)",
    )
    ex.add_argument("--num-heads", type=positive_int, metavar="N", help="query heads of the layer")
    ex.add_argument("--num-kv-heads", type=positive_int, metavar="N", help="KV heads of the layer")
    ex.add_argument(
        "--attn-type",
        choices=[t.value for t in AttentionType],
        default=AttentionType.DECODER.value,
        help="what the queries attend to (default: decoder)",
    )
    for name in _FLAG_FIELDS:
        ex.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            action="store_true",
            help=_FLAG_HELP.get(name, name),
        )
    ex.add_argument(
        "--backend",
        metavar="NAME",
        help=f"require this backend (error if it does not fit); else ${ENV_VAR} if set",
    )
    ex.add_argument(
        "--device",
        type=arg_type(DeviceInfo.parse, "device"),
        help="cpu, cuda (this machine's GPU), or a capability: sm80, sm90, sm100 "
        "(default: this machine)",
    )
    ex.add_argument("--json", action="store_true", help="print JSON instead of tables")

    env = commands.add_parser("env", help="versions and devices that selection depends on")
    env.add_argument("--json", action="store_true", help="print JSON instead of tables")

    from anyattn.engine.cli import add_generate_parser

    add_generate_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `anyattn` command line.

    Args:
        argv: the arguments after the program name; None reads `sys.argv[1:]`.

    Returns:
        The exit status: 0 success, 1 nothing fits / bad backend request, 2 usage error.
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version and usage errors
        return stop.code if isinstance(stop.code, int) else 0
    if args.command == "backends":
        return _cmd_backends(args)
    if args.command == "explain":
        return _cmd_explain(args)
    if args.command == "generate":
        return _cmd_generate(args)
    return _cmd_env(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from anyattn.engine.cli import UsageError, run_generate

    try:
        return run_generate(args)
    except UsageError as error:
        # A value only the model can judge (a prompt longer than its context): still a usage
        # error, found before the model loads.
        print_error("generate", str(error))
        return 2
    except (FileNotFoundError, ValueError, TypeError, NotImplementedError) as error:
        # User mistakes the arguments cannot show (a missing default model, an unknown backend
        # name, a backend that does not fit) get one line.
        print_error("generate", str(error))
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\nanyattn generate: interrupted\n")
        return 130


# --- backends ------------------------------------------------------------------------------


def _backend_records() -> list[dict[str, object]]:
    """`describe()` of every registered backend; a backend that fails to load gets `error`."""
    records: list[dict[str, object]] = []
    for name in backend_names():
        try:
            record = get_backend_class(name).describe()
        # A broken plugin may raise anything while importing; list it instead of crashing.
        except Exception as error:
            records.append({"name": name, "error": f"{type(error).__name__}: {error}"})
            continue
        record["error"] = None
        records.append(record)
    return records


def _join(values: object) -> str:
    if isinstance(values, list | tuple):
        return ", ".join(str(v) for v in values) if values else "none"
    return str(values)


def _cmd_backends(args: argparse.Namespace) -> int:
    records = _backend_records()
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    console = make_console()
    if not records:
        console.print(f"No backends registered (entry-point group '{ENTRY_POINT_GROUP}').")
        return 0
    for record in records:
        table = Table(
            box=box.SIMPLE, show_header=False, title_justify="left", title=str(record["name"])
        )
        table.add_column("field", style="bold", no_wrap=True)
        table.add_column("value", overflow="fold")
        if record["error"] is not None:
            table.add_row("status", Text(f"cannot be loaded: {record['error']}", style="red"))
            console.print(table)
            continue
        if record["available"]:
            status = Text("available", style="green")
        else:
            status = Text(f"not available: {record['unavailable_reason']}", style="yellow")
        features = record["features"]
        assert isinstance(features, dict)
        capability = record["min_compute_capability"]
        rows = (
            ("status", status),
            ("class", str(record["class"])),
            ("devices", _join(record["devices"])
             + (f" (cuda: {capability} or newer)" if capability else "")),
            ("dtypes", _join(record["dtypes"])),
            ("kv cache dtypes", _join(record["kv_cache_dtypes"])),
            ("head sizes", _join(record["head_sizes"])),
            ("block sizes", _join(record["block_sizes"])),
            ("kv cache layouts", _join(record["kv_cache_layouts"])),
            ("attn types", _join(record["attn_types"])),
            ("features", _join([name for name, on in features.items() if on])),
            ("cuda graphs", str(record["cudagraph_support"])),
        )  # fmt: skip
        for field, value in rows:
            table.add_row(field, value if isinstance(value, Text) else Text(value))
        console.print(table)
    return 0


# --- explain -------------------------------------------------------------------------------


def _config_from_args(args: argparse.Namespace) -> AttentionSelectorConfig:
    values = {f.name: getattr(args, f.name) for f in fields(AttentionSelectorConfig)}
    return AttentionSelectorConfig(**values)


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


def _cmd_explain(args: argparse.Namespace) -> int:
    try:
        config = _config_from_args(args)
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
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        _print_explanation(result)
    if result.chosen is not None:
        return 0
    if result.requested is not None:
        by = "--backend" if result.requested_by == "argument" else result.requested_by
        print_error(
            "explain",
            f"requested backend {result.requested} (from {by}) does not fit this config on "
            f"{result.device}; see its reasons above.",
        )
    else:
        print_error(
            "explain", f"no backend fits this config on {result.device}; see the reasons above."
        )
    return 1


def _print_explanation(result: Explanation) -> None:
    console = make_console()
    console.print(Text(f"device: {result.device}"))
    console.print(Text(f"config: {_config_summary(result.config)}"))
    if result.requested is not None:
        by = "--backend" if result.requested_by == "argument" else result.requested_by
        console.print(Text(f"requested: {result.requested} (from {by})"))
    if result.chosen is not None:
        chosen = Text.assemble("chosen: ", (result.chosen, "bold green"))
    else:
        chosen = Text.assemble("chosen: ", ("none", "bold red"))
    console.print(chosen)
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
        table.add_row(
            str(verdict.priority),
            verdict.name,
            label,
            Text(capability),
            Text(verdict.unavailable if verdict.unavailable else "ok"),
        )
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


# --- env -----------------------------------------------------------------------------------


def _package_version(dist_names: Sequence[str]) -> str:
    for dist in dist_names:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if dist == dist_names[0] else f"{version} ({dist})"
    return "not installed"


def _environment() -> dict[str, object]:
    """Versions and devices, without importing optional packages (metadata only)."""
    import torch  # already imported by anyattn; needed for the device list

    versions = {"python": platform.python_version()}
    for name, dists in _PACKAGES.items():
        versions[name] = _package_version(dists)
    # torch may be on PYTHONPATH without metadata (the GPU machine); the module knows its version.
    if versions["torch"] == "not installed":
        versions["torch"] = torch.__version__
    devices: list[dict[str, object]] = [
        {"type": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            devices.append(
                {
                    "type": "cuda",
                    "index": index,
                    "name": torch.cuda.get_device_name(index),
                    "capability": f"sm{major}{minor}",
                }
            )
    return {
        "anyattn": anyattn.__version__,
        "versions": versions,
        "torch_cuda": torch.version.cuda,
        "platform": platform.platform(),
        "devices": devices,
    }


def _cmd_env(args: argparse.Namespace) -> int:
    info = _environment()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    console = make_console()
    table = Table(box=box.SIMPLE, show_header=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_row("anyattn", Text(str(info["anyattn"])))
    versions = info["versions"]
    assert isinstance(versions, dict)
    for name, version in versions.items():
        table.add_row(name, Text(str(version)))
    table.add_row("torch cuda", Text(str(info["torch_cuda"] or "none (CPU build)")))
    table.add_row("platform", Text(str(info["platform"])))
    devices = info["devices"]
    assert isinstance(devices, list)
    for device in devices:
        if device["type"] == "cpu":
            table.add_row("device", Text(f"cpu: {device['name']} ({device['cores']} cores)"))
        else:
            text = f"cuda:{device['index']}: {device['name']} ({device['capability']})"
            table.add_row("device", Text(text))
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
