"""`benchmarks/flex_breakdown.py` on the CPU (a tiny float32 layer), so that the GPU diagnosis
of FLEX_ATTENTION's wrapper cost cannot rot between GPU runs: every part runs, the attention
calls it times alone give the forward's output and the forward agrees with FlexAttention called
directly (the script checks both before timing), and the table names each part."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_part_runs_and_agrees_on_the_cpu(capsys) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        breakdown = importlib.import_module("flex_breakdown")
        args = ["--device", "cpu", "--cases", "decode", "--reps", "2", "--block-size", "32"]
        assert breakdown.main(args) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = capsys.readouterr().out
    assert "### FLEX_ATTENTION forward, decode 3 x 40 (cpu, 32-token blocks)" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows[1:]] == [
        "forward (whole)",
        "K/V copy out of the paged cache",
        "attention calls with their query and output copies (decode layout: 3 requests)",
        "the compiled kernels alone (queries already in their layout)",
        "FlexAttention directly (kernels.prepare_flex)",
    ]
    assert rows[1].endswith("| 1.00 |")  # the forward's share of itself
    assert all(float(row.split(" | ")[1]) > 0 for row in rows[1:])
