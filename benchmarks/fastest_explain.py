"""`anyattn explain --measure` twice over one fresh cache folder, for `benchmarks/fastest.py`:
the first run checks and times every candidate, the second must read the cache and time nothing.

The command runs through its entry point (`anyattn.cli.main`, what the `anyattn` script calls)
in this process, its stdout captured. For the two runs the measurement's calls into the timing
(`time_prepared`) and the oracle check (`check_against_oracle`) are counted, wrapped where
`anyattn.measure.run` calls them, and the `Measurement` each run printed is kept.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import kernels
import torch
from _timing import markdown_table

import anyattn.cli_explain as cli_explain
import anyattn.measure.run as measure_run
from anyattn import cli
from anyattn.measure import CACHE_DIR_ENV, NO_CACHE_ENV

__all__ = ["ExplainRun", "explain_argv", "explain_report", "explain_twice"]

# explain's limits (the engine's defaults) on a GPU; on the CPU, small ones (seconds).
GPU_LIMITS = ("16", "1024", "4096")
CPU_LIMITS = ("4", "64", "256")


@dataclass
class ExplainRun:
    """One `anyattn explain --measure` run: exit code, wall seconds, timed steps and oracle
    checks counted, what its measurement says (cache use, oracle-check and timing seconds,
    first-call seconds per backend), the cache folder's files after it, and its printed output."""

    argv: list[str]
    exit_code: int
    wall_s: float
    timed_steps: int
    oracle_checks: int
    from_cache: bool = False
    check_s: float = 0.0
    timing_s: float = 0.0
    first_calls_s: dict[str, float] = field(default_factory=dict)
    cache_note: str = ""
    cache_files: list[str] = field(default_factory=list)
    output: str = ""


def explain_argv(shape: kernels.Shape, device: torch.device) -> list[str]:
    """The command for the table's layer, with explicit engine limits."""
    reqs, tokens, model_len = GPU_LIMITS if device.type == "cuda" else CPU_LIMITS
    return [
        "explain",
        "--measure",
        "--device",
        device.type,
        "--head-size",
        str(shape.head_size),
        "--dtype",
        str(shape.dtype).removeprefix("torch."),
        "--block-size",
        str(shape.block_size),
        "--num-heads",
        str(shape.num_heads),
        "--num-kv-heads",
        str(shape.num_kv_heads),
        "--max-num-seqs",
        reqs,
        "--max-num-batched-tokens",
        tokens,
        "--max-model-len",
        model_len,
    ]


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _spied(counts: dict[str, int], measured: list) -> Iterator[None]:
    """Count calls of the measurement's timing and oracle check; keep explain's measurements."""

    def counted(name: str, function):
        def call(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return call

    def kept(*args, **kwargs):
        measured.append(run_measure(*args, **kwargs))
        return measured[-1]

    time_prepared, check = measure_run.time_prepared, measure_run.check_against_oracle
    run_measure = cli_explain.run_measure
    measure_run.time_prepared = counted("time_prepared", time_prepared)
    measure_run.check_against_oracle = counted("check_against_oracle", check)
    cli_explain.run_measure = kept
    try:
        yield
    finally:
        measure_run.time_prepared, measure_run.check_against_oracle = time_prepared, check
        cli_explain.run_measure = run_measure


def _run_once(argv: list[str], folder: Path) -> ExplainRun:
    counts = {"time_prepared": 0, "check_against_oracle": 0}
    measured: list = []
    output = io.StringIO()
    start = time.perf_counter()
    with _spied(counts, measured), contextlib.redirect_stdout(output):
        code = cli.main(argv)
    wall = time.perf_counter() - start
    run = ExplainRun(argv, code, wall, counts["time_prepared"], counts["check_against_oracle"])
    run.output = output.getvalue()
    run.cache_files = sorted(p.name for p in folder.rglob("*.json"))
    if measured:
        m = measured[-1]
        run.from_cache, run.timing_s, run.cache_note = m.from_cache, m.timing_s, m.cache_note
        run.check_s = m.check_s
        run.first_calls_s = {b: m.first_calls_s(b) for b in m.timings}
    return run


def explain_twice(shape: kernels.Shape, device: torch.device) -> list[ExplainRun]:
    """Run `anyattn explain --measure` twice with `ANYATTN_CACHE_DIR` a fresh folder (and
    `ANYATTN_NO_MEASURE_CACHE` unset); progress goes to stderr."""
    argv = explain_argv(shape, device)
    runs = []
    with tempfile.TemporaryDirectory(prefix="anyattn_measure_") as folder:
        # A wide console: explain's tables are for people and wrap at 80 columns otherwise.
        with _environment(**{CACHE_DIR_ENV: folder, NO_CACHE_ENV: None, "COLUMNS": "140"}):
            for attempt in (1, 2):
                print(f"[explain] run {attempt}: anyattn {' '.join(argv)}", file=sys.stderr)
                runs.append(_run_once(argv, Path(folder)))
    return runs


def _measurement_part(output: str) -> str:
    """explain's output from its measurement on (the selection table before it is long)."""
    at = output.find("measured on:")
    return output if at < 0 else output[at:]


def explain_report(runs: Sequence[ExplainRun]) -> str:
    """What each run did, whether the second one used the cache, and both outputs."""
    rows = [
        [
            i,
            r.exit_code,
            f"{r.wall_s:.1f}",
            r.timed_steps,
            r.oracle_checks,
            "yes" if r.from_cache else "no",
            f"{r.check_s:.1f}",
            f"{r.timing_s:.1f}",
            ", ".join(f"{b} {s:.1f}" for b, s in r.first_calls_s.items()) or "-",
            r.cache_note,
        ]
        for i, r in enumerate(runs, 1)
    ]
    headers = [
        "run",
        "exit",
        "wall s",
        "steps timed",
        "oracle checks",
        "from cache",
        "checks s",
        "timing s",
        "first calls s",
        "cache",
    ]
    text = [
        f"Command: `anyattn {' '.join(runs[0].argv)}` (ANYATTN_CACHE_DIR: a fresh folder).",
        markdown_table(headers, rows),
    ]
    if len(runs) == 2:
        second = runs[1]
        used = (
            second.from_cache
            and second.timed_steps == 0
            and second.oracle_checks == 0
            and "(no timing done)" in second.output
        )
        said = "used the cache, no timing done" if used else "did NOT use the cache"
        text.append(f"Second run: {said}.")
    for i, r in enumerate(runs, 1):
        shown = r.output if i == 1 else _measurement_part(r.output)
        text.append(f"Run {i} output:\n\n```\n{shown.rstrip()}\n```")
    return "\n\n".join(text)
