"""`benchmarks/mla_decode.py` and `benchmarks/mla_decode_tune.py` on the CPU (`--device cpu
--quick`, Triton interpreted), so that the GPU benchmarks cannot rot between GPU runs: every
case runs, and every contender or tile variant passes its float64 check on a slice before it
is timed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_quick_cpu_run_checks_and_times_every_contender() -> None:
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "benchmarks" / "mla_decode.py"),
         "--device", "cpu", "--quick"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows[1:]]  # past the header
    cases = {row[0] for row in rows}
    assert cases == {
        "decode 3 x 40, H=4, block 16",
        "decode 2 x 70, H=4, block 16",
        "prefill 2 x 24, H=4, block 16",
    }
    for case in cases:
        timed = {row[1] for row in rows if row[0] == case and float(row[2]) > 0}
        assert timed == {"TRITON_MLA", "TORCH_MLA"}, (case, result.stdout)
    assert "copy rate" in result.stdout and "TFLOP/s" in result.stdout


def test_tune_quick_cpu_run_checks_and_times_every_variant() -> None:
    """`benchmarks/mla_decode_tune.py --device cpu --quick`: every tile variant passes its
    float64 checks (ragged contexts, the timed shape) and is timed, a best configuration is
    named and profiled."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-W", "ignore", str(ROOT / "benchmarks" / "mla_decode_tune.py"),
         "--device", "cpu", "--quick"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows[1:]]  # past the header
    names = [row[0] for row in rows]
    assert names[0].startswith("default: ") and len(names) == 4, result.stdout
    assert {"block", "tma", "latent/2"} <= {word for n in names for word in n.split(", ")}
    for row in rows:
        assert float(row[2]) > 0, (row, result.stdout)  # checked, then timed
    assert "4 splits: every tiles ok" in result.stdout  # the ragged check
    assert "\nbest: " in result.stdout and "\nProfile: decode " in result.stdout
