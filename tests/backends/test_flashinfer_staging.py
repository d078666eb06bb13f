"""FLASHINFER's page-locked planner buffers (`flashinfer_staging`): the pool on its own and in
the builder with stand-in events and wrappers (CPU), and on the GPU with FlashInfer 0.7.2.post1
a build made while the device has not yet run the previous step's plan copy (right with the
pool, wrong with FlashInfer's one buffer per wrapper)."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
from flashinfer_gpu import needs_flashinfer

import anyattn.backends.flashinfer as fi_backend
from anyattn.backends.flashinfer import FlashInferBackend, FlashInferImpl, FlashInferMetadataBuilder
from anyattn.backends.flashinfer_staging import PlannerStaging
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing import (
    KitLayer,
    attention_oracle,
    build_batch,
    error_bound,
    max_abs_error,
)
from anyattn.testing.batch_spec import BatchSpec


class FakeEvent:
    """A CUDA event whose completion the test decides (`device_ran`)."""

    def __init__(self):
        self.recorded = False
        self.done = True

    def record(self, stream=None):
        self.recorded, self.done, self.stream = True, False, stream

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class FakeWrapper:
    """A FlashInfer wrapper as the pool and `replan_decode` see it: its workspaces, a CUDA-graph
    decode wrapper's fixed index buffers, and a `plan()` and C++ planner that record the
    page-locked buffer they were given."""

    def __init__(
        self, workspace=None, layout="NHD", use_cuda_graph=False, paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, **kwargs,
    ):  # fmt: skip
        self._float_workspace_buffer = workspace
        self._int_workspace_buffer = torch.empty(64, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.empty(64, dtype=torch.uint8)
        self.is_cuda_graph_enabled = use_cuda_graph
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        if use_cuda_graph:
            self._fixed_batch_size = paged_kv_last_page_len_buffer.shape[0]
        self._cached_module = types.SimpleNamespace(plan=self._cpp_plan)
        self.seen = []

    def plan(self, indptr, *args, **kwargs):
        self.seen.append(self._pin_memory_int_workspace_buffer)
        self._batch_size = indptr.shape[0] - 1  # (as FlashInfer's plan() sets it)

    def _cpp_plan(self, float_workspace, int_workspace, page_locked, *args):
        self.seen.append(page_locked)
        return "plan info"


def events_of(staging):
    return [event for _, event in staging._busy]


def device_ran(staging):
    for event in events_of(staging):
        event.done = True


def test_disabled_pool_leaves_the_wrappers_buffer():
    staging = PlannerStaging(None)
    wrapper = FakeWrapper()
    own = wrapper._pin_memory_int_workspace_buffer
    staging.adopt(wrapper)
    staging.acquire(wrapper)
    staging.release(wrapper)
    assert wrapper._pin_memory_int_workspace_buffer is own and not staging._busy


def test_a_buffer_is_reused_only_after_its_copy_ran():
    staging = PlannerStaging(FakeEvent, lambda: "stream", pin_memory=False)
    wrapper = FakeWrapper()
    own = wrapper._pin_memory_int_workspace_buffer
    staging.adopt(wrapper)
    staging.acquire(wrapper)
    assert wrapper._pin_memory_int_workspace_buffer is own  # the adopted buffer first
    staging.release(wrapper)
    (event,) = events_of(staging)
    assert event.recorded and not event.done
    # the device has not run that copy: the next plan gets a new buffer of the same size
    staging.acquire(wrapper)
    second = wrapper._pin_memory_int_workspace_buffer
    assert second is not own and second.numel() == 64 and staging.buffers_made == 1
    staging.release(wrapper)
    device_ran(staging)
    staging.acquire(wrapper)
    assert any(wrapper._pin_memory_int_workspace_buffer is b for b in (own, second))
    staging.release(wrapper)
    assert staging.buffers_made == 1
    staging.release(wrapper)  # no acquire before it: nothing to mark
    assert len(staging._busy) == 1


def test_buffers_come_back_in_the_order_their_events_were_recorded():
    staging = PlannerStaging(FakeEvent, lambda: "stream", pin_memory=False)
    a, b = FakeWrapper(), FakeWrapper()
    for wrapper in (a, b):
        staging.adopt(wrapper)
    for wrapper in (a, b):
        staging.acquire(wrapper)
        staging.release(wrapper)
    (older, first), (_, second) = staging._busy
    first.done = True  # only the older copy ran
    staging.acquire(a)
    assert a._pin_memory_int_workspace_buffer is older and staging.buffers_made == 0
    assert not second.done and len(staging._busy) == 1
    staging.acquire(b)  # the other buffer's copy is still in flight: a new one
    assert b._pin_memory_int_workspace_buffer is not older and staging.buffers_made == 1


@pytest.fixture
def staged_cpu_builder(monkeypatch):
    """A CPU builder whose wrappers are `FakeWrapper`s and whose pool records `FakeEvent`s."""
    fake = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=FakeWrapper,
        BatchPrefillWithRaggedKVCacheWrapper=FakeWrapper,
        BatchPrefillWithPagedKVCacheWrapper=FakeWrapper,
    )
    monkeypatch.setattr(fi_backend, "_import_flashinfer", lambda: fake)
    monkeypatch.setattr(FlashInferMetadataBuilder, "_prefill_kernels", lambda self: "fa2")
    spec = AttentionSpec(16, 2, 64, torch.bfloat16)
    builder = FlashInferMetadataBuilder(spec, {}, BatchLimits(8, 512, 256), "cpu")
    builder._staging = PlannerStaging(FakeEvent, lambda: "stream", pin_memory=False)
    builder._layer_keys.setdefault(FlashInferImpl(4, 64, 0.125, 2).plan_key, None)
    return builder


TABLE = torch.arange(1, 41, dtype=torch.int32).view(8, 5)


def test_every_plan_of_a_build_gets_a_buffer_no_copy_still_reads(staged_cpu_builder):
    builder = staged_cpu_builder
    # decodes, a fresh prefill and a prefill with context: all three wrappers plan
    cm = make_common_attn_metadata([1, 1, 5, 17], [40, 3, 70, 17], TABLE[:4], 16)
    planned = builder.build(0, cm).step.planned[next(iter(builder._layer_keys))]
    wrappers = planned.wrappers()
    assert len(wrappers) == 3 and all(len(w.seen) == 1 for w in wrappers)
    first = [w.seen[0] for w in wrappers]
    assert len({id(b) for b in first}) == 3 and builder._staging.buffers_made == 0
    # one event recorded after each plan, on the stream FlashInfer copies on
    assert [event.stream for event in events_of(builder._staging)] == ["stream"] * 3
    assert all(w._pin_memory_int_workspace_buffer is None for w in wrappers)  # between plans
    # the device has run none of those copies: the next build's plans get other buffers
    builder.build(0, cm)
    second = [w.seen[1] for w in wrappers]
    assert not {id(b) for b in second} & {id(b) for b in first}
    assert builder._staging.buffers_made == 3
    device_ran(builder._staging)
    builder.build(0, cm)  # now every buffer is free again: none is added
    third = [w.seen[2] for w in wrappers]
    assert {id(b) for b in third} <= {id(b) for b in first + second}
    assert builder._staging.buffers_made == 3


def test_replanned_and_cuda_graph_decodes_are_staged_too(staged_cpu_builder, monkeypatch):
    # `replan_decode` hands FlashInfer's C++ planner the buffer itself: the steady-state path
    monkeypatch.setattr(fi_backend, "can_replan", lambda wrapper, version: True)
    builder = staged_cpu_builder
    key = next(iter(builder._layer_keys))
    md = builder.build(0, make_common_attn_metadata([1] * 3, [40, 3, 70], TABLE[:3], 16))
    eager = md.step.planned[key].decode
    capture = make_common_attn_metadata([1] * 4, [1, 2, 3, 17], TABLE[:4], 16)
    graph = builder.build_for_cudagraph_capture(capture).step.planned[key].decode
    assert graph.is_cuda_graph_enabled and graph is not eager
    # a replay step of the captured size, none of the earlier copies run yet
    replay = make_common_attn_metadata([1] * 4, [5, 6, 7, 40], TABLE[:4], 16)
    assert builder.build(0, replay).cudagraph_size == 4
    assert builder.fast_decode_plans == 3 and len(eager.seen) == 1 and len(graph.seen) == 2
    seen = [*eager.seen, *graph.seen]
    assert all(b is not None for b in seen) and len({id(b) for b in seen}) == 3
    assert len(builder._staging._busy) == 3


def test_past_max_buffers_a_plan_waits_for_the_oldest_copy():
    staging = PlannerStaging(FakeEvent, lambda: None, pin_memory=False, max_buffers=2)
    wrapper = FakeWrapper()
    own = wrapper._pin_memory_int_workspace_buffer
    staging.adopt(wrapper)
    for _ in range(2):  # the adopted buffer, then one more: two in flight
        staging.acquire(wrapper)
        staging.release(wrapper)
    assert staging.buffers_made == 1 and staging.waits == 0
    staging.acquire(wrapper)
    assert wrapper._pin_memory_int_workspace_buffer is own and staging.waits == 1
    assert staging.buffers_made == 1 and len(staging._busy) == 1


def test_a_failed_plan_still_returns_its_buffer(staged_cpu_builder, monkeypatch):
    builder = staged_cpu_builder
    monkeypatch.setattr(FakeWrapper, "plan", lambda self, *a, **k: 1 / 0)
    cm = make_common_attn_metadata([1, 1], [40, 3], TABLE[:2], 16)
    with pytest.raises(ZeroDivisionError):
        builder.build(0, cm)
    assert not builder._staging._held and len(builder._staging._busy) == 1


def test_an_unsplit_eager_decode_schedule_is_kept_while_the_batch_size_is(
    staged_cpu_builder, monkeypatch
):
    """With the planner's split limit at 4 requests (4 SMs, 2 KV heads), eager decode steps of
    one size >= 4 are planned once (by FlashInfer's plan() or its C++ planner): later ones
    only get their index buffers (and stage no page-locked buffer). Smaller batches are
    planned every step. So is a CUDA-graph size below the limit; one at it is planned without
    splits at its capture, and its replays keep that schedule."""
    # as FlashInfer has it: a wrapper is re-planned once its own plan() has set it up
    monkeypatch.setattr(fi_backend, "can_replan", lambda wrapper, version: bool(wrapper.seen))
    builder = staged_cpu_builder
    builder._num_sms = 4
    key = next(iter(builder._layer_keys))

    def decodes(seq_lens):
        n = len(seq_lens)
        md = builder.build(0, make_common_attn_metadata([1] * n, seq_lens, TABLE[:n], 16))
        return md.step.planned[key].decode

    wrapper = decodes([40, 3, 70, 17, 5])  # FlashInfer's plan() (it sets the wrapper up)
    assert len(wrapper.seen) == 1 and builder.kept_decode_schedules == 0
    decodes([41, 4, 71, 18, 6])  # kept: the schedule of this size is planned
    busy = len(builder._staging._busy)
    decodes([42, 5, 72, 19, 75])  # the longest request changes: the same schedule
    assert len(wrapper.seen) == 1 and builder.kept_decode_schedules == 2
    assert len(builder._staging._busy) == busy  # nothing staged
    assert wrapper._paged_kv_indptr_buf.tolist() == [0, 3, 4, 9, 11, 16]
    assert wrapper._paged_kv_indices_buf[:16].tolist() == [
        *TABLE[0, :3],
        TABLE[1, 0],
        *TABLE[2, :5],
        *TABLE[3, :2],
        *TABLE[4, :5],
    ]
    assert (wrapper._batch_size, wrapper._max_kv_len) == (5, 75)
    for seq_lens, planner_runs in [
        ([40, 3, 70, 17, 5, 9], 2),  # another size: the C++ planner
        ([41, 4, 71, 18, 6, 10], 2),  # kept again
        ([40, 3, 70], 3),  # fewer requests than the split limit: always planned
        ([41, 4, 71], 4),
    ]:
        assert decodes(seq_lens) is wrapper and len(wrapper.seen) == planner_runs, seq_lens
    assert builder.kept_decode_schedules == 3
    plans = []
    recording = FakeWrapper.plan

    def plan(self, *args, **kwargs):
        plans.append(kwargs)
        recording(self, *args, **kwargs)

    monkeypatch.setattr(FakeWrapper, "plan", plan)
    builder.limits = dataclasses.replace(builder.limits, cudagraph_capture_sizes=(3, 4))
    for size, replays_planned in ((3, 3), (4, 1)):
        capture = make_common_attn_metadata([1] * size, [1, 2, 3, 17][:size], TABLE[:size], 16)
        graph = builder.build_for_cudagraph_capture(capture).step.planned[key].decode
        for _ in range(2):
            lens = [5, 6, 7, 40][:size]
            md = builder.build(0, make_common_attn_metadata([1] * size, lens, TABLE[:size], 16))
            assert md.step.planned[key].decode is graph
        assert len(graph.seen) == replays_planned, size
        # FlashInfer's plan() of the capture: splits allowed below the limit, not at it
        assert plans[-1]["disable_split_kv"] is (size == 4)
    assert builder.kept_decode_schedules == 5
    assert graph._paged_kv_indptr_buf.tolist() == [0, 1, 2, 3, 6]
    assert graph._paged_kv_last_page_len_buf.tolist() == [5, 6, 7, 8]


def test_a_kept_schedule_makes_no_host_arrays(staged_cpu_builder, monkeypatch):
    """A step whose decodes keep their schedule plans from the device layout alone: the
    decode wrapper's host arrays (its C++ planner's input) are not made; a step whose
    planner runs makes them."""
    monkeypatch.setattr(fi_backend, "can_replan", lambda wrapper, version: bool(wrapper.seen))
    builder = staged_cpu_builder
    builder._num_sms = 4
    steps = [builder.build(0, make_common_attn_metadata([1] * 5, lens, TABLE[:5], 16)).step
             for lens in ([40, 3, 70, 17, 5], [41, 4, 71, 18, 6], [42, 5, 72, 19, 75])]  # fmt: skip
    assert builder.kept_decode_schedules == 2
    # (the first: FlashInfer's plan() sets the wrapper up, from the host arrays)
    assert [step.arrays.decode is None for step in steps] == [False, True, True]
    assert steps[2].decode_layout.indptr.tolist() == [0, 3, 4, 9, 11, 16]


def test_graph_steps_planned_again_remake_the_shared_index_buffers(staged_cpu_builder, monkeypatch):
    """Every layer signature's CUDA-graph decode wrapper of a size reads one set of index
    buffers, which each build writes. A forward on older metadata plans its step again and
    writes its layout back; a forward of the newer step then finds the buffers not its own
    and writes them again, for every signature (layers of two steps interleaved)."""
    monkeypatch.setattr(fi_backend, "can_replan", lambda wrapper, version: bool(wrapper.seen))
    builder = staged_cpu_builder
    builder.limits = dataclasses.replace(builder.limits, cudagraph_capture_sizes=(4,))
    builder._layer_keys.setdefault(
        FlashInferImpl(4, 64, 0.25, 2).plan_key, None
    )  # a second signature
    keys = list(builder._layer_keys)
    builder.build_for_cudagraph_capture(
        make_common_attn_metadata([1] * 4, [1, 2, 3, 17], TABLE[:4], 16)
    )
    older = builder.build(0, make_common_attn_metadata([1] * 4, [5, 6, 7, 40], TABLE[:4], 16))
    newer = builder.build(0, make_common_attn_metadata([1] * 4, [33, 6, 7, 8], TABLE[:4], 16))
    want = {id(older): [0, 1, 2, 3, 6], id(newer): [0, 3, 4, 5, 6]}
    for md, key in [(older, keys[0]), (newer, keys[1]), (older, keys[1]), (newer, keys[0]),
                    (newer, keys[1]), (older, keys[0])]:  # fmt: skip
        decode = builder.planned(md, key).decode
        assert decode._paged_kv_indptr_buf.tolist() == want[id(md)], (md is older, key)


def test_eager_steps_built_further_ahead_than_the_ring_get_their_layout_again(
    staged_cpu_builder, monkeypatch
):
    """Eager layouts are made into `RING` buffers in turn: a forward on metadata up to
    `RING - 1` builds old finds its layout where it was made; an older one's buffer holds a
    newer step's, so its layout is made again, into memory of its own, leaving the newer
    step's as it was."""
    from anyattn.backends.flashinfer_layouts import RING

    monkeypatch.setattr(fi_backend, "can_replan", lambda wrapper, version: bool(wrapper.seen))
    builder = staged_cpu_builder
    key = next(iter(builder._layer_keys))
    lens = [[40 + i, 3, 70, 17 + 16 * (i % 2), 5] for i in range(RING + 1)]
    mds = [builder.build(0, make_common_attn_metadata([1] * 5, x, TABLE[:5], 16)) for x in lens]
    first, second, newest = mds[0].step, mds[1].step, mds[-1].step
    assert first.decode_layout.home == newest.decode_layout.home  # the ring came round
    assert not builder._layout_current(first) and builder._layout_current(second)
    want = [0, 3, 4, 9, 11, 12]
    decode = builder.planned(mds[0], key).decode
    assert first.decode_layout.home is None  # made again, in memory of its own
    assert decode._paged_kv_indptr_buf.tolist() == want
    assert newest.decode_layout.indptr.tolist() == want  # (lens[-1][3] is 17 + 16 * 0)
    decode = builder.planned(mds[1], key).decode
    assert mds[1].step.decode_layout is second.decode_layout  # still in its ring buffer
    assert decode._paged_kv_indptr_buf.tolist() == [0, 3, 4, 9, 12, 13]


def test_a_failed_decode_plan_keeps_no_schedule(staged_cpu_builder, monkeypatch):
    monkeypatch.setattr(fi_backend, "can_replan", lambda wrapper, version: True)
    builder = staged_cpu_builder
    builder._num_sms = 4
    lens = [40, 3, 70, 17, 5]
    cm = make_common_attn_metadata([1] * 5, lens, TABLE[:5], 16)
    for _ in range(2):
        md = builder.build(0, cm)  # planned, then its schedule kept
    md.step.planned[next(iter(builder._layer_keys))].decode._cached_module.plan = lambda *a: 1 / 0
    other = make_common_attn_metadata([1] * 6, [*lens, 9], TABLE[:6], 16)
    with pytest.raises(ZeroDivisionError):
        builder.build(0, other)
    # the wrapper's schedule is now neither the old one nor a new one: it is planned again
    with pytest.raises(ZeroDivisionError):
        builder.build(0, cm)
    assert builder.kept_decode_schedules == 1


# --- GPU ------------------------------------------------------------------------------------


HEADS, KV_HEADS, HEAD_SIZE = 8, 2, 128
SCALE = HEAD_SIZE**-0.5
# few long decodes: FlashInfer's planner splits their keys into chunks, so a schedule made for
# other lengths is a different one
LONG_DECODES = BatchSpec("long_decodes", (1,) * 4, (3000, 1500, 4000, 700))


@needs_flashinfer
@pytest.mark.parametrize("pooled", [True, False], ids=["pool", "flashinfers_own_buffer"])
def test_a_build_ahead_of_the_device_leaves_the_last_steps_schedule(monkeypatch, pooled):
    # the planned decode wrapper (XQA plans nothing): its plan's copy to the device is the one
    # a build made too early would overwrite. Without the pool (each wrapper's one buffer, as
    # FlashInfer has it) the same steps must go wrong, or the test would not see the race.
    monkeypatch.setattr(FlashInferMetadataBuilder, "decode_kernel", "wrapper")
    if not pooled:
        monkeypatch.setattr(PlannerStaging, "is_enabled", property(lambda self: False))
    batch = build_batch(
        FlashInferBackend, LONG_DECODES, num_heads=HEADS, num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE, dtype=torch.bfloat16, device="cuda", seed=3,
    )  # fmt: skip
    impl = FlashInferImpl(HEADS, HEAD_SIZE, SCALE, KV_HEADS)
    layer = KitLayer("layer.0", batch.k_scale, batch.v_scale)
    cm, builder = batch.common_attn_metadata, batch.builder
    builder._layer_keys.setdefault(impl.plan_key, None)
    impl.do_kv_cache_update(layer, batch.key, batch.value, batch.kv_cache, cm.slot_mapping)

    def forward(md):
        output = torch.full_like(batch.query, math.nan)
        impl.forward(layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output)
        return output

    forward(builder.build(0, cm))  # compiles, makes the wrapper
    n = cm.num_reqs
    halves = ((cm.seq_lens_cpu[:n] + 1) // 2).tolist()
    later = make_common_attn_metadata([1] * n, halves, batch.block_table[:n], batch.block_size,
                                      device="cuda")  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # the device falls behind: this step's copy waits
    stalled = torch.cuda.Event()
    stalled.record()
    output = forward(builder.build(0, cm))
    builder.build(0, later)  # the next step's plan, made before the device ran that copy
    assert not stalled.query()  # (else the test proves nothing: nothing was still queued)
    torch.cuda.synchronize()
    n = batch.num_actual_tokens
    args = (batch.query[:n], batch.oracle_key, batch.oracle_value, batch.spec.query_lens,
            batch.kv_lens)  # fmt: skip
    ref64, _ = attention_oracle(*args, scale=SCALE)
    ref_lowp, _ = attention_oracle(*args, scale=SCALE, compute_dtype=torch.bfloat16)
    within = max_abs_error(output[:n], ref64) <= error_bound(ref64, ref_lowp, torch.bfloat16)
    assert within == pooled
    if pooled:
        assert builder._staging.buffers_made >= 1  # the in-flight buffer was not reused
