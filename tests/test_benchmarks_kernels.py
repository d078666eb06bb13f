"""`benchmarks/kernels.py` on the CPU, so that the GPU benchmark cannot rot between GPU runs:
the cases and their byte/FLOP counts, FlashInfer's page indices, the batch and metadata set-up,
the float64 reference (against the kit's oracle), and whole cases driven through the anyattn
contract with TORCH (and SDPA's math backend), with every other contender skipping cleanly."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from anyattn.backends.torch_attn import TorchAttentionBackend
from anyattn.testing import attention_oracle
from anyattn.types import MultipleOf

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def kernels():
    """The benchmark module (it imports its sibling `_timing`, so its folder goes on the path)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("kernels")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def tiny(kernels):
    """A small layer in float32 (exact enough on the CPU to check against float64)."""
    return kernels.Shape(
        num_heads=4, num_kv_heads=2, head_size=16, block_size=4, dtype=torch.float32
    )


def test_cases_are_the_issue_shapes(kernels) -> None:
    labels = {s: [c.label for c in cases] for s, cases in kernels.CASES.items()}
    assert labels["decode"] == ["64 x 4096", "256 x 2048", "8 x 32768"]
    assert labels["prefill"] == ["16 x 1024", "4 x 4096", "1 x 16384"]
    mixed = kernels.CASES["mixed"][0]
    prefills = [r for r, n in enumerate(mixed.query_lens) if n > 1]
    assert mixed.num_reqs == 50 and len(prefills) == 2
    assert [mixed.query_lens[r] for r in prefills] == [512, 512]
    assert [mixed.seq_lens[r] for r in prefills] == [2048, 2048]
    assert 0 < prefills[0] and prefills[-1] < mixed.num_reqs - 1  # arrive among the decodes
    assert all(mixed.seq_lens[r] == 4096 for r in range(50) if r not in prefills)
    all_cases = {c for cases in kernels.CASES.values() for c in cases}
    assert set(kernels.WRAPPER_CASES) <= all_cases


def test_byte_and_flop_counts(kernels) -> None:
    shape = kernels.Shape()
    assert kernels.kv_bytes(kernels.decode_case(64, 4096), shape) == 64 * 4096 * 2 * 8 * 128 * 2
    flops = kernels.causal_prefill_flops(16, 1024, shape)
    assert flops == 2 * 16 * 32 * 1024 * 1024 * 128
    assert kernels.case_flops(kernels.prefill_case(16, 1024), shape) == flops
    # attended pairs, counted by brute force: a query at position p sees p + 1 keys
    spec = kernels.CaseSpec("mixed", "x", (1, 3, 2), (5, 3, 7))
    pairs = sum(p + 1 for n, s in zip((1, 3, 2), (5, 3, 7), strict=True) for p in range(s - n, s))
    assert kernels.attended_flops(spec, shape) == 4 * 32 * 128 * pairs
    assert kernels.case_flops(spec, shape) == 4 * 32 * 128 * pairs


def test_flashinfer_page_indices(kernels) -> None:
    table = torch.tensor([[5, 9, 2], [7, 0, 0], [3, 4, 0]], dtype=torch.int32)
    indptr, indices, last = kernels.flashinfer_page_indices(table, [9, 4, 5], block_size=4)
    assert indptr.tolist() == [0, 3, 4, 6]
    assert indices.tolist() == [5, 9, 2, 7, 3, 4]
    assert last.tolist() == [1, 4, 1]
    assert {indptr.dtype, indices.dtype, last.dtype} == {torch.int32}


def test_request_order_and_row_mapping(kernels) -> None:
    query_lens = [1, 5, 1, 3, 1]
    assert kernels.request_order(query_lens, None) == [0, 1, 2, 3, 4]
    order = kernels.request_order(query_lens, 1)
    assert order == [0, 4, 2, 3, 1]  # one swap: the first prefill with the last decode
    index = kernels.gather_index(query_lens, order)
    starts = [0, 1, 6, 7, 10]
    expected = [i for r in order for i in range(starts[r], starts[r] + query_lens[r])]
    assert index.tolist() == expected


def test_case_data_is_a_shuffled_paged_batch(kernels, tiny) -> None:
    spec = kernels.mixed_case(5, 19, 2, 7, 9)
    data = kernels.make_case_data(spec, tiny, "cpu", num_slots=3)
    used = data.block_table[data.block_table != 0]
    assert used.unique().numel() == used.numel()  # no block shared, block 0 never used
    assert data.num_blocks > used.numel() + 1  # a pool larger than needed
    assert bool((data.cache != 0).all())  # random, never zeros
    assert len(data.queries) == 3 and not torch.equal(data.queries[0], data.queries[1])
    # key/value are the step's own tokens, as stored in the cache
    r = spec.query_lens.index(7)
    start, context = int(data.query_start_loc[r]), spec.seq_lens[r] - 7
    position = context + 3
    block = int(data.block_table[r, position // tiny.block_size])
    slot = position % tiny.block_size
    assert torch.equal(data.key[start + 3], data.cache[block, 0, slot])
    assert torch.equal(data.value[start + 3], data.cache[block, 1, slot])


def test_reference_matches_the_kit_oracle(kernels, tiny) -> None:
    spec = kernels.CaseSpec("mixed", "x", (1, 9, 70), (13, 21, 70))
    data = kernels.make_case_data(spec, tiny, "cpu")
    reference = kernels.make_reference(data)
    keys, values = [], []
    for r, seq_len in enumerate(spec.seq_lens):
        positions = torch.arange(seq_len)
        blocks = data.block_table[r].long()[positions // tiny.block_size]
        keys.append(data.cache[blocks, 0, positions % tiny.block_size])
        values.append(data.cache[blocks, 1, positions % tiny.block_size])
    oracle, _ = attention_oracle(
        data.queries[0],
        torch.cat(keys),
        torch.cat(values),
        spec.query_lens,
        spec.seq_lens,
        scale=tiny.scale,
    )
    expected = oracle[reference.token_index]
    assert reference.expected.shape == expected.shape
    torch.testing.assert_close(reference.expected, expected, rtol=1e-12, atol=1e-12)
    # long queries are checked at both ends only
    rows_of_last = [i for i in reference.token_index.tolist() if i >= 10]
    assert len(rows_of_last) == 64


def test_cases_run_through_the_contract_on_cpu(kernels, tiny) -> None:
    contenders = kernels.make_contenders(["TORCH", "NO_SUCH_BACKEND"], list(kernels.PEERS), None)
    contenders.append(
        kernels.Contender("SDPA math", lambda data: kernels.prepare_sdpa(data, "math"))
    )
    options = kernels.Options(warmup=1, reps=2, wrapper_rounds=1, wrapper_reps=1)
    specs = [
        kernels.decode_case(3, 21),
        kernels.prefill_case(2, 13),
        kernels.mixed_case(5, 19, 2, 7, 9),
    ]
    results = []
    for spec in specs:
        data = kernels.make_case_data(spec, tiny, "cpu")
        case_results, wrappers = kernels.run_case(data, contenders, options, True)
        assert wrappers == []  # the wrapped backends do not run here (TORCH is no wrapper)
        results += case_results
    status = {(r.spec.section, r.contender): r for r in results}
    for section in ("decode", "prefill", "mixed"):
        torch_result = status[(section, "TORCH")]
        assert torch_result.status == "ok", torch_result.message
        assert torch_result.error < 1e-5 and torch_result.time_us > 0
        assert torch_result.path == "TORCH"
        assert status[(section, "NO_SUCH_BACKEND")].message == "not registered"
        assert status[(section, "FlashInfer")].status == "skip"
        assert status[(section, "FA4")].status == "skip"
    assert status[("decode", "SDPA math")].status == "ok"
    assert status[("prefill", "SDPA math")].status == "ok"
    assert status[("mixed", "SDPA math")].message == "n/a (varlen batch)"

    table = kernels.section_table("decode", results, tiny)
    assert "| TORCH |" in table and "SDPA math" in table
    assert "NO_SUCH_BACKEND: not registered" in table  # skipped everywhere: listed once
    ratios = kernels.ratio_table(results)
    assert "TRITON / FlashInfer decode" in ratios and "n/a" in ratios
    assert "No pair measured" in kernels.wrapper_table([])


@pytest.mark.parametrize(
    "spec_args",
    [
        ("decode", 3, 21),
        ("varied decodes", 21, 140, 3),
        ("prefill", 2, 13),
        ("mixed", 5, 19, 2, 7, 9),
    ],
)
def test_flex_attention_peer_matches_the_reference(kernels, tiny, spec_args) -> None:
    # The direct FlexAttention call that FLEX_ATTENTION's wrapper cost is measured against.
    section, *sizes = spec_args
    if section == "varied decodes":  # a batch entry per request, with a length mask
        spec = kernels.CaseSpec("decode", "3 varied", (1, 1, 1), tuple(sizes))
    else:
        spec = getattr(kernels, f"{section}_case")(*sizes)
    data = kernels.make_case_data(spec, tiny, "cpu")
    peer = kernels.prepare_flex(data)
    for slot in range(len(data.queries)):
        rows = peer.rows(peer.run(slot))
        assert rows.shape == data.queries[slot].shape
    error, ok = kernels.compare(peer.rows(peer.run(0)), kernels.make_reference(data), tiny.dtype)
    assert ok and error < 1e-5, error
    # the calls FLEX_ATTENTION makes: the decodes' batch entries, the other requests' rows
    calls = [section in ("decode", "varied decodes", "mixed"), section in ("prefill", "mixed")]
    names = ["a batch entry per decode", "packed K/V"]
    assert [name in peer.path() for name in names] == calls, peer.path()


def test_backend_with_smaller_kernel_blocks_and_reordering(kernels, tiny, register) -> None:
    """A backend whose kernel block is half the engine's gets a split cache and an expanded
    block table; TORCH's builder asks for decodes first, so the mixed batch is reordered and
    its rows mapped back."""

    class HalfBlockTorch(TorchAttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "HALF_BLOCK_TORCH"

        @classmethod
        def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
            return [2]

    register("HALF_BLOCK_TORCH", HalfBlockTorch)
    data = kernels.make_case_data(kernels.mixed_case(5, 19, 2, 7, 9), tiny, "cpu")
    contender = kernels.make_contenders(["HALF_BLOCK_TORCH"], [], None)[0]
    ready = contender.prepare(data)
    rows = ready.rows(ready.run(1))
    error, ok = kernels.compare(rows, kernels.make_reference(data), tiny.dtype)
    assert not ok  # slot 1 holds other queries than the reference's slot 0
    rows = ready.rows(ready.run(0))
    error, ok = kernels.compare(rows, kernels.make_reference(data), tiny.dtype)
    assert ok and error < 1e-5


def test_torch_size_cap_and_rejections(kernels, tiny, make_backend, register) -> None:
    data = kernels.make_case_data(kernels.decode_case(2, 9), tiny, "cpu")
    with pytest.raises(kernels.Skip, match=r"skipped \(slow\)"):
        kernels.prepare_backend("TORCH", data, torch_max_kv_tokens=10)
    register("CUDA_ONLY", make_backend("CUDA_ONLY", devices=("cuda",)))
    with pytest.raises(kernels.Skip, match="rejects the config: device cpu not supported"):
        kernels.prepare_backend("CUDA_ONLY", data)
    register("MISSING_LIB", make_backend("MISSING_LIB", unavailable="pip install missing-lib"))
    with pytest.raises(kernels.Skip, match="not available: pip install missing-lib"):
        kernels.prepare_backend("MISSING_LIB", data)


def test_time_build_on_cpu(kernels, tiny) -> None:
    result = kernels.time_build("TORCH", tiny, "cpu", reps=3, num_reqs=8, seq_len=20)
    assert result.status == "ok" and result.median_us > 0 and result.sync == "n/a (cpu)"
    assert kernels.time_build("NO_SUCH_BACKEND", tiny, "cpu", reps=3).status == "skip"
    table = kernels.build_table([result])
    assert "| TORCH |" in table
    varied = kernels.time_build("TORCH", tiny, "cpu", reps=3, num_reqs=8, seq_len=20, varied=True)
    assert varied.status == "ok" and varied.backend == "TORCH (varied lengths)"
    graphs = kernels.time_build("TORCH", tiny, "cpu", reps=3, num_reqs=8, seq_len=20, graphs=True)
    assert graphs.status == "skip" and graphs.backend == "TORCH (CUDA-graph replay)"
    assert graphs.message == "no decode CUDA graphs (support NEVER)"
    persistent = kernels.time_build("TORCH", tiny, "cpu", 3, 8, 20, graphs=True, persistent=True)
    assert persistent.backend == "TORCH (CUDA-graph replay, persistent inputs)"
    assert kernels.host_yardstick_us("cpu", reps=3) > 0


def test_builds_are_timed_in_interleaved_rounds(kernels) -> None:
    """Every case once per round, in turn: a slow phase of the host falls on all of them."""
    calls = []
    cases = [
        kernels.PreparedBuild("A", lambda: calls.append("A"), "none"),
        kernels.BuildResult("SKIPPED", "skip", message="not here"),
        kernels.PreparedBuild("B", lambda: calls.append("B"), "none"),
    ]
    results = kernels.time_builds(cases, reps=6, rounds=3)
    assert calls == ["A", "A", "B", "B"] * 3
    assert [r.backend for r in results] == ["A", "SKIPPED", "B"]
    assert results[1].status == "skip"
    for r in (results[0], results[2]):
        assert r.status == "ok" and 0 < r.quietest_us <= r.p90_us and r.median_us <= r.p90_us
    table = kernels.build_table(results)
    assert "quietest round us" in table and "| SKIPPED | not here |" in table


def test_arguments(kernels) -> None:
    args = kernels.parse_args(["--only", "decode,build", "--backends", "triton,torch"])
    assert args.only == ["decode", "build"] and args.backends == ["TRITON", "TORCH"]
    assert kernels.parse_args(["--peers", "none"]).peers == []
    with pytest.raises(SystemExit):
        kernels.parse_args(["--only", "decode,nonsense"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_main_without_cuda_says_so_in_one_line(kernels, capsys) -> None:
    assert kernels.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA device" in out


@pytest.mark.gpu
def test_gpu_timing_path_with_torch(kernels, capsys) -> None:
    """The CUDA side of the benchmark on small cases, without the big libraries: event timing
    behind the sleep kernel, the bf16 reference check, build() under the sync check, and the
    report header."""
    shape = kernels.Shape()
    options = kernels.Options(warmup=1, reps=3, wrapper_rounds=1, wrapper_reps=2, build_reps=3)
    contenders = kernels.make_contenders(["TORCH"], ["sdpa-flash"], None)
    for spec in (kernels.decode_case(4, 256), kernels.prefill_case(2, 128)):
        data = kernels.make_case_data(spec, shape, "cuda")
        results, _ = kernels.run_case(data, contenders, options, False)
        torch_result = results[0]
        assert torch_result.status == "ok", torch_result.message
        assert 0 < torch_result.time_us < 1e6
    build = kernels.time_build("TORCH", shape, "cuda", reps=3, num_reqs=16, seq_len=64)
    assert build.status == "ok" and build.median_us > 0 and build.sync
    # a graph replay step's build (TRITON: decode graphs, and triton is on every CUDA machine)
    replay = kernels.time_build("TRITON", shape, "cuda", 3, num_reqs=16, seq_len=64, graphs=True)
    assert replay.backend == "TRITON (CUDA-graph replay)"
    assert replay.status == "ok" and replay.sync == "none", replay.message
    args = ["--quick", "--only", "build", "--backends", "TORCH", "--peers", "none"]
    assert kernels.main(args) == 0
    out = capsys.readouterr().out
    assert "build() host time" in out and "| TORCH |" in out and "Host yardstick" in out
