"""FLEX_ATTENTION: the conformance kit on the CPU (compiled FlexAttention) and, marked `gpu`, on
CUDA; recompiles bounded over steps of changing sizes; block lists exactly; the frozen metadata
and its refusal of unplanned layers; declarations and selection.

Compilation dominates the CPU time (about 40 s for the first graph of a cold process, 7-8 s for
each further one). The backend keeps its compiled functions for the whole process, so the
tests below stay on configurations the fp32 kit run compiles anyway wherever they can.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from anyattn import selector
from anyattn.backend import LayerParams
from anyattn.backends import flex_attention
from anyattn.backends import flex_attention_builder as plan
from anyattn.backends.flex_attention import (
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadataBuilder,
)
from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits
from anyattn.metadata import make_common_attn_metadata
from anyattn.registry import AttentionBackendEnum
from anyattn.testing import (
    BatchSpec,
    Case,
    ConformanceReport,
    KitLayer,
    build_batch,
    check_backend,
    get_spec,
    run_case,
)
from anyattn.types import AttentionCGSupport, AttentionType, DeviceInfo, KVCacheLayout

needs_flex = pytest.mark.skipif(
    FlexAttentionBackend.get_unavailable_reason() is not None,
    reason=f"FLEX_ATTENTION unavailable: {FlexAttentionBackend.get_unavailable_reason()}",
)

# What the CPU cannot run: LSE (Inductor's CPU template has none; the kit's sinks case checks
# the LSE, so sinks run below without it) and cascade (not declared).
_CPU_NOT_DECLARED = ("sinks: case sinks", "lse: case mixed_lse", "cascade:")


def _conforms(device: str, dtype: torch.dtype, features=None) -> ConformanceReport:
    report = check_backend(FlexAttentionBackend, device, dtype, features=features)
    report.assert_passed()
    return report


# --- the kit on the CPU ----------------------------------------------------------------------


@needs_flex
def test_conforms_on_cpu_float32():
    report = _conforms("cpu", torch.float32)
    assert len(report.not_declared) == len(_CPU_NOT_DECLARED), report.summary()
    for entry, prefix in zip(sorted(report.not_declared), sorted(_CPU_NOT_DECLARED), strict=True):
        assert entry.startswith(prefix), report.summary()


@needs_flex
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_conforms_on_cpu_half_precision(dtype):
    # One graph per dtype: a decode-heavy mix and the odd lengths up to 1025 keys.
    _conforms("cpu", dtype, features=["mixed", "odd_lengths"])


@needs_flex
@pytest.mark.parametrize(
    "case",
    [
        Case("sinks", "sinks", get_spec("mixed"), use_sinks=True),
        # every score mod at once, in docs/semantics.md's order, with a window and sinks
        Case(
            "all_mods",
            "sinks",
            get_spec("odd_lengths"),
            use_sinks=True,
            use_alibi=True,
            logits_soft_cap=2.0,
            sliding_window=7,
        ),
    ],
    ids=lambda c: c.name,
)
def test_sinks_on_cpu_without_lse(case):
    (result,) = run_case(FlexAttentionBackend, case, "cpu", torch.float32)
    assert result.passed, result


# --- recompiles ------------------------------------------------------------------------------

# Steps of other sizes and kinds (decodes, chunks, prefills, many requests): after the first
# compiles, none may compile again.
_SIZED_STEPS = (
    BatchSpec("chunk_and_decodes", (300, 1, 1, 9), (2500, 17, 1200, 40)),
    BatchSpec("one_decode", (1,), (5,)),
    BatchSpec("decodes", (1,) * 8, (10, 300, 700, 1000, 33, 64, 129, 2000)),
    BatchSpec("prefill", (200,), (200,)),
    BatchSpec("long_prefill", (900,), (900,)),
    BatchSpec("many_decodes", (1,) * 40, tuple(range(3, 1203, 30))),
)


def _step_cases() -> list[Case]:
    cases = [Case(f"sized/{spec.name}", "decode", spec) for spec in _SIZED_STEPS]
    # Masks are data, not code: a window and bidirectional attention reuse the same graph.
    chunk = get_spec("chunked_prefill")
    cases.append(Case("sized/window", "sliding_window", chunk, sliding_window=33))
    cases.append(Case("sized/non_causal", "non_causal", chunk, causal=False))
    return cases


def _padded_shapes(case: Case) -> tuple[int, int]:
    lens = case.spec.query_lens
    return plan.pad_rows(sum(lens)), plan.pad_keys(plan.FIRST_KEY_ROW + sum(case.spec.seq_lens))


def _assert_recompiles_bounded(device: str, dtype: torch.dtype, head_size: int = 64) -> None:
    cases = [dataclasses.replace(case, head_size=head_size) for case in _step_cases()]
    assert len({_padded_shapes(c) for c in cases}) >= 5, "steps must differ in padded size"
    first, *rest = cases
    # The first step may compile (or reuse the kit's graph of the same configuration).
    (result,) = run_case(FlexAttentionBackend, first, device, dtype)
    assert result.passed, result
    graphs = counters["stats"]["unique_graphs"]
    for case in rest:
        (result,) = run_case(FlexAttentionBackend, case, device, dtype)
        assert result.passed, result
    recompiles = counters["stats"]["unique_graphs"] - graphs
    assert recompiles == 0, f"{recompiles} recompiles over {len(rest)} steps of other sizes"


@needs_flex
def test_steps_of_other_sizes_do_not_recompile():
    _assert_recompiles_bounded("cpu", torch.float32)


def _count_graphs(monkeypatch) -> list:
    """The graphs the backend's attention calls compile from now on, traced by an eager
    backend that only counts them (no Inductor): the list fills as they compile."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(flex_attention._attend, dynamic=True, fullgraph=True, backend=counting)
    monkeypatch.setattr(flex_attention, "_compiled", lambda config, with_lse: compiled)
    return graphs


@needs_flex
def test_per_head_mods_do_not_tie_a_size_to_the_heads(monkeypatch):
    """ALiBi slopes and sinks are `[H]`; with H = 4 an unmarked head count would share a
    symbol with an equal size of the first step (4 row tiles of 512 rows, in the CUDA form,
    used here on the CPU), and steps of 256 and 1024 rows would compile again. Traced with an
    eager backend that counts graphs (no Inductor); each step matches the float64 oracle."""
    graphs = _count_graphs(monkeypatch)

    kernel_rows = flex_attention._kernel_rows
    # the CUDA form, whose tile count is a size of its own
    monkeypatch.setattr(flex_attention, "_kernel_rows", lambda rows, _: kernel_rows(rows, True))
    torch._dynamo.reset()
    for tokens in (400, 200, 1000):
        spec = BatchSpec(f"prefill{tokens}", (tokens,), (tokens,))
        case = Case(f"tie/{tokens}", "alibi", spec, num_heads=4, num_kv_heads=2, head_size=16,
                    use_alibi=True, use_sinks=True)  # fmt: skip
        (result,) = run_case(FlexAttentionBackend, case, "cpu", torch.float32)
        assert result.passed, result
    assert len(graphs) == 1


def test_buckets_are_few_and_never_tie_rows_to_keys():
    rows = {plan.pad_rows(n) for n in range(1, 1 << 16, 7)}
    assert len(rows) <= 6 + 8 * 3  # powers of two to 8192, then eighths of each octave
    for n in range(1, 1 << 15, 13):
        assert n <= plan.pad_rows(n) <= max(2 * n, 2 * plan.TILE)
        assert plan.pad_rows(n) % (2 * plan.TILE) == 0
        # keys: an odd number of tiles, so never equal to a row count or a tile count of rows
        assert plan.pad_keys(n) >= n and (plan.pad_keys(n) // plan.TILE) % 2 == 1


# --- block lists -----------------------------------------------------------------------------


def _tiles_brute(lo, hi, shape, has_sink):
    """`(partial, full)` bool `[row_tiles, key_tiles]` over the padded grid. A full tile has
    every key kept by every token row of its row tile (padding rows' outputs are never read);
    key tile 0, the sink slot's, is never full; a partial tile has some kept key."""
    n = lo.shape[0]
    keep = np.zeros((shape[0] * plan.TILE, shape[1] * plan.TILE), dtype=bool)
    for t in range(n):
        keep[t, lo[t] : hi[t] + 1] = True
        keep[t, 0] |= has_sink
    tiles = keep.reshape(shape[0], plan.TILE, shape[1], plan.TILE)
    full = np.zeros(shape, dtype=bool)
    for r in range(shape[0]):
        real = min(plan.TILE, n - r * plan.TILE)
        if real > 0:
            full[r] = tiles[r, :real].all(axis=(0, 2))
    full[:, 0] = False
    return tiles.any(axis=(1, 3)) & ~full, full


def _check_lists(lo, hi, layout, has_sink):
    num_rows, num_keys = plan.pad_rows(lo.shape[0]), plan.pad_keys(layout.num_key_rows)
    shape = (num_rows // plan.TILE, num_keys // plan.TILE)
    lists = plan.block_lists(lo, hi, layout.query_start_loc, has_sink, num_rows, num_keys)
    for (num, indices), want in zip((lists[:2], lists[2:]), _tiles_brute(lo, hi, shape, has_sink),
                                    strict=True):  # fmt: skip
        assert num.dtype == indices.dtype == np.int32
        assert num.shape == (1, 1, shape[0]) and indices.shape == (1, 1, *shape)
        # FlexAttention's lists: the marked tiles first, in increasing order, then the others
        assert num[0, 0].tolist() == want.sum(axis=1).tolist()
        expected = np.argsort(~want, axis=1, kind="stable")
        assert np.array_equal(indices[0, 0], expected)


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(0, 300)), max_size=6
    ),
    decodes=st.booleans(),
    mode=st.sampled_from(["causal", "window", "bidirectional", "cross"]),
    window=st.integers(1, 300),
    has_sink=st.booleans(),
)
def test_block_lists_match_the_brute_force(requests, decodes, mode, window, has_sink):
    # (query tokens, context, encoder keys) per request; requests without query tokens too
    query_lens = np.array([1 if decodes else q for q, _, _ in requests], dtype=np.int64)
    contexts = np.array([c for _, c, _ in requests], dtype=np.int64)
    key_lens = query_lens + contexts
    if mode == "cross":
        key_lens = np.array([e for _, _, e in requests], dtype=np.int64)
    start = np.concatenate(([0], np.cumsum(query_lens)))
    layout = plan.lay_out_step(start, key_lens, contexts)
    causal = mode in ("causal", "window")
    lo, hi = plan.row_bounds(layout, causal, window if mode == "window" else None)
    _check_lists(lo, hi, layout, has_sink)


def test_fresh_prefills_keep_the_causal_diagonal_on_tile_boundaries():
    """Keys start one tile into the workspace (row 0 is the sink slot): a fresh prefill's row
    tile partly masks only its diagonal key tile (row tile + 1), the tiles before it are full."""
    query_lens = np.array([256, 200, 300])
    start = np.concatenate(([0], np.cumsum(query_lens)))
    layout = plan.lay_out_step(start, query_lens, np.zeros(3, np.int64))
    lo, hi = plan.row_bounds(layout, True, None)
    num_rows, num_keys = plan.pad_rows(756), plan.pad_keys(layout.num_key_rows)
    num, indices, full_num, full_indices = plan.block_lists(
        lo, hi, start, False, num_rows, num_keys
    )
    assert [indices[0, 0, t, : num[0, 0, t]].tolist() for t in (0, 1)] == [[1], [2]]
    assert full_num[0, 0, :2].tolist() == [0, 1] and full_indices[0, 0, 1, 0] == 1


def test_lay_out_step_exactly():
    # a decode at position 19 of 20 keys, a fresh prefill of 3, a chunk of 2 after 4 keys
    layout = plan.lay_out_step(np.array([0, 1, 4, 6]), np.array([20, 3, 6]), np.array([19, 0, 4]))
    # row 0: the sink slot; the keys from row 128 (one tile on), in workspace coordinates
    assert plan.FIRST_KEY_ROW == plan.TILE == 128
    assert layout.num_key_rows == 128 + 20 + 3 + 6
    assert layout.lo.tolist() == [128, 148, 148, 148, 151, 151]
    assert layout.q_key_pos.tolist() == [147, 148, 149, 150, 155, 156]
    assert layout.hi_full.tolist() == [147, 150, 150, 150, 156, 156]
    assert layout.key_start.tolist() == [128, 148, 151]
    lo, hi = plan.row_bounds(layout, True, 2)
    assert lo.tolist() == [146, 148, 148, 149, 154, 155]
    assert hi.tolist() == layout.q_key_pos.tolist()
    empty = plan.lay_out_step(np.array([0]), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert empty.num_key_rows == 128 and empty.lo.shape == (0,)
    # int32 mirrors as the builder passes them; a request with no query token this step
    same = plan.lay_out_step(
        np.array([0, 1, 1, 4, 6], np.int32),
        np.array([20, 8, 3, 6], np.int32),
        np.array([19, 8, 0, 4], np.int32),
    )
    assert same.num_key_rows == layout.num_key_rows + 8 and same.key_start.dtype == np.int64
    assert same.lo.tolist() == [128, 156, 156, 156, 159, 159]
    assert same.q_key_pos.tolist() == [p + 8 * (p > 147) for p in layout.q_key_pos.tolist()]
    assert same.hi_full.tolist() == [147, 158, 158, 158, 164, 164]


def _lay_out_by_hand(query_lens, key_lens, contexts):
    """`lay_out_step`'s per-token arrays, one token at a time."""
    lo, hi_full, q_key_pos, row = [], [], [], plan.FIRST_KEY_ROW
    for q, keys, context in zip(query_lens, key_lens, contexts, strict=True):
        for i in range(q):
            lo.append(row)
            hi_full.append(row + keys - 1)
            q_key_pos.append(row + context + i)
        row += keys
    return lo, hi_full, q_key_pos


@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 300)), max_size=10),
    dtype=st.sampled_from([np.int32, np.int64]),
)
def test_lay_out_step_random_batches(lens, dtype):
    query_lens = [q for q, _ in lens]
    contexts = [c for _, c in lens]
    key_lens = [q + c for q, c in zip(query_lens, contexts, strict=True)]
    start = np.concatenate([[0], np.cumsum(query_lens, dtype=np.int64)]).astype(dtype)
    layout = plan.lay_out_step(start, np.array(key_lens, dtype), np.array(contexts, dtype))
    lo, hi_full, q_key_pos = _lay_out_by_hand(query_lens, key_lens, contexts)
    assert layout.num_key_rows == plan.FIRST_KEY_ROW + sum(key_lens)
    for name, expected in (("lo", lo), ("hi_full", hi_full), ("q_key_pos", q_key_pos)):
        assert getattr(layout, name).dtype == np.int64
        assert getattr(layout, name).tolist() == expected
    first = plan.FIRST_KEY_ROW
    assert layout.key_start.tolist() == [first + sum(key_lens[:r]) for r in range(len(key_lens))]


def test_layout_keeps_its_own_copy_of_the_step():
    """The engine refills its mirrors for the next step before this step's first forward
    reads the layout: the layout must not share their memory."""
    loc, key_lens, context = np.array([0, 1, 2]), np.array([5, 9]), np.array([4, 8])
    layout = plan.lay_out_step(loc, key_lens, context)
    before = (layout.query_start_loc.copy(), layout.key_lens.copy())
    loc[:], key_lens[:], context[:] = 7, 7, 7
    assert np.array_equal(layout.query_start_loc, before[0])
    assert np.array_equal(layout.key_lens, before[1])


# --- the builder and its metadata ------------------------------------------------------------


def _params(**changes) -> LayerParams:
    return LayerParams(**{"num_heads": 4, "num_kv_heads": 2, "head_size": 64, "scale": 0.125,
                          **changes})  # fmt: skip


def _builder(block_size: int = 16, device="cpu", **layers) -> FlexAttentionMetadataBuilder:
    spec = AttentionSpec(block_size, 2, 64, torch.float32)
    layers = layers or {"layer.0": _params()}
    return FlexAttentionMetadataBuilder(spec, layers, BatchLimits(64, 4096, 4096), device)


def test_builder_reads_only_cpu_mirrors():
    """Device tensors on the meta device hold no values: any read of them on the host would
    raise. The builder lays the step out from the CPU mirrors."""
    table = (torch.randperm(40)[:12] + 1).view(4, 3).int()
    cm = make_common_attn_metadata([1, 1, 9, 4], [20, 33, 9, 40], table, 16, device="meta")
    md = _builder(device="meta").build(0, cm)
    assert md.layout.num_key_rows == 128 + 20 + 33 + 9 + 40
    assert md.num_keys == plan.pad_keys(230) and md.num_rows == plan.pad_rows(15)
    assert md.key_blocks.device.type == "meta" and md.key_blocks.shape == (102,)
    # request 2 (a fresh prefill of 9) keeps workspace rows from 128 + 20 + 33 = 181 on
    assert md.layout.lo[2] == 181 and md.layout.q_key_pos[2:11].tolist() == list(range(181, 190))
    assert md.layout.key_start.tolist() == [128, 148, 181, 190]
    # cross attention: the keys are the encoder's
    cm = make_common_attn_metadata(
        [1, 2], [5, 2], table[:2], 16, device="meta", causal=False, encoder_seq_lens=[7, 30]
    )
    md = _builder(device="meta").build(0, cm)
    assert md.layout.num_key_rows == 128 + 7 + 30
    assert md.key_blocks.shape == (37,) and md.layout.hi_full.tolist() == [134, 164, 164]


def test_key_slots_follow_the_block_table():
    table = torch.tensor([[7, 3, 9], [4, 1, 2]], dtype=torch.int32)
    cm = make_common_attn_metadata([2, 1], [35, 17], table, 16)
    md = _builder().build(0, cm)
    want_blocks = [7] * 16 + [3] * 16 + [9] * 3 + [4] * 16 + [1]
    assert md.key_blocks.tolist() == want_blocks
    assert md.key_offsets.tolist() == [*range(16), *range(16), *range(3), *range(16), 0]


def test_one_block_mask_per_distinct_mask_and_frozen_metadata():
    """Layers with equal masks share one BlockMask (scale, soft cap and ALiBi are score mods,
    not masks); a window or sinks make one of their own. Encoder layers alone copy no keys."""
    cm = make_common_attn_metadata([3, 1], [3, 9], torch.tensor([[1], [2]]).int(), 16)
    builder = _builder(
        a=_params(), b=_params(scale=0.5, logits_soft_cap=3.0, has_alibi=True),
        c=_params(sliding_window=4), d=_params(has_sinks=True),
    )  # fmt: skip
    md = builder.build(0, cm)
    assert set(md.masks) == {(True, None, False), (True, 4, False), (True, None, True)}
    assert md.layer_names == frozenset("abcd")
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.num_rows = 0
    encoder = _builder(e=_params(attn_type=AttentionType.ENCODER))
    md = encoder.build(0, make_common_attn_metadata([3], [3], torch.tensor([[1]]).int(), 16,
                                                    causal=False))  # fmt: skip
    assert set(md.masks) == {(False, None, False)} and md.key_blocks is None


def test_builder_rejects_cascade_and_narrow_block_tables():
    cm = make_common_attn_metadata([1], [9], torch.tensor([[3]], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="cascade attention not supported"):
        _builder().build(16, cm)
    lens = torch.tensor([40], dtype=torch.int32)  # more keys than the table's one column holds
    cm = dataclasses.replace(
        cm, seq_lens=lens, seq_lens_cpu=lens, num_computed_tokens_cpu=lens - 1, max_seq_len=40
    )
    with pytest.raises(ValueError, match="block_table too narrow"):
        _builder().build(0, cm)


# --- declarations and selection --------------------------------------------------------------


def _config(**changes) -> AttentionSelectorConfig:
    return AttentionSelectorConfig(**{"head_size": 64, "dtype": torch.bfloat16, **changes})


def test_registered_and_selected_after_torch_on_cpu():
    assert AttentionBackendEnum.FLEX_ATTENTION.get_class() is FlexAttentionBackend
    explanation = selector.explain(_config(dtype=torch.float32), DeviceInfo.cpu())
    verdicts = {v.name: v for v in explanation.verdicts}
    assert explanation.chosen == "TORCH"
    assert verdicts["FLEX_ATTENTION"].priority == verdicts["TORCH"].priority + 1
    assert verdicts["FLEX_ATTENTION"].reasons == ()
    picked = selector.select_backend(_config(), DeviceInfo.cpu(), backend="FLEX_ATTENTION")
    assert picked is FlexAttentionBackend


@pytest.mark.parametrize("attn_type", list(AttentionType))
def test_chosen_automatically_on_cuda_for_encoder_and_cross_attention_only(attn_type):
    config = _config(attn_type=attn_type.value)
    automatic = FlexAttentionBackend.chosen_automatically(config, DeviceInfo.cuda(9, 0))
    assert automatic == (attn_type != AttentionType.DECODER)
    assert FlexAttentionBackend.chosen_automatically(config, DeviceInfo.cpu())
    # explicit requests ignore it
    picked = selector.select_backend(config, DeviceInfo.cuda(9, 0), backend="FLEX_ATTENTION")
    assert picked is FlexAttentionBackend


def test_unavailable_reasons_say_what_is_missing_and_how_to_get_it(monkeypatch):
    """Each reason FLEX_ATTENTION cannot run here names the missing piece and what to do."""
    reason = flex_attention._unavailable_reason.__wrapped__
    real_find_spec = flex_attention.importlib.util.find_spec

    def without(missing):
        return lambda name, *a: None if name == missing else real_find_spec(name, *a)

    monkeypatch.setattr(
        flex_attention.importlib.util, "find_spec", without("torch.nn.attention.flex_attention")
    )
    assert "pip install 'torch>=2.5'" in reason()
    monkeypatch.setattr(flex_attention.importlib.util, "find_spec", real_find_spec)
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    assert f"got Python {sys.version_info[0]}.{sys.version_info[1]}" in reason()
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flex_attention.importlib.util, "find_spec", without("triton"))
    assert reason().endswith("pip install triton")


def test_lse_is_declared_for_cuda_only():
    config = _config(needs_lse=True, has_sink=True)
    assert FlexAttentionBackend.validate_configuration(config, DeviceInfo.cuda(9, 0)) == []
    (reason,) = FlexAttentionBackend.validate_configuration(config, DeviceInfo.cpu())
    assert "needs_lse" in reason and "cpu" in reason
    explanation = selector.explain(config, DeviceInfo.cpu())
    flex_verdict = next(v for v in explanation.verdicts if v.name == "FLEX_ATTENTION")
    assert not flex_verdict.fits


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"head_size": 72}, "head_size 72"),
        ({"head_size": 8}, "head_size 8"),
        ({"head_size": 512}, "head_size 512"),
        ({"has_sliding_window": True, "use_non_causal": True}, "sliding window"),
        ({"has_sliding_window": True, "attn_type": "encoder"}, "sliding window"),
        ({"use_mla": True}, "MLA"),
        ({"use_sparse": True}, "sparse"),
        ({"use_batch_invariant": True}, "batch invariance"),
    ],
)
def test_rejected_configurations(changes, fragment):
    reasons = FlexAttentionBackend.validate_configuration(_config(**changes), DeviceInfo.cuda(9))
    assert any(fragment in r for r in reasons), reasons


def test_accepted_configurations_and_declarations():
    for changes in (
        {"head_size": 80},
        {"head_size": 256, "dtype": torch.float32},
        {"kv_cache_dtype": "fp8_e5m2", "use_per_head_quant_scales": True},
        {"has_sink": True, "has_alibi": True, "has_logits_soft_cap": True},
        {"has_sliding_window": True, "block_size": 5},
        {"attn_type": "encoder_decoder"},
        {"use_non_causal": True},
    ):
        for device in (DeviceInfo.cpu(), DeviceInfo.cuda(8, 0), DeviceInfo.cuda(10, 0)):
            config = _config(**changes)
            assert FlexAttentionBackend.validate_configuration(config, device) == [], changes
    too_old = FlexAttentionBackend.validate_configuration(_config(), DeviceInfo.cuda(7, 5))
    assert any("sm75" in r for r in too_old)
    assert FlexAttentionBackend.get_cudagraph_support() is AttentionCGSupport.NEVER
    assert not FlexAttentionBackend.supports_cascade()
    assert FlexAttentionBackend.get_kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 2, 64)
    assert FlexAttentionBackend.get_kv_cache_stride_order(KVCacheLayout.HND) == (0, 1, 3, 2, 4)
    assert FlexAttentionImpl.lse_base_on_e


# --- rejected calls --------------------------------------------------------------------------


def _small_batch():
    return build_batch(
        FlexAttentionBackend,
        BatchSpec("small", (1, 5), (9, 5)),
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float32,
    )


def _impl(**changes) -> FlexAttentionImpl:
    return FlexAttentionImpl(4, 64, 0.125, 2, **changes)


def test_rejected_calls_name_the_problem():
    batch = _small_batch()
    layer = KitLayer("layer.0", batch.k_scale, batch.v_scale)
    args = (layer, batch.query, batch.key, batch.value, batch.kv_cache, batch.attn_metadata)
    output = torch.empty_like(batch.query)
    lse = torch.empty(4, batch.query.shape[0])
    with pytest.raises(NotImplementedError, match="output_lse not supported on cpu"):
        _impl().forward(*args, output, output_lse=lse)
    with pytest.raises(TypeError, match="FlexAttentionMetadataBuilder"):
        _impl().forward(*args[:5], object(), output)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        _impl().forward(*args[:4], batch.kv_cache.half(), batch.attn_metadata, output)
    with pytest.raises(ValueError, match="head_size not supported"):
        FlexAttentionImpl(4, 72, 0.125, 2)
    with pytest.raises(NotImplementedError, match="sliding window with encoder"):
        _impl(sliding_window=8, attn_type="encoder")
    non_causal = dataclasses.replace(batch.attn_metadata, causal=False)
    with pytest.raises(NotImplementedError, match="non-causal"):
        _impl(sliding_window=8).forward(*args[:5], non_causal, output)


def test_forward_refuses_a_layer_the_builder_was_not_given():
    batch = _small_batch()
    layer = KitLayer("not.planned", batch.k_scale, batch.v_scale)
    args = (batch.query, batch.key, batch.value, batch.kv_cache, batch.attn_metadata)
    with pytest.raises(ValueError, match=r"'not\.planned'"):
        _impl().forward(layer, *args, torch.empty_like(batch.query))


# --- on the GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_conforms_on_cuda(dtype):
    report = _conforms("cuda", dtype)
    # Everything but cascade runs on CUDA, sinks and LSE included.
    assert [e.split(":")[0] for e in report.not_declared] == ["cascade"], report.summary()


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [16, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_other_head_sizes_on_cuda(head_size, dtype):
    case = Case(f"head_size{head_size}", "head_sizes", get_spec("mixed"), head_size=head_size)
    case_lse = dataclasses.replace(case, name=f"{case.name}_sinks", use_sinks=True, check_lse=True)
    for result in run_case(FlexAttentionBackend, case, "cuda", dtype) + run_case(
        FlexAttentionBackend, case_lse, "cuda", dtype
    ):
        assert result.passed, result


@needs_flex
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_padding_rows_may_hold_anything(device, monkeypatch):
    """The engine's padding rows past the step's tokens may hold anything (NaN here): the
    real rows match the float64 oracle."""
    forward = FlexAttentionImpl.forward

    def nan_padding(self, layer, query, key, value, kv_cache, md, *args, **kwargs):
        query[md.num_actual_tokens :] = math.nan
        return forward(self, layer, query, key, value, kv_cache, md, *args, **kwargs)

    monkeypatch.setattr(FlexAttentionImpl, "forward", nan_padding)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    spec = BatchSpec("padded", (1, 90, 110), (40, 90, 140))
    case = Case("padding/nan", "padding", spec, num_padding_tokens=56)
    (result,) = run_case(FlexAttentionBackend, case, device, dtype)
    assert result.passed, result


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128])
def test_steps_of_other_sizes_do_not_recompile_on_cuda(head_size):
    _assert_recompiles_bounded("cuda", torch.bfloat16, head_size)


@pytest.mark.gpu
def test_build_never_waits_for_the_gpu():
    gen = torch.Generator().manual_seed(0)
    query_lens = [1] * 200 + [37, 300]
    seq_lens = [int(x) for x in torch.randint(1, 2000, (200,), generator=gen)] + [37, 900]
    width = math.ceil(max(seq_lens) / 16)
    table = (torch.randperm(len(seq_lens) * width, generator=gen) + 1).int().view(-1, width)
    cm = make_common_attn_metadata(query_lens, seq_lens, table, 16, device="cuda")
    spec = AttentionSpec(16, 2, 64, torch.bfloat16)
    limits = BatchLimits(256, 4096, 4096)
    layers = {"a": _params(), "b": _params(sliding_window=100, has_sinks=True)}
    builder = FlexAttentionMetadataBuilder(spec, layers, limits, torch.device("cuda"))
    builder.build(0, cm)  # first build may allocate and warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = builder.build(0, cm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert md.key_blocks.device.type == "cuda" and len(md.masks) == 2
    assert md.layout.num_key_rows == plan.FIRST_KEY_ROW + sum(seq_lens)
