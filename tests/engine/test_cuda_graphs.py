"""CUDA graphs of decode steps: the plan, the padding, the persistent buffers, graphs vs eager.

On the CPU: which graphs are planned and why not (the log line), which capture size a batch
pads to, the padded CPU mirrors exactly, metadata views at fixed addresses, and a padded step
run eagerly through the graph inputs giving the unpadded step's logits. On a GPU (`gpu`):
decode steps replayed from graphs against eager steps of the same model (TRITON, and FLASHINFER,
whose layers must all be planned in build). The TORCH
fallback on CUDA (graphs off, the log line, the CPU run's tokens) is
`test_llm.py::test_engine_on_cuda_matches_the_cpu_run`.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from anyattn.config import BatchLimits
from anyattn.engine.cuda_graphs import default_capture_sizes, pick_capture_size, plan_cuda_graphs
from anyattn.engine.decode_inputs import DecodeBuffers, StaticDecodeInputs, fill_decode_inputs
from anyattn.engine.input_batch import InputBatch
from anyattn.metadata import compute_slot_mapping, expand_block_table
from anyattn.types import AttentionCGSupport as CG

LIMITS = BatchLimits(max_num_reqs=16, max_num_tokens=1024, max_model_len=128)


def test_default_capture_sizes_are_powers_of_two_up_to_max_num_reqs() -> None:
    assert default_capture_sizes(16, 1024) == (1, 2, 4, 8, 16)
    assert default_capture_sizes(12, 1024) == (1, 2, 4, 8, 12)
    assert default_capture_sizes(1, 1024) == (1,)
    assert default_capture_sizes(16, 4) == (1, 2, 4)


def test_a_batch_pads_to_the_smallest_capture_size_that_holds_it() -> None:
    sizes = (1, 2, 4, 8)
    assert [pick_capture_size(r, 1, sizes) for r in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert pick_capture_size(9, 1, sizes) is None
    # spec decode, 3 tokens a request: only sizes that are whole requests count
    assert pick_capture_size(2, 3, (1, 2, 4, 6, 8, 12)) == 6
    assert pick_capture_size(3, 3, (1, 2, 4, 6, 8, 12)) == 12
    assert pick_capture_size(5, 3, (1, 2, 4, 6, 8, 12)) is None


def test_graph_key_takes_uniform_batches_within_the_captures_and_the_table_width() -> None:
    from anyattn.engine.cuda_graphs import CudaGraphRunner

    runner = CudaGraphRunner.__new__(CudaGraphRunner)  # no capture: the choice alone
    runner.plan = SimpleNamespace(query_lens=(1, 2))
    runner.graphs = dict.fromkeys([(1, 1), (2, 1), (4, 1), (4, 2)])
    runner.inputs = SimpleNamespace(max_blocks=3)

    def key(num_new, num_blocks):
        return runner.graph_key(np.array(num_new), np.array(num_blocks))

    assert key([1, 1, 1], [1, 3, 2]) == (4, 1)  # padded to the next capture
    assert key([2, 2], [1, 1]) == (4, 2)
    assert key([1, 2], [1, 1]) is None  # not uniform
    assert key([3], [1]) is None  # no graph of that query length
    assert key([1] * 5, [1] * 5) is None  # larger than every capture
    assert key([1], [4]) is None  # wider than the captured block table
    assert key([], []) is None


@pytest.mark.parametrize(
    ("levels", "device_type", "enforce_eager", "message"),
    [
        ({"TORCH": CG.NEVER}, "cuda", False, "CUDA graphs off: TORCH supports NEVER"),
        ({"A": CG.ALWAYS, "B": CG.NEVER}, "cuda", False, "CUDA graphs off: B supports NEVER"),
        ({"TRITON": CG.ALWAYS}, "cuda", True, "CUDA graphs off: enforce_eager=True"),
        ({"TRITON": CG.ALWAYS}, "cpu", False, "CUDA graphs off: device is cpu"),
    ],
)
def test_graphs_off_says_why(levels, device_type, enforce_eager, message) -> None:
    plan = plan_cuda_graphs(
        levels, device_type=device_type, enforce_eager=enforce_eager, limits=LIMITS
    )
    assert not plan.enabled and plan.graph_keys == ()
    assert plan.message.startswith(message)


def test_graphs_on_capture_decode_batches_up_to_what_the_weakest_level_allows() -> None:
    plan = plan_cuda_graphs(
        {"TRITON": CG.ALWAYS}, device_type="cuda", enforce_eager=False, limits=LIMITS
    )
    assert plan.enabled and plan.level == CG.ALWAYS
    assert plan.graph_keys == ((16, 1), (8, 1), (4, 1), (2, 1), (1, 1))  # largest first
    assert plan.message.startswith("CUDA graphs on: TRITON supports ALWAYS")
    spec = BatchLimits(16, 1024, 128, num_speculative_tokens=1, cudagraph_capture_sizes=(1, 2, 3))
    uniform = plan_cuda_graphs(
        {"X": CG.UNIFORM_BATCH}, device_type="cuda", enforce_eager=False, limits=spec
    )
    assert uniform.query_lens == (1, 2)  # spec-decode verification batches of 1 + 1 tokens
    assert uniform.graph_keys == ((3, 1), (2, 2), (2, 1), (1, 1))
    single = plan_cuda_graphs(
        {"X": CG.UNIFORM_BATCH, "Y": CG.UNIFORM_SINGLE_TOKEN_DECODE},
        device_type="cuda",
        enforce_eager=False,
        limits=spec,
    )
    assert single.level == CG.UNIFORM_SINGLE_TOKEN_DECODE and single.query_lens == (1,)


def test_runner_logs_the_plan(tiny_llm, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="anyattn.engine.model_runner"):
        llm, _ = tiny_llm("llama")
    assert "CUDA graphs off: device is cpu" in caplog.text
    assert llm.runner.cuda_graphs is None
    assert llm.runner.limits.cudagraph_capture_sizes == ()


def _filled(buffers: DecodeBuffers, num_reqs: int, num_tokens: int) -> dict[str, list]:
    return {
        "input_ids": buffers.input_ids[:num_tokens].tolist(),
        "positions": buffers.positions[:num_tokens].tolist(),
        "query_start_loc": buffers.query_start_loc[: num_reqs + 1].tolist(),
        "seq_lens": buffers.seq_lens[:num_reqs].tolist(),
        "num_computed_tokens": buffers.num_computed_tokens[:num_reqs].tolist(),
        "block_table": buffers.block_table[:num_reqs].tolist(),
        "slot_mapping": buffers.slot_mapping[:num_tokens].tolist(),
    }


def test_padded_cpu_mirrors_exactly() -> None:
    host = DecodeBuffers.allocate(max_num_reqs=8, max_num_tokens=8, max_blocks=4)
    tokens = [list(range(100, 110)), [7], list(range(200, 211))]
    # a larger batch first, so that stale rows must be overwritten
    big, big_slots = InputBatch.from_lists(tokens * 2, [9, 0, 10] * 2, [[5, 6, 7]] * 6, 4)
    fill_decode_inputs(host, big, big_slots, query_len=1, num_padded_reqs=8)
    batch, slots = InputBatch.from_lists(tokens, [5, 0, 9], [[7, 3], [2], [4, 8, 6]], 4)
    longest = fill_decode_inputs(host, batch, slots, query_len=1, num_padded_reqs=4)
    assert longest == 10
    assert _filled(host, 4, 4) == {
        "input_ids": [105, 7, 209, 0],
        "positions": [5, 0, 9, 0],
        "query_start_loc": [0, 1, 2, 3, 4],
        "seq_lens": [6, 1, 10, 1],
        "num_computed_tokens": [5, 0, 9, 0],
        "block_table": [[7, 3, 0, 0], [2, 0, 0, 0], [4, 8, 6, 0], [0, 0, 0, 0]],
        # position 5 -> block 3 offset 1; 0 -> block 2 offset 0; 9 -> block 6 offset 1
        "slot_mapping": [13, 8, 25, -1],
    }
    # the real slots are the metadata helper's
    real = compute_slot_mapping(
        host.block_table[:3], host.query_start_loc[:4], host.seq_lens[:3], block_size=4
    )
    assert real.tolist() == [13, 8, 25]


def test_padded_cpu_mirrors_with_two_tokens_a_request() -> None:
    host = DecodeBuffers.allocate(max_num_reqs=4, max_num_tokens=8, max_blocks=2)
    batch, slots = InputBatch.from_lists([[1, 2, 3, 4, 5]], [3], [[9, 4]], block_size=4)
    fill_decode_inputs(host, batch, slots, query_len=2, num_padded_reqs=3)
    assert _filled(host, 3, 6) == {
        "input_ids": [4, 5, 0, 0, 0, 0],
        "positions": [3, 4, 0, 1, 0, 1],
        "query_start_loc": [0, 2, 4, 6],
        "seq_lens": [5, 2, 2],
        "num_computed_tokens": [3, 0, 0],
        "block_table": [[9, 4], [0, 0], [0, 0]],
        "slot_mapping": [39, 16, -1, -1, -1, -1],
    }


class RecordingBuilder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def build(self, common_prefix_len, common_attn_metadata):
        self.calls.append(("build", common_attn_metadata))
        return common_attn_metadata

    def build_for_cudagraph_capture(self, common_attn_metadata):
        self.calls.append(("capture", common_attn_metadata))
        return common_attn_metadata


def test_metadata_are_views_of_fixed_buffers_and_kernel_tables_are_expanded() -> None:
    engine_group = SimpleNamespace(
        builder=RecordingBuilder(), layer_names=["a"], kernel_block_size=4
    )
    small_group = SimpleNamespace(
        builder=RecordingBuilder(), layer_names=["b", "c"], kernel_block_size=2
    )
    inputs = StaticDecodeInputs(
        [engine_group, small_group],
        block_size=4,
        max_num_reqs=8,
        max_num_tokens=8,
        max_model_len=16,
        device=torch.device("cpu"),
    )
    addresses = set()
    for tables, padded in (([[3, 5]], 2), ([[1, 4], [2, 6], [7, 8]], 4)):
        num = len(tables)
        batch, slots = InputBatch.from_lists([[1] * 9] * num, [4] * num, tables, block_size=4)
        ids, positions, common = inputs.prepare(batch, slots, query_len=1, num_padded_reqs=padded)
        metadata = inputs.build(common, for_capture=False)
        assert metadata["a"] is common and metadata["b"] is metadata["c"]
        assert common.num_reqs == padded and common.num_actual_tokens == padded
        assert common.max_query_len == 1 and common.max_seq_len == 5
        # the CPU mirrors are views of the pinned host buffers, expanded for kernel blocks too
        assert common.block_table_cpu.data_ptr() == inputs.host.block_table.data_ptr()
        assert common.slot_mapping_cpu.data_ptr() == inputs.host.slot_mapping.data_ptr()
        assert torch.equal(
            metadata["b"].block_table_tensor,
            expand_block_table(common.block_table_tensor, 4, 2),
        )
        assert torch.equal(metadata["b"].block_table_cpu, metadata["b"].block_table_tensor)
        addresses.add(
            tuple(
                t.data_ptr()
                for t in (
                    ids,
                    positions,
                    common.query_start_loc,
                    common.seq_lens,
                    common.block_table_tensor,
                    common.slot_mapping,
                    common.query_start_loc_cpu,
                    common.seq_lens_cpu,
                    metadata["b"].block_table_tensor,
                )
            )
        )
    assert len(addresses) == 1  # the same buffers at every step
    inputs.build(common, for_capture=True)
    assert [kind for kind, _ in engine_group.builder.calls] == ["build", "build", "capture"]


def test_padded_step_through_graph_inputs_gives_the_unpadded_logits(tiny_llm, run_step) -> None:
    # The graph path without the graph: the padded step run eagerly (TORCH, CPU) must give the
    # real requests the logits of the ordinary eager step.
    for kind in ("llama", "gemma2"):
        llm, _ = tiny_llm(kind)
        runner = llm.runner
        prompts = [[5, 9, 17, 33, 2, 80, 41], [12, 13, 14], [99, 98, 97, 96, 95, 94, 93, 92, 91]]
        tables = [[3, 4], [9], [6, 1, 7]]
        run_step(runner, prompts, [0, 0, 0], [7, 3, 9], tables)
        tokens = [[*p, i + 20] for i, p in enumerate(prompts)]
        computed = [len(p) for p in prompts]
        inputs = StaticDecodeInputs(
            runner.groups,
            block_size=runner.block_size,
            max_num_reqs=8,
            max_num_tokens=8,
            max_model_len=runner.limits.max_model_len,
            device=runner.device,
        )
        batch, slots = InputBatch.from_lists(tokens, computed, tables, runner.block_size)
        ids, positions, common = inputs.prepare(batch, slots, 1, num_padded_reqs=8)
        with torch.inference_mode():
            metadata = inputs.build(common, for_capture=False)
            hidden = runner.model(ids, positions, metadata, runner.kv_caches)
            padded = runner.model.compute_logits(hidden[:3])
        eager = run_step(runner, tokens, computed, [1, 1, 1], tables)
        assert eager.sample_rows == [0, 1, 2]
        torch.testing.assert_close(padded, eager.logits, atol=1e-5, rtol=1e-5)
        assert np.isfinite(runner.model.compute_logits(hidden).numpy()).all()  # dummies too


# --- on a GPU ------------------------------------------------------------------------------


def _gpu_llm_or_skip(
    tiny_llm, dtype: torch.dtype, kind: str = "llama_h64", backend: str = "TRITON", **kwargs
):
    """An LLM of a tiny random model on CUDA with `backend` (block size 16); skips with the
    reason when the backend is not a registered name or cannot run here."""
    from anyattn.registry import backend_names, get_backend_class

    if backend not in backend_names():
        pytest.skip(f"{backend} is not a registered backend name (registry.backend_names())")
    unavailable = get_backend_class(backend).get_unavailable_reason()
    if unavailable:
        pytest.skip(f"{backend} is not available here: {unavailable}")
    llm, _ = tiny_llm(kind, device="cuda", dtype=dtype, backend=backend, block_size=16, **kwargs)
    return llm


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("backend", "dtype", "tolerance"),
    [
        ("TRITON", torch.float32, 1e-4),
        ("TRITON", torch.bfloat16, 1.5e-2),
        # planned in build for every layer record, graphs per captured size
        ("FLASHINFER", torch.bfloat16, 1.5e-2),
        # XQA decodes (the build copies the step into the graph's buffers) and FLASH_ATTN
        # (the graphs read the runner's buffers in place: has_persistent_graph_inputs)
        ("FLASHINFER:xqa", torch.bfloat16, 1.5e-2),
        ("FLASH_ATTN", torch.bfloat16, 1.5e-2),
    ],
    ids=str,
)
def test_decode_graphs_match_eager_steps(
    tiny_llm, run_step, monkeypatch, backend, dtype, tolerance
) -> None:
    backend, _, decode_kernel = backend.partition(":")
    if decode_kernel:
        from anyattn.backends.flashinfer import FlashInferMetadataBuilder

        monkeypatch.setattr(FlashInferMetadataBuilder, "decode_kernel", decode_kernel)
    graphs = _gpu_llm_or_skip(tiny_llm, dtype, backend=backend).runner
    eager = _gpu_llm_or_skip(tiny_llm, dtype, backend=backend, enforce_eager=True).runner
    device = torch.cuda.get_device_properties(graphs.device)
    assert graphs.num_sms == device.multi_processor_count > 0
    assert graphs.cuda_graphs is not None, graphs.cuda_graph_plan.message
    assert eager.cuda_graphs is None
    assert graphs.limits.has_persistent_graph_inputs
    assert not eager.limits.has_persistent_graph_inputs
    assert graphs.cuda_graph_plan.graph_keys == ((16, 1), (8, 1), (4, 1), (2, 1), (1, 1))
    generator = torch.Generator().manual_seed(0)
    free = torch.randperm(graphs.limits.max_model_len // 16 * 4, generator=generator) + 1
    prompts = [[5, 9, 17, 33, 2], [12, 13, 14], list(range(40, 52)), [99, 98, 7, 6], [3] * 9]
    tables = [free[2 * i : 2 * i + 2].tolist() for i in range(len(prompts))]  # 32 tokens each
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)

    def step(batch: list[int], num_new: list[int]) -> None:
        args = (
            [tokens[i] for i in batch],
            [computed[i] for i in batch],
            num_new,
            [tables[i] for i in batch],
        )
        replays = graphs.cuda_graphs.num_replays
        got, want = run_step(graphs, *args), run_step(eager, *args)
        is_decode = all(n == 1 for n in num_new)
        assert graphs.cuda_graphs.num_replays == replays + is_decode
        assert got.sample_rows == want.sample_rows
        by_row = dict(zip(want.sample_rows, want.logits, strict=True))
        want_logits = torch.stack([by_row[r] for r in got.sample_rows])
        torch.testing.assert_close(got.logits, want_logits, atol=tolerance, rtol=tolerance)
        for logits, reference in zip(got.logits, want_logits, strict=True):
            top2 = reference.topk(2).values
            if float(top2[0] - top2[1]) > 2 * tolerance:  # not a near-tie
                assert int(logits.argmax()) == int(reference.argmax())
        for i, n in zip(batch, num_new, strict=True):
            computed[i] += n
            tokens[i].append(int(by_row[batch.index(i)].argmax()))  # eager's greedy token

    step(list(range(5)), [len(p) for p in prompts])  # prefill: eager on both sides
    for batch in ([0, 1, 2],) * 3 + ([0, 1, 2, 3, 4],) * 3 + ([3],) + ([4, 2, 0, 1, 3],):
        step(list(batch), [1] * len(batch))  # 3 -> 4 rows, 5 -> 8 rows, 1 -> 1 row
    if decode_kernel == "xqa":
        for group in graphs.groups:  # XQA served the decodes: no decode wrapper was planned
            assert all(group.builder.xqa_reason(r) is None for r in group.builder.layers.values())
    if backend == "FLASH_ATTN":
        for group in graphs.groups:  # the graphs read the runner's buffers: none of its own
            assert group.builder._buffers is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama_h64", "gemma2"])  # gemma2: two KV-cache groups
def test_llm_generates_the_same_tokens_with_and_without_graphs(tiny_llm, kind) -> None:
    from anyattn.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 17, 33, 2], [12, 13, 14], list(range(40, 52))]
    outputs = []
    for enforce_eager in (False, True):
        llm = _gpu_llm_or_skip(tiny_llm, torch.float32, kind, enforce_eager=enforce_eager)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        if not enforce_eager:
            assert len(llm.runner.groups) == (2 if kind == "gemma2" else 1)
            assert llm.runner.cuda_graphs.num_replays >= 11  # every decode step
    assert outputs[0] == outputs[1]
