"""`benchmarks/engine_gpu.py` and `benchmarks/engine_host.py` on the CPU with a micro model, so
that the GPU benchmarks cannot rot between GPU runs: the fp32 check passes, every contender
gives a row per batch, host-time rows come from pure decode steps; "fastest" and a per-phase
pair (TORCH with a second CPU backend) on the batch and mixed workloads, their comparison with
the best single backend, the mixed workload's draw and step kinds, the plot."""

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


def test_engine_gpu_times_fastest_pairs_and_the_mixed_workload(bench, cpu_backend_pair, tmp_path):
    pair = ",".join(cpu_backend_pair)
    bench("engine_gpu").main(
        ["--device", "cpu", "--model", "micro", "--backends", "TORCH", "--fastest", "--pairs",
         pair, "--workloads", "batch", "mixed", "--modes", "eager", "--contenders", "anyattn",
         "--no-check", "--batches", "2", "--new-tokens", "3", "--prompt-len", "5", "9",
         "--mixed-requests", "6", "--mixed-max-seqs", "3", "--mixed-batched-tokens", "16",
         "--mixed-prompt-len", "8", "24", "--mixed-new-tokens", "2", "6", "--repeats", "2",
         "--out", str(tmp_path)]
    )  # fmt: skip
    results = json.loads((tmp_path / "engine_gpu.json").read_text())
    assert not results["errors"]
    names = ["anyattn TORCH eager", "anyattn fastest eager", "anyattn TORCH+TORCH_TWIN eager"]
    got = {(r["workload"], r["contender"], r["batch"]) for r in results["rows"]}
    assert got == {("batch", n, 2) for n in names} | {("mixed", n, 6) for n in names}
    for row in results["rows"]:
        assert len(row["all_seconds"]) == 2 and row["seconds"] == min(row["all_seconds"])
        if row["backend"] == pair:
            assert row["runs"] == "TORCH (decode) + TORCH_TWIN (prefill)"
    workload = bench("engine_mixed").MixedWorkload(6, 3, 16, (8, 24), (2, 6))  # as asked above
    _, new_tokens = bench("engine_mixed").mixed_requests(workload, vocab=256)
    for row in (r for r in results["rows"] if r["workload"] == "mixed"):
        assert row["output_tokens"] == sum(new_tokens)
        assert row["steps"]["mixed"] > 0 and row["steps"]["decode"] > 0, row["steps"]
    compared = {(c["workload"], c["batch"], c["contender"]) for c in results["comparison"]}
    assert compared == {(w, b, n) for w, b in (("batch", 2), ("mixed", 6)) for n in names[1:]}
    fastest = results["contenders"]["batch anyattn fastest eager"]
    assert fastest["setup_s"] > 0 and "(and layers like it)" in fastest["notes"][0]
    (measured,) = fastest["measurements"]  # one layer config, measured once
    assert measured["choices"]["overall"] in cpu_backend_pair and not measured["from_cache"]
    assert set(measured["totals_us"]["decode"]) == set(cpu_backend_pair)
    assert measured["engine"] in fastest["notes"][0]
    assert {"date", "command", "versions", "mixed_workload"} <= set(results)


def test_engine_report_compares_fastest_and_pairs_with_the_best_single_backend(bench):
    comparison = bench("engine_report").comparison

    def row(backend, seconds, all_seconds=None, workload="mixed"):
        return {"contender": f"anyattn {backend} graphs", "backend": backend, "batch": 8,
                "mode": "graphs", "workload": workload, "seconds": seconds,
                "tokens_per_s": 800 / seconds, "all_seconds": all_seconds or [seconds]}  # fmt: skip

    rows = [
        row("TRITON", 1.0), row("FLASHINFER", 1.1), row("fastest", 1.03),
        row("TRITON,FLASHINFER", 0.9), row("FLASHINFER,TRITON", 1.2, [1.2, 1.5]),
        row("fastest", 1.2, workload="batch"),  # no single backend timed there: not compared
        {"contender": "transformers generate", "batch": 8, "seconds": 0.5, "tokens_per_s": 1},
    ]  # fmt: skip
    by_backend = {c["contender"].split()[1]: c for c in comparison(rows)}
    assert set(by_backend) == {"fastest", "TRITON,FLASHINFER", "FLASHINFER,TRITON"}
    assert by_backend["fastest"]["verdict"] == "met"
    assert by_backend["fastest"]["best_single"] == "anyattn TRITON graphs"
    assert by_backend["TRITON,FLASHINFER"]["beats_every_single"]
    assert by_backend["TRITON,FLASHINFER"]["time_ratio"] == pytest.approx(0.9)
    # 0.2 s slower, spreads 0.15 (its repeats) + 0 (TRITON's): missed
    assert by_backend["FLASHINFER,TRITON"]["verdict"] == "MISSED"
    assert not by_backend["FLASHINFER,TRITON"]["beats_every_single"]


def test_the_mixed_workload_is_drawn_once_and_steps_are_told_apart(bench):
    mixed = bench("engine_mixed")
    workload = mixed.MixedWorkload(10, 4, 64, (20, 40), (3, 7))
    prompts, new_tokens = mixed.mixed_requests(workload, vocab=100)
    assert (prompts, new_tokens) == mixed.mixed_requests(workload, vocab=100)
    assert len(prompts) == 10 and all(20 <= len(p) <= 40 for p in prompts)
    assert all(3 <= n <= 7 for n in new_tokens) and workload.max_model_len == 40 + 7 + 16
    assert all(2 <= t < 100 for p in prompts for t in p)
    steps = mixed.StepMix()
    for batch in ([1, 1], [1, 5], [9], [1], [3, 1, 1]):
        steps.add(batch)
    assert (steps.decode, steps.mixed, steps.prefill) == (2, 2, 1)


def test_engine_gpu_plots_both_workloads(bench, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        {"contender": "anyattn TORCH eager", "backend": "TORCH", "batch": b, "mode": "eager",
         "workload": "batch", "seconds": 1.0, "tokens_per_s": 10.0 * b} for b in (1, 2)
    ] + [
        {"contender": "anyattn fastest eager", "backend": "fastest", "batch": 6, "mode": "eager",
         "workload": "mixed", "seconds": 1.0, "tokens_per_s": 30.0, "runs": "TORCH",
         "steps": {"decode": 1, "mixed": 2, "prefill": 3}}
    ]  # fmt: skip
    results = {"model": "micro", "dtype": "float32", "device_name": "CPU", "rows": rows,
               "date": "today", "versions": {"torch": "x"}, "command": "python3 ..."}  # fmt: skip
    assert bench("engine_report").plot(results, tmp_path / "engine_gpu.png")
    assert (tmp_path / "engine_gpu.png").stat().st_size > 0
