"""FLEX_ATTENTION: the conformance kit on the CPU (compiled FlexAttention) and, marked `gpu`, on
CUDA; recompiles bounded over steps of changing sizes; tile masks exactly; declarations and
selection.

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
from torch.utils._python_dispatch import TorchDispatchMode

from anyattn import selector
from anyattn.backends import flex_attention
from anyattn.backends import flex_attention_masks as masks
from anyattn.backends import flex_attention_plan as plan
from anyattn.backends.flex_attention import (
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadataBuilder,
)
from anyattn.backends.flex_attention_masks import make_rows_plan
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
    layer_records,
    run_case,
)
from anyattn.types import AttentionCGSupport, DeviceInfo, KVCacheLayout


class RecordOps(TorchDispatchMode):
    """Records the ops dispatched while active (`ops`: their names), views aside: a view only
    makes new metadata on the host. With `device_type`, only ops touching a tensor there."""

    def __init__(self, device_type: str | None = None):
        super().__init__()
        self.device_type = device_type
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, result) if isinstance(a, torch.Tensor)]
        is_view = any(r.alias_info is not None for r in func._schema.returns)
        on_device = self.device_type is None or any(
            t.device.type == self.device_type for t in tensors
        )
        if on_device and not is_view:
            self.ops.append(str(func))
        return result


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
        # every score mod at once, in DESIGN.md's order, with a window and sinks
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

# The first step compiles: on CUDA it has to hold decodes (the decode layout's graph) and
# longer queries (the rows' graph), so that every later step can reuse both.
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
    # the rows: a row per token after the leading single-token requests (the decode layout)
    lens = case.spec.query_lens
    leading = next((i for i, n in enumerate(lens) if n != 1), len(lens))
    rows = plan.pad_rows(sum(lens) - leading)
    return rows, plan.pad_keys(1 + sum(case.spec.seq_lens))


def _paged_graphs() -> int:
    """Compiled functions of the paged decode (CUDA), one static graph each."""
    return sum(1 for config, _ in flex_attention._COMPILED if "paged" in config)


def _assert_recompiles_bounded(device: str, dtype: torch.dtype, head_size: int = 64) -> None:
    cases = [dataclasses.replace(case, head_size=head_size) for case in _step_cases()]
    assert len({_padded_shapes(c) for c in cases}) >= 6, "steps must differ in padded size"
    first, *rest = cases
    # The first step may compile (or reuse the kit's graph of the same configuration).
    (result,) = run_case(FlexAttentionBackend, first, device, dtype)
    assert result.passed, result
    graphs, paged = counters["stats"]["unique_graphs"], _paged_graphs()
    for case in rest:
        (result,) = run_case(FlexAttentionBackend, case, device, dtype)
        assert result.passed, result
    # On CUDA the paged decode compiles one static graph per batch bucket and cache geometry
    # (each kit case has a cache of its own); nothing else may compile again.
    new_paged = _paged_graphs() - paged
    recompiles = counters["stats"]["unique_graphs"] - graphs - new_paged
    assert recompiles == 0, f"{recompiles} recompiles over {len(rest)} steps of other sizes"


@needs_flex
def test_steps_of_other_sizes_do_not_recompile():
    _assert_recompiles_bounded("cpu", torch.float32)


def _workspace_kv(md, kv_heads: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the step's float32 CPU workspace, as the forward hands them to the kernel."""
    shape = (kv_heads, md.kv_rows_padded, size)
    cpu = torch.device("cpu")
    return tuple(
        flex_attention._as_kernel_rows(md.workspace.get(name, shape, torch.float32, cpu)[None], cpu)
        for name in "kv"
    )


def _count_graphs(monkeypatch) -> list:
    """The graphs the backend's attention calls compile from now on, traced by an eager
    backend that only counts them (no Inductor): the list fills as they compile."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(flex_attention._attend, dynamic=True, fullgraph=True, backend=counting)
    monkeypatch.setattr(flex_attention, "_compiled_attend", lambda config, with_lse: compiled)
    return graphs


@needs_flex
@pytest.mark.parametrize(("kv_heads", "batches"), [(2, (8, 10)), (4, (4, 10))])
def test_decode_batches_are_tied_to_no_other_size(monkeypatch, kv_heads, batches):
    """The decode layout's first call has a batch equal to another size it sees: 8 decodes of
    8 query heads (passing a view of the caller's query, as an earlier version did when no
    padding was needed, made torch.compile guard on that tensor's sizes), or 4 decodes over 4
    KV heads (the keys' head count, symbolic on the CPU until marked static); the next 10
    decodes reuse its graph. Traced with an eager backend that counts graphs: no Inductor."""
    graphs = _count_graphs(monkeypatch)
    torch._dynamo.reset()
    heads, size = 8, 16
    impl = FlexAttentionImpl(heads, size, 0.25, kv_heads)
    spec = AttentionSpec(16, kv_heads, size, torch.float32)
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["l"]), BatchLimits(64, 4096, 4096), "cpu"
    )
    cpu = torch.device("cpu")
    for n in batches:
        seq_lens = list(range(5, 5 + n))
        table = (torch.arange(n * 4) + 1).int().view(n, 4)
        md = builder.build(0, make_common_attn_metadata([1] * n, seq_lens, table, 16))
        decode_plan, rows_plan = impl._plans(md, False, cpu)
        assert rows_plan is None and decode_plan.batch == n
        k, v = _workspace_kv(md, kv_heads, size)
        query = torch.randn(n, heads, size)
        output = torch.zeros_like(query)
        mods = impl._mods_on(cpu)
        impl._attend_decodes(query, k, v, md, decode_plan, mods, ("cpu",), output, None)
    assert len(graphs) == 1


@needs_flex
def test_rows_with_per_head_mods_do_not_tie_a_tile_count_to_the_heads(monkeypatch):
    """The rows' ALiBi slopes are `[H, 1]`; with H = 4 and a first step of 512 rows (4 tiles of
    the CUDA form, used here on the CPU) an unmarked head size would share the tile count's
    symbol and steps of 256 and 1024 rows would compile again. Traced with an eager backend
    that counts graphs: no Inductor needed."""
    graphs = _count_graphs(monkeypatch)
    tiled = flex_attention._as_kernel_rows
    monkeypatch.setattr(
        flex_attention, "_as_kernel_rows", lambda rows, device: tiled(rows, torch.device("cuda"))
    )
    torch._dynamo.reset()
    heads, kv_heads, size = 4, 2, 16
    impl = FlexAttentionImpl(heads, size, 0.25, kv_heads, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])
    spec = AttentionSpec(16, kv_heads, size, torch.float32)
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["l"]), BatchLimits(4, 4096, 4096), "cpu"
    )
    cpu = torch.device("cpu")
    for tokens, rows in ((400, 512), (200, 256), (1000, 1024)):
        table = (torch.arange(64) + 1).int().view(1, 64)
        md = builder.build(0, make_common_attn_metadata([tokens], [tokens], table, 16))
        decode_plan, rows_plan = impl._plans(md, False, cpu)
        assert decode_plan is None and rows_plan.num_rows == rows
        k, v = _workspace_kv(md, kv_heads, size)
        query = torch.randn(tokens, heads, size)
        output = torch.zeros_like(query)
        mods = impl._mods_on(cpu)
        impl._attend_rows(query, k, v, md, rows_plan, mods, ("cpu",), output, None)
    assert len(graphs) == 1


def test_buckets_are_few_and_never_tie_rows_to_keys():
    rows = {plan.pad_rows(n) for n in range(1, 1 << 16, 7)}
    assert len(rows) <= 6 + 8 * 3  # powers of two to 8192, then eighths of each octave
    for n in range(1, 1 << 15, 13):
        assert n <= plan.pad_rows(n) <= max(2 * n, 2 * plan.TILE)
        assert plan.pad_rows(n) % (2 * plan.TILE) == 0
        # keys: an odd number of tiles, so never equal to a row count or a tile count of rows
        assert plan.pad_keys(n) >= n and (plan.pad_keys(n) // plan.TILE) % 2 == 1


# --- tile masks ------------------------------------------------------------------------------


def _keep_brute(lo, hi, group, shape, has_sink):
    """bool `[rows, keys]` over the padded grid: the keys each query row keeps."""
    keep = np.zeros((shape[0] * plan.TILE, shape[1] * plan.TILE), dtype=bool)
    for t in range(lo.shape[0]):
        keep[t * group : (t + 1) * group, lo[t] : hi[t] + 1] = True
        if has_sink:
            keep[t * group : (t + 1) * group, 0] = True
    return keep


def _tile_masks_brute(lo, hi, group, shape, has_sink):
    """`(partial, full)`: a full tile keeps all its keys (key tile 0, the sink slot's, is never
    called full), a partial one some of them."""
    keep = _keep_brute(lo, hi, group, shape, has_sink)
    tiles = keep.reshape(shape[0], plan.TILE, shape[1], plan.TILE)
    full = tiles.all(axis=(1, 3))
    full[:, 0] = False
    return tiles.any(axis=(1, 3)) & ~full, full


def _block_lists_reference(tiles):
    """FlexAttention's lists of a bool tile mask: a stable argsort puts marked tiles first."""
    num = tiles.sum(axis=1, dtype=np.int32)
    indices = np.argsort(~tiles, axis=1, kind="stable").astype(np.int32)
    return num[None, None], indices[None, None]


def _check_tiles(lo, hi, layout, group, has_sink):
    """tile_runs, tile_masks and block_lists of one step against the brute force, exactly."""
    num_rows = plan.pad_rows(lo.shape[0] * group)
    shape = (num_rows // plan.TILE, plan.pad_keys(layout.num_key_rows) // plan.TILE)
    runs = plan.tile_runs(lo, hi, layout.query_start_loc, group, has_sink)
    masks = plan.tile_masks(lo, hi, layout.query_start_loc, group, shape, has_sink)
    expected = _tile_masks_brute(lo, hi, group, shape, has_sink)
    for marked, mask, want in zip(runs, masks, expected, strict=True):
        # The kept keys of consecutive tokens of a request are contiguous ranges, so the tiles
        # visited are exactly those with a kept key, and a full tile has no masked entry.
        assert np.array_equal(mask, want)
        # runs: sorted by row tile, then key tile; apart (neither overlapping nor touching)
        tile, first, last = marked.tile, marked.first, marked.last
        same_tile = tile[1:] == tile[:-1]
        assert (tile[1:] >= tile[:-1]).all() and (first <= last).all()
        assert (first[1:][same_tile] > last[:-1][same_tile] + 1).all()
        want_num, want_indices = _block_lists_reference(want)
        out = np.full(shape[0], -1, dtype=np.int32), np.full(shape[0] * shape[1], -1, np.int32)
        for lists in (plan.block_lists(marked, shape), plan.block_lists(marked, shape, out)):
            num, indices = lists
            assert num.dtype == indices.dtype == np.int32
            assert num.shape == (1, 1, shape[0]) and indices.shape == (1, 1, *shape)
            assert np.array_equal(num, want_num) and np.array_equal(indices, want_indices)
        assert np.shares_memory(num, out[0]) and np.shares_memory(indices, out[1])


@pytest.mark.parametrize("seed", range(6))
def test_tile_masks_visit_exactly_the_tiles_with_kept_keys(seed):
    rng = np.random.default_rng(seed)
    group = int(rng.choice([1, 3, 4, 8]))
    query_lens = rng.integers(1, 90, size=int(rng.integers(1, 6)))
    contexts = rng.integers(0, 400, size=query_lens.shape[0])
    causal, window = bool(rng.integers(2)), (int(rng.integers(1, 200)) if seed % 2 else None)
    start = np.concatenate(([0], np.cumsum(query_lens)))
    layout = plan.lay_out_step(start, query_lens + contexts, contexts)
    lo = plan.window_lo(layout, window if causal else None)
    hi = layout.hi_causal if causal else layout.hi_full
    _check_tiles(lo, hi, layout, group, has_sink=seed % 3 == 0)


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 300), st.integers(0, 300)), max_size=6
    ),
    decodes=st.booleans(),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    mode=st.sampled_from(["causal", "window", "bidirectional", "cross"]),
    window=st.integers(1, 300),
    has_sink=st.booleans(),
)
def test_tile_runs_and_block_lists_match_the_brute_force(
    requests, decodes, group, mode, window, has_sink
):
    # (query tokens, context, encoder keys) per request; requests without query tokens too
    query_lens = np.array([1 if decodes else q for q, _, _ in requests], dtype=np.int64)
    contexts = np.array([c for _, c, _ in requests], dtype=np.int64)
    key_lens = query_lens + contexts
    if mode == "cross":
        key_lens = np.array([e for _, _, e in requests], dtype=np.int64)
    start = np.concatenate(([0], np.cumsum(query_lens)))
    layout = plan.lay_out_step(start, key_lens, contexts)
    lo = plan.window_lo(layout, window if mode == "window" else None)
    hi = layout.hi_causal if mode in ("causal", "window") else layout.hi_full
    _check_tiles(lo, hi, layout, group, has_sink)


def test_fresh_prefills_keep_the_causal_diagonal_on_tile_boundaries():
    """Keys start one tile into the workspace (row 0 is the sink slot): fresh prefills visit
    the tiles FlexAttention visits over the same keys packed from row 0, one key tile on, so
    no row tile gets a second partly masked tile next to its diagonal."""
    query_lens = np.array([256, 200, 300])
    start = np.concatenate(([0], np.cumsum(query_lens)))
    layout = plan.lay_out_step(start, query_lens, np.zeros(3, np.int64))
    row_tiles = -(-int(start[-1]) // plan.TILE)
    key_tiles = -(-layout.num_key_rows // plan.TILE)
    partial, full = plan.tile_masks(
        layout.lo, layout.hi_causal, start, 1, (row_tiles, key_tiles), has_sink=False
    )
    # the same requests over keys packed from row 0 (what kernels.prepare_flex lays out)
    shift = plan.FIRST_KEY_ROW
    packed_partial, packed_full = plan.tile_masks(
        layout.lo - shift, layout.hi_causal - shift, start, 1, (row_tiles, key_tiles - 1),
        has_sink=False,
    )  # fmt: skip
    assert not partial[:, 0].any() and not full[:, 0].any()
    assert np.array_equal(partial[:, 1:], packed_partial)
    assert np.array_equal(full[:, 1:], packed_full)
    # request 0's two row tiles: each partly masks only its diagonal, key tile (row tile + 1)
    assert [np.flatnonzero(partial[t]).tolist() for t in (0, 1)] == [[1], [2]]


def _plan_batch():
    """A mixed step (decodes, a fresh and a chunked prefill) and its metadata."""
    table = (torch.randperm(200)[: 5 * 17] + 1).int().view(5, 17)
    return make_common_attn_metadata([1, 1, 37, 1, 200], [9, 260, 37, 129, 260], table, 16)


def _block_mask_lists(block_mask):
    return (
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
    )


# (causal, window, group, has_sink); group 3 does not divide the rows, 16 is the broadcast fill
_PLAN_SETTINGS = ((True, None, 4, False), (True, 33, 3, True), (False, None, 16, True))


def test_plan_tensors_exactly():
    """The plan's mask, positions, query heads and block lists, exactly."""
    md = _builder().build(0, _plan_batch())
    layout, num_keys = md.layout, md.kv_rows_padded
    for causal, window, group, has_sink in _PLAN_SETTINGS:
        made = make_rows_plan(md, causal, window, group, has_sink, torch.device("cpu"))
        lo = plan.window_lo(layout, window)
        hi = layout.hi_causal if causal else layout.hi_full
        num_rows, used = made.num_rows, md.num_actual_tokens * group
        assert num_rows == plan.pad_rows(used)
        shape = (num_rows // plan.TILE, num_keys // plan.TILE)
        keep = _keep_brute(lo, hi, group, shape, has_sink)
        keep[:, 0] |= has_sink  # padding rows too: they see the sink only
        rows, keys = torch.arange(num_rows)[:, None], torch.arange(num_keys)[None, :]
        assert np.array_equal(made.block_mask.mask_mod(0, 0, rows, keys).numpy(), keep)
        position = np.zeros(num_rows, dtype=np.int32)
        position[:used] = np.repeat(layout.q_key_pos, group)
        assert made.q_key_pos.dtype == made.group_index.dtype == torch.int32
        assert np.array_equal(made.q_key_pos.numpy(), position)
        assert np.array_equal(made.group_index.numpy(), np.arange(num_rows) % group)
        lists = _block_mask_lists(made.block_mask)
        partial, full = _tile_masks_brute(lo, hi, group, shape, has_sink)
        expected = (*_block_lists_reference(partial), *_block_lists_reference(full))
        for tensor, want in zip(lists, expected, strict=True):
            assert tensor.dtype == torch.int32 and np.array_equal(tensor.numpy(), want)
        # Inductor's CPU template fails on tensors at symbolic storage offsets (see make_rows_plan)
        assert all(t.storage_offset() == 0 for t in (*lists, made.q_key_pos, made.group_index))


def test_rows_plan_without_the_decodes_keys_is_the_plan_of_the_other_requests_alone():
    """With the leading decodes read in place (CUDA), the rows' keys are the other requests'
    alone, from the workspace's first key row: the same plan as for a step of those requests,
    and a workspace sized for their keys, not for every decode's too."""
    full = _plan_batch()  # decodes of 9 and 260 keys, then a prefill, a decode, a chunk
    md = _builder().build(0, full)
    rest = make_common_attn_metadata([37, 1, 200], [37, 129, 260], full.block_table_tensor[2:], 16)
    md_rest = _builder().build(0, rest)
    assert md.layout.num_decodes == 2
    assert plan.skipping_keys(md.layout, 0) == (0, md.kv_rows_padded)
    assert plan.skipping_keys(md.layout, 2) == (9 + 260, md_rest.kv_rows_padded)
    every_key = md.layout.num_key_rows - plan.FIRST_KEY_ROW
    assert plan.skipping_keys(md.layout, 5) == (every_key, plan.pad_keys(plan.FIRST_KEY_ROW))
    assert md_rest.layout.num_key_rows == md.layout.num_key_rows - (9 + 260)
    cpu = torch.device("cpu")
    for causal, window, group, has_sink in _PLAN_SETTINGS:
        made = make_rows_plan(
            md, causal, window, group, has_sink, cpu, first_token=2, keys_skipped=True
        )
        want = make_rows_plan(md_rest, causal, window, group, has_sink, cpu)
        assert made.first_token == 2 and made.num_rows == want.num_rows
        tensors = (*_block_mask_lists(made.block_mask), made.q_key_pos, made.group_index)
        expected = (*_block_mask_lists(want.block_mask), want.q_key_pos, want.group_index)
        for tensor, value in zip(tensors, expected, strict=True):
            assert torch.equal(tensor, value)
        rows = torch.arange(made.num_rows)[:, None]
        keys = torch.arange(md_rest.kv_rows_padded)[None, :]
        assert torch.equal(
            made.block_mask.mask_mod(0, 0, rows, keys), want.block_mask.mask_mod(0, 0, rows, keys)
        )


@needs_flex
@pytest.mark.parametrize("window", [None, 20])
def test_rows_over_the_other_requests_keys_alone_match_the_forward(monkeypatch, window):
    """A mixed step whose decodes read the cache in place (CUDA only) copies only the other
    requests' keys, from the workspace's first key row, and shifts their plan: here on the CPU,
    those rows (`_load_kv` skipping the decodes, `keys_skipped`) against the forward's, which
    copies every key. FlexAttention runs eagerly (no Inductor) in both."""
    eager = {False: flex_attention._attend, True: flex_attention._attend_with_lse}
    monkeypatch.setattr(
        flex_attention, "_compiled_attend", lambda config, with_lse, dynamic=True: eager[with_lse]
    )
    # three decodes (one of 300 keys), a fresh prefill, a request without tokens, a chunk
    query_lens, seq_lens = [1, 1, 1, 37, 0, 20], [9, 300, 129, 37, 0, 150]
    gen = torch.Generator().manual_seed(0)
    table = (torch.randperm(299, generator=gen)[:120] + 1).int().view(6, 20)
    spec = AttentionSpec(16, 2, 16, torch.float32)
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["l"]), BatchLimits(64, 4096, 4096), "cpu"
    )
    md = builder.build(0, make_common_attn_metadata(query_lens, seq_lens, table, 16))
    cache = torch.randn(300, 2, 16, 2, 16, generator=gen)
    layer = KitLayer("l", torch.ones(()), torch.ones(()))
    impl = FlexAttentionImpl(4, 16, 0.25, 2, sliding_window=window, logits_soft_cap=30.0)
    query = torch.randn(sum(query_lens), 4, 16, generator=gen)
    output = torch.zeros_like(query)
    impl.forward(layer, query, None, None, cache, md, output)
    cpu, skip = torch.device("cpu"), md.layout.num_decodes
    k, v = (
        flex_attention._as_kernel_rows(x[None], cpu)
        for x in impl._load_kv(layer, None, None, cache, md, torch.float32, skip)
    )
    key_offset, kv_rows = plan.skipping_keys(md.layout, skip)
    assert (skip, key_offset) == (3, 9 + 300 + 129) and k.shape[2] == kv_rows < md.kv_rows_padded
    rows = make_rows_plan(md, True, window, 1, False, cpu, first_token=skip, keys_skipped=True)
    mods = impl._mods_on(cpu)
    config = ("cpu", torch.float32, 16, 4, 2, *sorted(mods))
    alone = torch.zeros_like(query)
    impl._attend_rows(query, k, v, md, rows, mods, config, alone, None)
    torch.testing.assert_close(alone[skip:], output[skip:], rtol=0, atol=1e-6)
    assert not alone[:skip].any()


def test_plan_off_the_cpu_copies_one_host_buffer():
    """Off the CPU (the meta device stands in for a GPU here) the plan fills one host buffer
    and copies each of its sections once, to tensors of their own at storage offset 0."""
    md = _builder().build(0, _plan_batch())
    for causal, window, group, has_sink in _PLAN_SETTINGS:
        with RecordOps() as seen:
            made = make_rows_plan(md, causal, window, group, has_sink, torch.device("meta"))
        # the host buffer, then one copy per tensor (the compute_q fallback transposes the
        # lists too)
        if masks.FROM_KV_BLOCKS_TAKES_COMPUTE_Q:
            assert seen.ops == ["aten.empty.memory_format"] + ["aten._to_copy.default"] * 8
        tensors = (*_block_mask_lists(made.block_mask), made.q_key_pos, made.group_index)
        on_cpu = make_rows_plan(md, causal, window, group, has_sink, torch.device("cpu"))
        want = (*_block_mask_lists(on_cpu.block_mask), on_cpu.q_key_pos, on_cpu.group_index)
        assert [t.shape for t in tensors] == [t.shape for t in want]
        assert all(t.device.type == "meta" and t.dtype == torch.int32 for t in tensors)
        assert all(t.storage_offset() == 0 for t in tensors)


def test_lay_out_step_exactly():
    # a decode at position 19 of 20 keys, a fresh prefill of 3, a chunk of 2 after 4 keys
    layout = plan.lay_out_step(np.array([0, 1, 4, 6]), np.array([20, 3, 6]), np.array([19, 0, 4]))
    # row 0: the sink slot; the keys from row 128 (one tile on), in workspace coordinates
    assert plan.FIRST_KEY_ROW == plan.TILE == 128
    assert layout.num_key_rows == 128 + 20 + 3 + 6
    assert layout.lo.tolist() == [128, 148, 148, 148, 151, 151]
    assert layout.q_key_pos.tolist() == [147, 148, 149, 150, 155, 156]
    assert layout.hi_causal.tolist() == layout.q_key_pos.tolist()
    assert layout.hi_full.tolist() == [147, 150, 150, 150, 156, 156]
    assert layout.key_start.tolist() == [128, 148, 151]
    assert plan.window_lo(layout, 2).tolist() == [146, 148, 148, 149, 154, 155]
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
    # single-token requests at the front: one here, then none (a request with no token first)
    assert layout.num_decodes == same.num_decodes == 1 and empty.num_decodes == 0
    assert (
        plan.lay_out_step(np.array([0, 0, 1]), np.array([3, 4]), np.array([3, 3])).num_decodes == 0
    )


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
def test_decode_batches_are_padded_to_sizes_of_their_own(group):
    for n in range(0, 300):
        padded = plan.pad_decodes(n, group)
        assert padded >= max(n, 2) and padded % 2 == 0 and padded - n <= 5
        # never size 1, the query length, the tile size or a key tile count (odd): sizes
        # torch.compile would specialise or tie to the batch
        assert padded not in (1, group, plan.TILE)
        assert padded != (plan.pad_keys(n + 1) // plan.TILE)


def _decode_tiles_brute(lo, hi, has_sink, key_tiles):
    """`(partial, full)` bool `[batch, key_tiles]`: entry b keeps rows lo[b] ... hi[b] (none
    when lo > hi), and row 0 with a sink; a full tile keeps all its rows, tile 0 never."""
    keep = np.zeros((lo.shape[0], key_tiles * plan.TILE), dtype=bool)
    for b in range(lo.shape[0]):
        keep[b, lo[b] : hi[b] + 1] = True
        keep[b, 0] |= has_sink
    tiles = keep.reshape(lo.shape[0], key_tiles, plan.TILE)
    full = tiles.all(axis=2)
    full[:, 0] = False
    return tiles.any(axis=2) & ~full, full


@settings(max_examples=200, deadline=None)
@given(
    ranges=st.lists(st.tuples(st.integers(1, 1500), st.integers(-1, 700)), min_size=1, max_size=8),
    has_sink=st.booleans(),
)
def test_decode_block_lists_match_the_brute_force(ranges, has_sink):
    # (first kept row, kept rows - 1); -1: an entry that keeps nothing (batch padding, or a
    # cross attention without encoder keys)
    lo = np.array([first for first, _ in ranges], dtype=np.int32)
    hi = np.array([first + extra for first, extra in ranges], dtype=np.int32)
    key_tiles = int(hi.max() // plan.TILE + 2)
    want = _decode_tiles_brute(lo, hi, has_sink, key_tiles)
    batch = lo.shape[0]
    out = tuple(np.full(n, -1, np.int32) for n in (batch, batch * key_tiles) * 2)
    for lists in (
        plan.decode_block_lists(lo, hi, has_sink, key_tiles),
        plan.decode_block_lists(lo, hi, has_sink, key_tiles, out=out),
    ):
        for (num, indices), tiles in zip((lists[:2], lists[2:]), want, strict=True):
            assert num.dtype == indices.dtype == np.int32
            assert num.shape == (batch, 1, 1) and indices.shape == (batch, 1, 1, key_tiles)
            assert num.reshape(-1).tolist() == tiles.sum(axis=1).tolist()
            for b in range(batch):
                listed = indices[b, 0, 0]
                # the marked tiles first, in increasing order; every entry a valid tile
                assert listed[: num[b, 0, 0]].tolist() == np.flatnonzero(tiles[b]).tolist()
                assert ((listed >= 0) & (listed < key_tiles)).all()
    assert all(np.shares_memory(a, b) for a, b in zip(lists, out, strict=True))


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
    decodes=st.booleans(),
    dtype=st.sampled_from([np.int32, np.int64]),
)
def test_lay_out_step_random_batches(lens, decodes, dtype):
    # single-token decodes (the fast path) or any query lengths, zero included
    query_lens = [1 if decodes else q for q, _ in lens]
    contexts = [c for _, c in lens]
    key_lens = [q + c for q, c in zip(query_lens, contexts, strict=True)]
    start = np.concatenate([[0], np.cumsum(query_lens, dtype=np.int64)]).astype(dtype)
    layout = plan.lay_out_step(start, np.array(key_lens, dtype), np.array(contexts, dtype))
    lo, hi_full, q_key_pos = _lay_out_by_hand(query_lens, key_lens, contexts)
    assert layout.num_key_rows == plan.FIRST_KEY_ROW + sum(key_lens)
    for name, expected in (("lo", lo), ("hi_full", hi_full), ("q_key_pos", q_key_pos)):
        assert getattr(layout, name).dtype == np.int64
        assert getattr(layout, name).tolist() == expected
    assert layout.hi_causal.tolist() == q_key_pos
    first = plan.FIRST_KEY_ROW
    assert layout.key_start.tolist() == [first + sum(key_lens[:r]) for r in range(len(key_lens))]
    leading = next((r for r, q in enumerate(query_lens) if q != 1), len(query_lens))
    assert layout.num_decodes == leading
    if decodes and lens:
        # the general path: the same batch with a trailing request of no tokens and no keys
        general = plan.lay_out_step(
            np.append(start, start[-1]),
            np.array([*key_lens, 0], dtype),
            np.array([*contexts, 0], dtype),
        )
        assert general.num_key_rows == layout.num_key_rows
        for name in ("lo", "hi_causal", "hi_full", "q_key_pos"):
            x, y = getattr(layout, name), getattr(general, name)
            assert x.dtype == y.dtype and np.array_equal(x, y)
        assert np.array_equal(layout.key_start, general.key_start[:-1])


# --- the builder -----------------------------------------------------------------------------


def _builder(block_size: int = 16) -> FlexAttentionMetadataBuilder:
    spec = AttentionSpec(block_size, 2, 64, torch.float32)
    return FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["layer.0"]), BatchLimits(64, 4096, 4096), "cpu"
    )


def test_builder_reads_only_cpu_mirrors():
    """Device tensors on the meta device hold no values: any read of them would raise. The
    builder only passes the device's block table and key lengths on (no device work at all);
    each layer's forward copies the keys (ops/gather_kv_rows, tested exactly on its own)."""
    table = (torch.randperm(40)[:12] + 1).view(4, 3).int()
    cm = make_common_attn_metadata([1, 1, 9, 4], [20, 33, 9, 40], table, 16, device="meta")
    md = _builder().build(0, cm)
    assert md.layout.num_key_rows == 128 + 20 + 33 + 9 + 40
    assert md.block_table is cm.block_table_tensor and md.max_key_len == 40
    assert md.key_lens.device.type == "meta" and md.key_lens.shape == (4,)
    assert md.kv_rows_padded == plan.pad_keys(230)
    # request 2 (a fresh prefill of 9) keeps workspace rows from 128 + 20 + 33 = 181 on
    assert md.layout.lo[2] == 181 and md.layout.q_key_pos[2:11].tolist() == list(range(181, 190))
    assert md.layout.key_start.tolist() == [128, 148, 181, 190]
    # cross attention: the keys are the encoder's
    cm = make_common_attn_metadata(
        [1, 2], [5, 2], table[:2], 16, device="meta", causal=False, encoder_seq_lens=[7, 30]
    )
    md = _builder().build(0, cm)
    assert md.layout.num_key_rows == 128 + 7 + 30 and md.max_key_len == 30
    assert md.key_lens.shape == (2,) and md.layout.hi_full.tolist() == [134, 164, 164]


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


# --- on the GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_conforms_on_cuda(dtype):
    report = _conforms("cuda", dtype)
    # Everything but cascade runs on CUDA, sinks and LSE included.
    assert [e.split(":")[0] for e in report.not_declared] == ["cascade"], report.summary()


@pytest.mark.gpu
# (128: the rows' own launch on sm90, flex_attention_launch.rows_kernel_options)
@pytest.mark.parametrize("head_size", [16, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_other_head_sizes_on_cuda(head_size, dtype):
    case = Case(f"head_size{head_size}", "head_sizes", get_spec("mixed"), head_size=head_size)
    case_lse = dataclasses.replace(case, name=f"{case.name}_sinks", use_sinks=True, check_lse=True)
    for result in run_case(FlexAttentionBackend, case, "cuda", dtype) + run_case(
        FlexAttentionBackend, case_lse, "cuda", dtype
    ):
        assert result.passed, result


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    ("query_lens", "num_decodes"),
    [((1, 1, 1), 3), ((1, 1, 37, 1, 200), 2), ((37, 1, 1), 0), ((1, 200), 1)],
)
def test_leading_decodes_take_the_decode_layout(query_lens, num_decodes, device):
    """Each leading single-token request is one batch entry of the decode layout; the other
    tokens go to the rows (the kit checks the numbers: it orders decodes first)."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = [
        q + int(c)
        for q, c in zip(
            query_lens, torch.randint(0, 300, (len(query_lens),), generator=gen), strict=True
        )
    ]
    table = (torch.randperm(40 * len(seq_lens), generator=gen) + 1).int().view(len(seq_lens), 40)
    cm = make_common_attn_metadata(list(query_lens), seq_lens, table, 16, device=device)
    spec = AttentionSpec(16, 2, 64, torch.bfloat16)
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["layer.0"]), BatchLimits(64, 4096, 4096), device
    )
    assert builder.reorder_batch_threshold == 1  # the engine and the kit put decodes first
    md = builder.build(0, cm)
    impl = FlexAttentionImpl(8, 64, 0.125, 2)
    decode_plan, rows_plan = impl._plans(md, False, torch.device(device))
    assert md.layout.num_decodes == num_decodes
    if num_decodes:
        assert decode_plan.num_decodes == num_decodes
        assert decode_plan.batch == plan.pad_decodes(num_decodes, 4)
        num = decode_plan.block_mask.kv_num_blocks + decode_plan.block_mask.full_kv_num_blocks
        # padding entries visit nothing; each request its own key tiles only
        assert num[num_decodes:].sum().item() == 0
        want = [-(-(seq_lens[r] + 1) // plan.TILE) + 1 for r in range(num_decodes)]
        assert all(num[r].item() <= want[r] for r in range(num_decodes))
    else:
        assert decode_plan is None
    tokens = sum(query_lens)
    if tokens > num_decodes:
        assert rows_plan.first_token == num_decodes
        assert rows_plan.num_rows == plan.pad_rows(tokens - num_decodes)  # a row per token
    else:
        assert rows_plan is None


def _record_buffers_and_nan_padding(monkeypatch) -> list[str]:
    """Patches FLEX_ATTENTION so that every forward fills the query's padding rows with NaN
    first (an engine's padding may hold anything), and returns the list that every workspace
    buffer request appends its name to."""
    requested = []
    get = flex_attention._Workspace.get

    def recording(self, name, *args, **kwargs):
        requested.append(name)
        return get(self, name, *args, **kwargs)

    monkeypatch.setattr(flex_attention._Workspace, "get", recording)
    forward = FlexAttentionImpl.forward

    def nan_padding(self, layer, query, key, value, kv_cache, md, *args, **kwargs):
        query[md.num_actual_tokens :] = math.nan
        return forward(self, layer, query, key, value, kv_cache, md, *args, **kwargs)

    monkeypatch.setattr(FlexAttentionImpl, "forward", nan_padding)
    return requested


@needs_flex
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rows_read_a_query_of_whole_tiles_as_it_is(device, monkeypatch):
    """A step without leading decodes whose query holds the padded rows (a bucket's tokens, or
    the engine's padding past them) is read in place, the padding rows whatever they hold; a
    shorter query or one after decodes is copied. Every step matches the float64 oracle and
    recompiles nothing."""
    requested = _record_buffers_and_nan_padding(monkeypatch)
    assert plan.pad_rows(256) == 256 and plan.pad_rows(200) == 256
    steps = (  # (spec, padding tokens, whether the query is copied)
        (BatchSpec("bucket", (100, 156), (150, 186)), 0, False),
        (BatchSpec("padded", (90, 110), (90, 140)), 56, False),
        (BatchSpec("short", (90, 110), (90, 140)), 0, True),
        (BatchSpec("after_decode", (1, 255), (40, 300)), 0, True),
    )
    # The first step may compile (the kit's float32 run compiles its configuration anyway);
    # the steps of rows alone after it compile nothing, read in place or copied (the last
    # step's decode is another compiled function).
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    graphs = []
    for spec, padding, copied in steps:
        requested.clear()
        case = Case(f"rows_in_place/{spec.name}", "padding", spec, num_padding_tokens=padding)
        (result,) = run_case(FlexAttentionBackend, case, device, dtype)
        assert result.passed, result
        assert ("query" in requested) == copied, spec.name
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2]


@needs_flex
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decodes_read_a_query_covering_their_padded_batch_as_it_is(device, monkeypatch):
    """The decodes' queries are read in place where the caller's query has a row for every
    entry of the padded decode batch (the tokens after the decodes, or the engine's padding,
    whatever it holds), and copied where it has fewer. Every step matches the float64 oracle;
    a step read in place compiles nothing a copied step of the same bucket did not."""
    requested = _record_buffers_and_nan_padding(monkeypatch)
    seen = []  # (query rows, padded decode batch) per call
    decode_queries = FlexAttentionImpl._decode_queries

    def spying(self, query, md, n, batch):
        seen.append((query.shape[0], batch))
        return decode_queries(self, query, md, n, batch)

    monkeypatch.setattr(FlexAttentionImpl, "_decode_queries", spying)
    # (spec, padding tokens): 3 decodes pad to a batch of 4 on both devices (G = 2), which the
    # padded step's 6 query rows cover; the first two steps differ in their padding alone
    # (the paged decode's graph is static in the batch and in the block lists' width, which
    # follows the longest request)
    steps = (
        (BatchSpec("short", (1, 1, 1), (40, 50, 60)), 0),
        (BatchSpec("padded", (1, 1, 1), (40, 50, 60)), 3),
        (BatchSpec("then_a_prefill", (1, 1, 37), (40, 50, 80)), 0),
    )
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    graphs, in_place = [], []
    for spec, padding in steps:
        requested.clear()
        seen.clear()
        case = Case(f"decodes_in_place/{spec.name}", "padding", spec, num_padding_tokens=padding)
        (result,) = run_case(FlexAttentionBackend, case, device, dtype)
        assert result.passed, result
        ((rows, batch),) = set(seen)  # one decode batch per step, whatever the layer
        assert ("decode_query" in requested) == (rows < batch), spec.name
        in_place.append(rows >= batch)
        graphs.append(counters["stats"]["unique_graphs"])
    assert in_place == [False, True, True]
    assert graphs[0] == graphs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128])  # 128: the rows' own launch on sm90
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
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["layer.0"]), limits, torch.device("cuda")
    )
    builder.build(0, cm)  # first build may allocate and warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = builder.build(0, cm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert md.key_lens.device.type == "cuda" and md.layout.num_key_rows == plan.FIRST_KEY_ROW + sum(
        seq_lens
    )


# Issue 6: host time of one build for the decode batch below, median of many.
@pytest.mark.gpu
def test_decode_batch_build_launches_nothing_on_the_device():
    """256 decodes of 2048 keys (block size 16, 8 KV heads, bf16): build never waits for the
    GPU and runs no device op at all, views aside (its host time is measured in
    benchmarks/kernels.py)."""
    num_reqs, seq_len, block_size = 256, 2048, 16
    width = seq_len // block_size
    gen = torch.Generator().manual_seed(0)
    table = (torch.randperm(num_reqs * width, generator=gen) + 1).int().view(num_reqs, width)
    cm = make_common_attn_metadata(
        [1] * num_reqs, [seq_len] * num_reqs, table, block_size, device="cuda"
    )
    spec = AttentionSpec(block_size, 8, 128, torch.bfloat16)
    limits = BatchLimits(num_reqs, 8192, 4096)
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["layer.0"]), limits, torch.device("cuda")
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with RecordOps("cuda") as seen:
            md = builder.build(0, cm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert md.layout.num_key_rows == plan.FIRST_KEY_ROW + num_reqs * seq_len
    assert md.max_key_len == seq_len
    assert seen.ops == []


@pytest.mark.gpu
def test_plan_copies_one_pinned_buffer_on_cuda():
    """On CUDA the plan's tensors are copies of the sections of one pinned host buffer (one
    copy each, no other device op), with the values of the CPU plan (test_conforms_on_cuda
    runs the kernel on them)."""
    cm = _plan_batch()
    md_cpu = _builder().build(0, cm)
    cm_cuda = make_common_attn_metadata(
        [1, 1, 37, 1, 200], [9, 260, 37, 129, 260], cm.block_table_tensor, 16, device="cuda"
    )
    spec = AttentionSpec(16, 2, 64, torch.float32)
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["layer.0"]), BatchLimits(64, 4096, 4096), "cuda"
    )
    md = builder.build(0, cm_cuda)
    for causal, window, group, has_sink in _PLAN_SETTINGS:
        with RecordOps("cuda") as seen:
            made = make_rows_plan(md, causal, window, group, has_sink, torch.device("cuda"))
        copies = [op for op in seen.ops if "copy" in op]
        assert copies == ["aten._to_copy.default"] * 8, seen.ops
        if masks.FROM_KV_BLOCKS_TAKES_COMPUTE_Q:  # (else it transposes the lists)
            assert len(seen.ops) == 8, seen.ops
        want = make_rows_plan(md_cpu, causal, window, group, has_sink, torch.device("cpu"))
        tensors, want_tensors = (
            (*_block_mask_lists(p.block_mask), p.q_key_pos, p.group_index) for p in (made, want)
        )
        assert all(t.storage_offset() == 0 for t in tensors)
        for tensor, expected in zip(tensors, want_tensors, strict=True):
            assert tensor.is_cuda and tensor.dtype == torch.int32
            assert tensor.shape == expected.shape and torch.equal(tensor.cpu(), expected)
            assert tensor.data_ptr() % 64 == 0  # aligned: Inductor copies misaligned inputs
        rows = torch.arange(made.num_rows, device="cuda")[:, None]
        keys = torch.arange(md.kv_rows_padded, device="cuda")[None, :]
        assert torch.equal(
            made.block_mask.mask_mod(0, 0, rows, keys).cpu(),
            want.block_mask.mask_mod(0, 0, rows.cpu(), keys.cpu()),
        )


def test_layout_keeps_its_own_copy_of_the_step():
    """The engine refills its mirrors for the next step before this step's first forward
    reads the layout: the layout must not share their memory."""
    loc, key_lens, context = np.array([0, 1, 2]), np.array([5, 9]), np.array([4, 8])
    layout = plan.lay_out_step(loc, key_lens, context)
    before = (layout.query_start_loc.copy(), layout.key_lens.copy())
    loc[:], key_lens[:], context[:] = 7, 7, 7
    assert np.array_equal(layout.query_start_loc, before[0])
    assert np.array_equal(layout.key_lens, before[1])


def test_builder_refuses_more_requests_than_the_key_gather_takes():
    from anyattn.ops.gather_kv_rows import MAX_NUM_REQS

    spec = AttentionSpec(16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="max_num_reqs"):
        FlexAttentionMetadataBuilder(
            spec, layer_records(spec, ["l"]), BatchLimits(MAX_NUM_REQS + 1, 1 << 17, 64), "cpu"
        )
