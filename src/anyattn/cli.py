"""Command line: `anyattn backends | explain | env | generate`.

`backends` lists what every registered backend declares, `explain` (`anyattn.cli_explain`)
shows which backend the selector picks and why, `env` reports the versions and devices that
selection depends on, `generate` (`anyattn.engine.cli`) runs a model through the engine.
Tables are for people; `--json` prints plain JSON for programs. Exit status: 0 success (for
`explain`: a backend was chosen), 1 nothing fits or the requested backend is unknown or does
not fit, 2 a usage error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Sequence

from rich import box
from rich.table import Table
from rich.text import Text

import anyattn
from anyattn.cli_common import ArgumentParser, make_console, print_error
from anyattn.cli_explain import add_explain_parser, run_explain
from anyattn.registry import ENTRY_POINT_GROUP, backend_names, get_backend_class

__all__ = ["main"]

# Packages whose versions decide which backends can run; each with the distribution names it
# is published under (the first one installed is reported).
_PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "flash-attn": ("flash-attn", "flash-attn-4"),
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

    add_explain_parser(commands)

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
        return run_explain(args)
    if args.command == "generate":
        return _cmd_generate(args)
    return _cmd_env(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from anyattn.engine.cli import UsageError, run_generate

    try:
        return run_generate(args)
    except UsageError as error:  # one only the model can judge (a prompt past its context)
        print_error("generate", str(error))
        return 2
    except (FileNotFoundError, ValueError, TypeError, NotImplementedError) as error:
        # mistakes the arguments cannot show (a missing model, a backend that does not fit)
        print_error("generate", str(error))
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\nanyattn generate: interrupted\n")
        return 130


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


def _field_table(**options: object) -> Table:
    """A two-column table of fields and their values."""
    table = Table(box=box.SIMPLE, show_header=False, **options)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    return table


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
        table = _field_table(title_justify="left", title=str(record["name"]))
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
        # The latent splits L+R an MLA backend takes, in the text its reasons use.
        splits = record["mla_splits"]
        if splits is not None and splits != "any":
            splits = f"{splits} (kv_lora_rank+qk_rope_head_dim)"
        rows = [
            ("status", status),
            ("class", str(record["class"])),
            ("devices", _join(record["devices"])
             + (f" (cuda: {capability} or newer)" if capability else "")),
            ("dtypes", _join(record["dtypes"])),
            ("kv cache dtypes", _join(record["kv_cache_dtypes"])),
            ("head sizes", _join(record["head_sizes"])),
            *([("mla splits", str(splits))] if splits is not None else []),
            ("block sizes", _join(record["block_sizes"])),
            ("kv cache layouts", _join(record["kv_cache_layouts"])),
            ("attn types", _join(record["attn_types"])),
            ("features", _join([name for name, on in features.items() if on])),
            ("cuda graphs", str(record["cudagraph_support"])),
        ]  # fmt: skip
        for field, value in rows:
            table.add_row(field, value if isinstance(value, Text) else Text(value))
        console.print(table)
    return 0


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
    versions.update((name, _package_version(dists)) for name, dists in _PACKAGES.items())
    # torch may be on PYTHONPATH without metadata (the GPU machine); the module knows its version.
    if versions["torch"] == "not installed":
        versions["torch"] = torch.__version__
    devices: list[dict[str, object]] = [
        {"type": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            name = torch.cuda.get_device_name(index)
            devices.append({"type": "cuda", "index": index, "name": name,
                            "capability": f"sm{major}{minor}"})  # fmt: skip
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
    table = _field_table()
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
