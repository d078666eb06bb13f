"""`benchmarks/gather_kv_rows.py` on the CPU (a tiny float32 case, the op's PyTorch path), so
that the GPU measurement of the key copy cannot rot between GPU runs: it checks the op against
its PyTorch path before timing and prints one row for the floor and one for the op."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_copy_is_checked_and_timed_against_its_floor_on_the_cpu(capsys) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        bench = importlib.import_module("gather_kv_rows")
        assert bench.main(["--device", "cpu", "--reps", "2", "--block-size", "8"]) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = capsys.readouterr().out
    assert "### gather_kv_rows, tiny (cpu, 8-token blocks)" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows[1:]] == [
        "contiguous copy (floor)",
        "gather_kv_rows (torch)",
    ]
    assert rows[1].endswith("| 1.00 |")  # the floor against itself
