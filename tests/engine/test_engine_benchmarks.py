"""`benchmarks/engine_gpu.py` and `benchmarks/engine_host.py` on the CPU with a micro model, so
that the GPU benchmarks cannot rot between GPU runs: the fp32 check passes, every contender
gives a row per batch, host-time rows come from pure decode steps."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """Import a benchmark module by name (they import their sibling `engine_model`)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.slow
def test_engine_gpu_runs_on_the_cpu_checks_and_times_every_contender(bench, tmp_path):
    bench("engine_gpu").main(
        ["--device", "cpu", "--model", "micro", "--backends", "TORCH", "--modes", "eager",
         "--batches", "1", "2", "--new-tokens", "3", "--prompt-len", "5", "9",
         "--check-reqs", "2", "--check-new-tokens", "4", "--out", str(tmp_path)]
    )  # fmt: skip
    results = json.loads((tmp_path / "engine_gpu.json").read_text())
    assert [c["passed"] for c in results["checks"]] == [True]
    assert not results["errors"]
    got = {(r["contender"], r["batch"]) for r in results["rows"]}
    contenders = ["anyattn TORCH eager", "transformers generate", "transformers generate_batch"]
    assert got == {(c, b) for c in contenders for b in (1, 2)}
    assert all(r["tokens_per_s"] > 0 for r in results["rows"])


@pytest.mark.slow
def test_engine_host_times_pure_decode_steps(bench):
    rows = bench("engine_host").main(
        ["--device", "cpu", "--model", "micro", "--batches", "1", "3", "--warmup", "1",
         "--steps", "2", "--prompt-len", "4", "20"]
    )  # fmt: skip
    assert [r["num_reqs"] for r in rows] == [1, 3]
    for row in rows:
        assert 0 < row["schedule"] < row["launch"] <= row["step"]
        assert 0 < row["prepare"] < row["launch"]
