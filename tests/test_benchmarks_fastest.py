"""`benchmarks/fastest.py` (with `fastest_pair.py` and `fastest_explain.py`) on the CPU, so that
the GPU run cannot rot: the limits each case is measured under put the case among its phase's
steps, the verdict rule, the per-phase pair contender against the float64 reference, and a whole
run (table, then `explain --measure` twice) with TORCH and a second CPU backend."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from anyattn.measure import measurement_steps

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """Import a benchmark module by name (they import their siblings)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCHMARKS))


def _phase_steps(bench, spec):
    fastest, kernels = bench("fastest"), bench("kernels")
    config = kernels.selector_config(kernels.Shape())
    steps = measurement_steps(config, fastest.case_limits(spec))
    return [s for s in steps if s.phase.value == spec.section]


@pytest.mark.parametrize("table", ["GPU_CASES", "CPU_CASES"])
def test_each_case_is_among_the_steps_of_its_phase(bench, table) -> None:
    cases = getattr(bench("fastest"), table)
    assert list(cases) == ["decode-64x4096", "decode-8x32768", "prefill-16x1024",
                           "prefill-4x4096", "mixed"]  # fmt: skip
    for spec in cases.values():
        steps = _phase_steps(bench, spec)
        if spec.section == "decode":
            # the same requests, each over the case's context and one key more
            same = [s for s in steps if s.query_lens == spec.query_lens]
            assert any(s.seq_lens == tuple(n + 1 for n in spec.seq_lens) for s in same), steps
        elif spec.section == "prefill":
            assert [(s.query_lens, s.seq_lens) for s in steps] == [(spec.query_lens, spec.seq_lens)]
        else:  # the case's decodes (one key more), its prefill tokens as one chunk
            decodes = [s for q, s in zip(spec.query_lens, spec.seq_lens, strict=True) if q == 1]
            (step,) = steps
            assert step.query_lens[:-1] == (1,) * len(decodes)
            assert step.seq_lens[:-1] == tuple(n + 1 for n in decodes)
            assert step.query_lens[-1] == spec.num_tokens - len(decodes)


def test_the_verdict_takes_three_percent_or_the_runs_spread(bench) -> None:
    verdict = bench("fastest").verdict
    assert verdict([103.0] * 5, [100.0] * 5) == (pytest.approx(1.03), "met")
    assert verdict([110.0] * 5, [100.0] * 5)[1] == "MISSED"
    # median 110, absolute deviation 10: the gap of 10 is within the spread
    assert verdict([100.0, 110.0, 120.0], [100.0] * 3)[1] == "met (within spread)"
    assert verdict([100.0, 112.0, 113.0], [100.0] * 3)[1] == "MISSED"  # deviation 1


@pytest.mark.parametrize("section", ["mixed", "decode", "prefill"])
def test_a_pair_runs_each_phase_on_its_backend_and_matches_the_reference(
    bench, cpu_backend_pair, section
) -> None:
    kernels, prepare_pair = bench("kernels"), bench("fastest_pair").prepare_pair
    shape = kernels.Shape(num_heads=4, num_kv_heads=2, head_size=16, block_size=4,
                          dtype=torch.float32)  # fmt: skip
    spec = {
        "mixed": kernels.mixed_case(5, 19, 2, 7, 9),  # prefills arrive among the decodes
        "decode": kernels.decode_case(3, 21),
        "prefill": kernels.prefill_case(2, 13),
    }[section]
    data = kernels.make_case_data(spec, shape, "cpu")
    ready = prepare_pair(*cpu_backend_pair, data)
    ready.run(1)  # the other input set first: each slot has its own output
    rows = ready.rows(ready.run(0))
    reference = kernels.make_reference(data)
    error, ok = kernels.compare(rows, reference, shape.dtype)
    assert ok, error
    decodes = sum(1 for n in spec.query_lens if n == 1)
    assert ready.path() == (f"TORCH ({decodes} decodes) + TORCH_TWIN ({spec.num_reqs - decodes})")


def test_a_cpu_run_compares_the_picks_and_reads_the_cache_the_second_time(
    bench, cpu_backend_pair, capsys, tmp_path
) -> None:
    path = tmp_path / "fastest.json"
    bench("fastest").main(
        ["--device", "cpu", "--quick", "--backends", ",".join(cpu_backend_pair), "--cases",
         "decode-64x4096,mixed", "--pair", ",".join(cpu_backend_pair), "--json", str(path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    results = json.loads(path.read_text())
    assert list(results["cases"]) == ["decode-64x4096", "mixed"]
    for case in results["cases"].values():
        assert case["pick"] in cpu_backend_pair and case["best"] in cpu_backend_pair
        assert case["verdict"][1] in ("met", "met (within spread)", "MISSED")
        assert {t["status"] for t in case["timed"].values()} == {"ok"}
        assert all(len(t["times_us"]) == 2 * 5 for t in case["timed"].values())
    assert "TORCH+TORCH_TWIN" in results["cases"]["mixed"]["timed"]
    first, second = results["explain"]
    assert first["exit_code"] == second["exit_code"] == 0
    assert first["timed_steps"] > 0 and first["oracle_checks"] == 2 and not first["from_cache"]
    assert second["timed_steps"] == second["oracle_checks"] == 0 and second["from_cache"]
    assert len(first["cache_files"]) == 1 and second["cache_files"] == first["cache_files"]
    assert "Second run: used the cache, no timing done." in out
    assert "(no timing done)" in out and "| decode 4 x 64 |" in out
    assert "Mixed case, per-phase pair TORCH (decodes) + TORCH_TWIN (prefills)" in out
