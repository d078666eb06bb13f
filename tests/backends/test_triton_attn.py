"""TRITON backend: the conformance kit under the Triton interpreter (CPU) and on the GPU,
split-KV forced and forbidden on one batch, CUDA-graph capture and replay, 64-bit indexing.

Triton decides whether kernels are interpreted when they are defined, so the CPU kernel cases
run in one subprocess with `TRITON_INTERPRET=1` set before anything is imported: this file run
as a script. The interpreter computes bf16 wrongly (see docs/semantics.md, "Tolerance"): fp32
and fp16 there, bf16 and fp8 rounding on the GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from anyattn.backends.triton_attn import TritonAttentionBackend
from anyattn.backends.triton_attn_builder import TritonAttentionMetadata, choose_num_splits
from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits
from anyattn.metadata import make_common_attn_metadata
from anyattn.ops.unified_attention import (
    UnifiedAttentionParams,
    split_kv_workspace_shape,
    unified_attention,
    unified_attention_ref,
)
from anyattn.selector import explain, select_backend
from anyattn.testing import check_backend, layer_records, plan_cases, run_case
from anyattn.types import DeviceInfo


class InterpretedTriton(TritonAttentionBackend):
    """TRITON's kernels on the CPU through the interpreter (tests only)."""

    supported_device_types = ("cpu", "cuda")


def random_batch(
    query_lens: list[int],
    seq_lens: list[int],
    device: str,
    dtype: torch.dtype,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    block_size: int = 16,
    num_blocks: int | None = None,
    generator_seed: int = 0,
):
    """Query, a cache over shuffled blocks (block 0 = the null block) and the index tensors."""
    gen = torch.Generator().manual_seed(generator_seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    needed = sum(blocks_per_req)
    num_blocks = num_blocks or needed + 8
    ids = torch.randperm(num_blocks - 1, generator=gen)[:needed] + 1
    table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    at = 0
    for r, n in enumerate(blocks_per_req):
        table[r, :n] = ids[at : at + n]
        at += n
    kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=gen)
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = {"device": device}
    return (
        query.to(dtype=dtype, **to),
        kv.to(dtype=dtype, **to),
        qsl.to(**to),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        table.to(**to),
    )


def check_split_kv_forced_and_forbidden(device: str, dtype: torch.dtype) -> None:
    """The same decode batch with split-KV forbidden (1 split) and forced (2, 4, 16 splits):
    each matches the reference, and the split results agree with the unsplit one."""
    query_lens = [1] * 5
    seq_lens = [1, 17, 200, 64, 333]
    query, kv, qsl, sl, table = random_batch(query_lens, seq_lens, device, dtype)
    params = UnifiedAttentionParams(scale=32**-0.5, sinks=torch.randn(4, device=device))
    expected = torch.zeros(query.shape, dtype=torch.float32, device=device)
    expected_lse = torch.zeros(4, query.shape[0], device=device)
    unified_attention_ref(query, kv, expected, qsl, sl, table, 5, params, output_lse=expected_lse)
    results = {}
    for splits in (1, 2, 4, 16):
        out_shape, lse_shape = split_kv_workspace_shape(query.shape[0], 4, 32, splits)
        workspace = (torch.empty(out_shape, device=device), torch.empty(lse_shape, device=device))
        out = torch.zeros_like(query)
        lse = torch.zeros(4, query.shape[0], device=device)
        unified_attention(
            query, kv, out, qsl, sl, table, 5, 1, params,
            output_lse=lse, num_splits=splits, workspace=workspace,
        )  # fmt: skip
        tol = 2e-3 if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5)
        results[splits] = out.float()
    for splits in (2, 4, 16):
        torch.testing.assert_close(results[splits], results[1], atol=2e-3, rtol=2e-3)


def check_fresh_prefill_from_inputs(device: str, dtype: torch.dtype) -> None:
    """Fresh prefills reading K/V from the inputs (TMA descriptors) equal the page-gather path
    and the reference; NaN in padding rows past the last request leaks into nothing."""
    from anyattn.ops.reshape_and_cache import reshape_and_cache

    query_lens = [5, 20, 33]
    query, kv, qsl, sl, table = random_batch(query_lens, query_lens, device, dtype)
    gen = torch.Generator().manual_seed(3)
    num_tokens = sum(query_lens)
    key = torch.randn(num_tokens + 4, 2, 32, generator=gen).to(device=device, dtype=dtype)
    value = torch.randn(num_tokens + 4, 2, 32, generator=gen).to(device=device, dtype=dtype)
    key[num_tokens:] = float("nan")
    value[num_tokens:] = float("nan")
    slots = []
    for r, n in enumerate(query_lens):
        pos = torch.arange(n)
        slots.append(table[r, pos // 16].long().cpu() * 16 + pos % 16)
    reshape_and_cache(key[:num_tokens], value[:num_tokens], kv, torch.cat(slots).to(device))
    params = UnifiedAttentionParams(
        scale=32**-0.5, alibi_slopes=torch.rand(4, device=device), logits_soft_cap=20.0
    )
    expected = torch.zeros(query.shape, dtype=torch.float32, device=device)
    for causal in (True, False):
        params = dataclasses.replace(params, causal=causal)
        unified_attention_ref(query, kv, expected, qsl, sl, table, 3, params)
        gathered, from_input = torch.zeros_like(query), torch.zeros_like(query)
        unified_attention(query, kv, gathered, qsl, sl, table, 3, 33, params)
        unified_attention(
            query, kv, from_input, qsl, sl, table, 3, 33, params,
            key=key[:num_tokens].contiguous(), value=value[:num_tokens].contiguous(),
        )  # fmt: skip
        tol = 2e-3 if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(from_input.float(), expected, atol=tol, rtol=tol)
        torch.testing.assert_close(from_input, gathered, atol=tol, rtol=tol)
    # Four padding rows whose K/V are NaN, inside the range the last request's tile reads.
    padded_query = torch.cat([query, torch.zeros_like(query[:4])])
    out = torch.zeros_like(padded_query)
    unified_attention(
        padded_query, kv, out, qsl, sl, table, 3, 33, params, key=key, value=value
    )  # fmt: skip
    assert not out[:num_tokens].isnan().any()
    torch.testing.assert_close(out[:num_tokens], from_input, atol=0, rtol=0)


# (name, query_lens, seq_lens, batch kwargs, params kwargs, tiles): shapes the kit's catalogue
# does not reach: tiles smaller than a block and than a request, odd block sizes, GQA ratios
# and head sizes that are not powers of two, windows of 1, every score modifier at once.
AWKWARD = [
    ("tiny tiles, block 3", [1, 7, 40, 1], [90, 7, 100, 1], {"block_size": 3}, {}, (16, 16, 4, 1)),
    ("every modifier", [1, 7, 40, 1], [90, 7, 100, 1], {"block_size": 5},
     {"cap": 2.0, "alibi": True, "sinks": True}, (16, 16, 4, 1)),
    ("window 1", [1, 7, 40], [90, 7, 100], {}, {"sliding_window": 1}, (16, 16, 4, 1)),
    ("gqa 3, head 40", [1, 7, 40], [90, 7, 100], {"num_heads": 3, "num_kv_heads": 1,
     "head_size": 40}, {}, None),
    ("gqa 7, head 24", [1, 9, 1], [30, 9, 1], {"num_heads": 14, "num_kv_heads": 2,
     "head_size": 24}, {"sinks": True}, None),
    ("mha, 64-row tiles", [1, 70, 3], [90, 70, 100], {"num_heads": 2, "num_kv_heads": 2}, {},
     (64, 16, 4, 1)),
]  # fmt: skip


def check_awkward_shapes(device: str, dtype: torch.dtype) -> None:
    """The kernel against the reference run in float64, with and without split-KV."""
    for name, query_lens, seq_lens, batch_kw, mods, tiles in AWKWARD:
        query, kv, qsl, sl, table = random_batch(query_lens, seq_lens, device, dtype, **batch_kw)
        num_heads = query.shape[1]
        gen = torch.Generator().manual_seed(5)
        params = UnifiedAttentionParams(
            scale=query.shape[2] ** -0.5,
            sliding_window=mods.get("sliding_window"),
            logits_soft_cap=mods.get("cap"),
            alibi_slopes=torch.rand(num_heads, generator=gen).to(device)
            if "alibi" in mods
            else None,
            sinks=torch.randn(num_heads, generator=gen).to(device) if "sinks" in mods else None,
        )
        expected = torch.zeros(query.shape, dtype=torch.float64, device=device)
        expected_lse = torch.zeros(num_heads, query.shape[0], dtype=torch.float64, device=device)
        ref_params = dataclasses.replace(
            params,
            alibi_slopes=None if params.alibi_slopes is None else params.alibi_slopes.double(),
            sinks=None if params.sinks is None else params.sinks.double(),
        )
        unified_attention_ref(
            query.double(), kv.double(), expected, qsl, sl, table, len(query_lens), ref_params,
            output_lse=expected_lse,
        )  # fmt: skip
        for splits in (1, 3):
            out_shape, lse_shape = split_kv_workspace_shape(
                query.shape[0], num_heads, query.shape[2], splits
            )
            workspace = (
                torch.empty(out_shape, device=device),
                torch.empty(lse_shape, device=device),
            )
            out = torch.zeros_like(query)
            lse = torch.zeros(num_heads, query.shape[0], device=device)
            unified_attention(
                query, kv, out, qsl, sl, table, len(query_lens), max(query_lens), params,
                output_lse=lse, num_splits=splits, workspace=workspace, tiles=tiles,
            )  # fmt: skip
            tol = 2e-3 if dtype == torch.float16 else 2e-5
            torch.testing.assert_close(
                out.double(), expected, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}"
            )
            torch.testing.assert_close(
                lse.double(), expected_lse, atol=1e-4, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )


def check_soft_cap_decodes(device: str, dtype: torch.dtype) -> None:
    """The kit's decodes with soft caps 20 and 50, three seeds each, within the oracle's bound
    (in float32 they were not while the cap was computed as 1 - 2 / (exp(2x) + 1))."""
    backend = InterpretedTriton if device == "cpu" else TritonAttentionBackend
    cases, _ = plan_cases(backend, device, dtype, features=["decode"], quick=device == "cpu")
    assert [case.name for case in cases] == ["single_decode", "many_decodes"]
    failed = []
    for case, cap, seed in itertools.product(cases, (20.0, 50.0), range(3)):
        capped = dataclasses.replace(case, logits_soft_cap=cap)
        for result in run_case(backend, capped, device, dtype, seed):
            if not result.passed:
                error = f"{result.max_error:.3g} (bound {result.bound:.3g})"
                failed.append(f"{case.name} cap {cap} seed {seed}: {error} {result.detail}")
    assert not failed, failed


def run_interpreter_cases() -> list[str]:
    """The CPU cases (run with TRITON_INTERPRET=1); returns failure messages."""
    failures = []
    for dtype in (torch.float32, torch.float16):
        report = check_backend(InterpretedTriton, "cpu", dtype, quick=True)
        if not report.passed:
            failures.append(f"kit {dtype}: {[c.name for c in report.failures]}")
        checks = (
            check_split_kv_forced_and_forbidden,
            check_fresh_prefill_from_inputs,
            check_awkward_shapes,
            check_soft_cap_decodes,
        )
        for check in checks:
            try:
                check("cpu", dtype)
            except AssertionError as error:
                failures.append(f"{check.__name__} {dtype}: {error}")
    return failures


def test_kernels_under_interpreter(triton_interpreter: Callable[..., str]) -> None:
    triton_interpreter(__file__, timeout=900)


# --- declarations and selection (CPU) ---------------------------------------------------------


def test_first_choice_on_cuda_without_flash_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from anyattn import registry

    for name in ("FLASH_ATTN", "FLASHINFER"):
        if name in registry.backend_names():
            cls = registry.get_backend_class(name)
            monkeypatch.setattr(cls, "get_unavailable_reason", classmethod(lambda c: "absent"))
    config = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, num_heads=32)
    for device in ("sm80", "sm90", "sm100"):
        assert select_backend(config, device=device) is TritonAttentionBackend


def test_declarations_and_reasons() -> None:
    base = AttentionSelectorConfig(head_size=128, dtype=torch.float16)
    verdict = {v.name: v for v in explain(base, device="sm90").verdicts}["TRITON"]
    assert verdict.reasons == ()
    reasons = TritonAttentionBackend.validate_configuration(base, DeviceInfo.parse("cpu"))
    assert any("device" in r for r in reasons)
    window_non_causal = base.replace(has_sliding_window=True, use_non_causal=True)
    assert TritonAttentionBackend.validate_configuration(
        window_non_causal, DeviceInfo.parse("sm90")
    )
    fp8_on_ampere = base.replace(kv_cache_dtype="fp8_e4m3")
    assert TritonAttentionBackend.validate_configuration(fp8_on_ampere, DeviceInfo.parse("sm80"))
    assert not TritonAttentionBackend.validate_configuration(
        fp8_on_ampere, DeviceInfo.parse("sm90")
    )
    assert TritonAttentionBackend.validate_configuration(
        base.replace(head_size=260), DeviceInfo.parse("sm90")
    )
    flags = dict(has_sink=True, has_alibi=True, has_logits_soft_cap=True, needs_lse=True)
    assert not TritonAttentionBackend.validate_configuration(
        base.replace(**flags), DeviceInfo.parse("sm90")
    )
    assert TritonAttentionBackend.get_cudagraph_support().name == "ALWAYS"


@pytest.mark.parametrize(
    ("num_reqs", "max_query_len", "max_seq_len", "num_tokens", "expected"),
    [
        (8, 1, 32768, 8, 4),  # 64 programs: 4 splits reach 256
        (64, 1, 4096, 64, 1),  # 512 programs fill the GPU
        (1, 1, 1 << 20, 1, 16),  # capped at 16
        (1, 1, 3000, 1, 2),  # at least 1024 keys per split
        (1, 1, 100, 1, 1),
        (2, 37, 100000, 74, 1),  # prefills never split
        (0, 0, 0, 0, 1),
    ],
)
def test_choose_num_splits(num_reqs, max_query_len, max_seq_len, num_tokens, expected) -> None:
    got = choose_num_splits(num_reqs, 8, max_query_len, max_seq_len, num_tokens)
    assert got == expected


def test_builder_plans_from_cpu_mirrors_and_refuses_cascade() -> None:
    spec = AttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    limits = BatchLimits(max_num_reqs=64, max_num_tokens=2048, max_model_len=32768)
    layers = {**layer_records(spec, ["l0"], num_heads=16), **layer_records(spec, ["l1"], 32)}
    builder = TritonAttentionBackend.get_builder_cls()(spec, layers, limits, "cpu")
    table = torch.arange(1, 8 * 1250 + 1, dtype=torch.int32).view(8, 1250)
    cm = make_common_attn_metadata([1] * 8, [20000] * 8, table, 16)
    md = builder.build(0, cm)
    assert isinstance(md, TritonAttentionMetadata)
    assert md.num_splits == 4
    # The split-KV buffers are made by the build, for the layer with the most heads.
    assert md.layer_names == frozenset({"l0", "l1"})
    out_shape, lse_shape = split_kv_workspace_shape(256, 32, 128, 16)  # min(tokens, 256)
    assert tuple(md.workspace[0].shape) == out_shape and tuple(md.workspace[1].shape) == lse_shape
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.num_splits = 1
    # A layer the builder was not given is refused before any kernel runs.
    impl = TritonAttentionBackend.get_impl_cls()(32, 128, 128**-0.5, 8)
    query = torch.zeros(8, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"TRITON forward: layer 'l7' is not one of the layers"):
        impl.forward(SimpleNamespace(layer_name="l7"), query, None, None, None, md, query)
    assert md.query_start_loc is cm.query_start_loc and md.block_table is cm.block_table_tensor
    capture = builder.build_for_cudagraph_capture(cm)
    assert capture.num_splits == choose_num_splits(8, 8, 1, 32768, 8)
    with pytest.raises(ValueError, match="cascade"):
        builder.build(16, cm)
    # A fresh batch may read K/V from the inputs eagerly, never in a graph (replays have context).
    fresh = make_common_attn_metadata([2] * 4, [2] * 4, table[:4], 16)
    assert builder.build(0, fresh).is_fresh_prefill
    assert not builder.build_for_cudagraph_capture(fresh).is_fresh_prefill


# --- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_conformance_kit_on_cuda(dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    report = check_backend(TritonAttentionBackend, "cuda", dtype)
    report.assert_passed()


@pytest.mark.gpu
def test_soft_cap_decodes_on_cuda() -> None:
    pytest.importorskip("triton")
    check_soft_cap_decodes("cuda", torch.float32)


@pytest.mark.gpu
def test_split_kv_forced_and_forbidden_on_cuda() -> None:
    pytest.importorskip("triton")
    for dtype in (torch.float16, torch.float32):
        check_split_kv_forced_and_forbidden("cuda", dtype)


@pytest.mark.gpu
def test_fresh_prefill_from_inputs_on_cuda() -> None:
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm90+")
    for dtype in (torch.float16, torch.float32):
        check_fresh_prefill_from_inputs("cuda", dtype)


def _graph_case(query_lens: list[int], seq_lens: list[int], seed: int):
    return random_batch(
        query_lens, seq_lens, "cuda", torch.bfloat16,
        num_heads=8, num_kv_heads=2, head_size=128, num_blocks=256, generator_seed=seed,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("query_lens", "seq_lens_a", "seq_lens_b"),
    [
        ([1] * 6, [5, 300, 17, 1024, 2, 64], [900, 3, 400, 1, 77, 1500]),  # decode (split-KV)
        ([1, 1, 40, 7], [50, 600, 40, 700], [90, 10, 300, 7]),  # mixed
    ],
)
def test_cuda_graph_capture_and_replay(query_lens, seq_lens_a, seq_lens_b) -> None:
    """Capture forward on batch A's buffers, refill them with batch B (same shape), replay:
    the result equals an eager forward on B."""
    pytest.importorskip("triton")
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    limits = BatchLimits(max_num_reqs=8, max_num_tokens=128, max_model_len=2048)
    builder = TritonAttentionBackend.get_builder_cls()(
        spec, layer_records(spec, ["l0"], num_heads=8), limits, "cuda"
    )
    impl = TritonAttentionBackend.get_impl_cls()(8, 128, 128**-0.5, 2, sinks=torch.randn(8))
    query, kv, qsl, sl, table = _graph_case(query_lens, seq_lens_a, seed=1)
    table = torch.nn.functional.pad(table, (0, 128 - table.shape[1]))  # fixed width
    cm = make_common_attn_metadata(query_lens, seq_lens_a, table, 16, "cuda")
    cm = dataclasses.replace(cm, query_start_loc=qsl, seq_lens=sl, block_table_tensor=table)
    md = builder.build_for_cudagraph_capture(cm)
    output = torch.zeros_like(query)
    impl.forward(None, query, None, None, kv, md, output)  # warm-up: compiles, sizes buffers
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, query, None, None, kv, md, output)
    query_b, kv_b, _, sl_b, table_b = _graph_case(query_lens, seq_lens_b, seed=2)
    query.copy_(query_b)
    kv.copy_(kv_b)
    sl.copy_(sl_b)
    table.zero_()
    table[:, : table_b.shape[1]] = table_b
    graph.replay()
    cm_b = make_common_attn_metadata(query_lens, seq_lens_b, table, 16, "cuda")
    cm_b = dataclasses.replace(cm_b, query_start_loc=qsl, seq_lens=sl, block_table_tensor=table)
    eager = torch.zeros_like(query)
    impl.forward(None, query, None, None, kv, builder.build(0, cm_b), eager)
    torch.testing.assert_close(output, eager, atol=2e-2, rtol=2e-2)
    assert output.abs().sum() > 0


@pytest.mark.gpu
def test_cache_over_2_pow_31_elements() -> None:
    """70,000 blocks of 16 x 8 x 128 (K and V: 2.3e9 elements): requests whose blocks lie past
    element 2^31 read the right data (32-bit offsets would wrap)."""
    pytest.importorskip("triton")
    num_blocks, heads, kv_heads, size = 70_000, 32, 8, 128
    try:
        kv = torch.empty(num_blocks, 2, 16, kv_heads, size, dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 4.6 GB cache")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tail = torch.arange(num_blocks - 64, num_blocks, device="cuda", dtype=torch.int32)
    kv[tail.long()] = torch.randn(64, 2, 16, kv_heads, size, generator=gen, device="cuda").to(
        kv.dtype
    )
    assert tail[0].item() * 2 * 16 * kv_heads * size > 2**31
    table = tail.view(2, 32)
    query = torch.randn(3, heads, size, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32, device="cuda")
    sl = torch.tensor([512, 500], dtype=torch.int32, device="cuda")
    params = UnifiedAttentionParams(scale=size**-0.5)
    out, ref = torch.zeros_like(query), torch.zeros(query.shape, device="cuda")
    unified_attention(query, kv, out, qsl, sl, table, 2, 2, params)
    unified_attention_ref(query, kv, ref, qsl, sl, table, 2, params)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    # Run by test_kernels_under_interpreter with TRITON_INTERPRET=1.
    failed = run_interpreter_cases()
    for failure in failed:
        print(failure, file=sys.stderr)
    sys.exit(1 if failed else 0)
