"""FLASH_ATTN planning, exactly: the index arrays of `flash_attn_plan` and what the builder puts
in its metadata (plain, cascade, CUDA-graph decode layout), all on the CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from fa_fakes import fa2, fa4, install

from anyattn.backends.flash_attn import FlashAttentionMetadataBuilder
from anyattn.backends.flash_attn_plan import (
    cascade_is_worthwhile,
    cu_seqlens_from_lens,
    padded_num_reqs,
    plan_cascade,
)
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing import assign_blocks, layer_records

BLOCK = 16
FA2_BLOCK = 256  # FA2's paged KV takes blocks of a multiple of 256 tokens only
I32 = torch.int32


def _ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


@pytest.fixture(autouse=True)
def _fa4_installed(monkeypatch):
    install(monkeypatch, fa4())


def _builder(
    capture_sizes=(), sliding_window=None, max_num_reqs=32, device="cpu", block=BLOCK,
    persistent=False,
):  # fmt: skip
    spec = AttentionSpec(block, 2, 64, torch.float16, sliding_window=sliding_window)
    limits = BatchLimits(max_num_reqs, 4096, 1024, cudagraph_capture_sizes=capture_sizes,
                         has_persistent_graph_inputs=persistent)  # fmt: skip
    return FlashAttentionMetadataBuilder(spec, layer_records(spec, ["layer.0"]), limits, device)


def test_cu_seqlens_from_lens():
    assert cu_seqlens_from_lens(_ints([3, 0, 5, 1])).tolist() == [0, 3, 3, 8, 9]
    assert cu_seqlens_from_lens(_ints([])).tolist() == [0]
    assert cu_seqlens_from_lens(_ints([2])).dtype == I32


@pytest.mark.parametrize(
    ("num_reqs", "sizes", "expected"),
    [(5, (1, 2, 4, 8, 16), 8), (8, (16, 8, 1), 8), (16, (1, 16), 16), (17, (1, 16), 17),
     (3, (), 3), (1, (4,), 4)],
)  # fmt: skip
def test_padded_num_reqs(num_reqs, sizes, expected):
    assert padded_num_reqs(num_reqs, sizes) == expected


def test_plan_cascade_exact():
    seq_lens = _ints([70, 80, 65])
    context = _ints([69, 72, 64])  # query lens 1, 8, 1
    plan = plan_cascade(64, BLOCK, seq_lens, context, num_tokens=10)
    assert (plan.common_prefix_len, plan.prefix_blocks, plan.num_tokens) == (64, 4, 10)
    assert plan.prefix_cu_seqlens_q.tolist() == [0, 10]
    assert plan.prefix_seq_lens.tolist() == [64]
    assert plan.prefix_cu_seqlens_k.tolist() == [0, 64]
    assert plan.suffix_seq_lens.tolist() == [6, 16, 1]
    assert plan.suffix_cu_seqlens_k.tolist() == [0, 6, 22, 23]
    assert plan.suffix_max_seq_len == 16
    assert all(t.dtype == I32 for t in (plan.prefix_cu_seqlens_q, plan.suffix_seq_lens))


@pytest.mark.parametrize(("prefix", "match"), [(8, "multiple of block_size"), (80, "within")])
def test_plan_cascade_rejects_bad_prefixes(prefix, match):
    with pytest.raises(ValueError, match=match):
        plan_cascade(prefix, BLOCK, _ints([70, 80]), _ints([69, 72]), num_tokens=9)


def test_cascade_is_worthwhile_for_many_requests_sharing_a_long_prefix():
    decodes = np.ones(16, dtype=np.int32)
    assert cascade_is_worthwhile(512, decodes, 32, 8, num_sms=132)
    assert cascade_is_worthwhile(512, decodes, 32, 8, num_sms=0)
    mixed = np.array([1, 1, 7, 1, 33, 1, 1, 2] * 2, dtype=np.int32)
    assert cascade_is_worthwhile(512, mixed, 32, 8, num_sms=132)
    assert not cascade_is_worthwhile(128, decodes, 32, 8, num_sms=132)  # prefix too short
    assert not cascade_is_worthwhile(512, decodes[:4], 32, 8, num_sms=132)  # too few requests
    # one KV head: both paths leave most SMs idle, reading the prefix costs the same
    assert not cascade_is_worthwhile(512, decodes, 8, 1, num_sms=132)


def _decode_batch(seq_lens, seed=0, device="cpu", block=BLOCK):
    gen = torch.Generator().manual_seed(seed)
    table, _ = assign_blocks(seq_lens, block, generator=gen)
    return make_common_attn_metadata([1] * len(seq_lens), seq_lens, table, block, device), table


def test_plain_build_slices_the_step_tensors():
    gen = torch.Generator().manual_seed(1)
    table, _ = assign_blocks([40, 17, 1, 70], BLOCK, generator=gen)
    cm = make_common_attn_metadata([1, 17, 1, 5], [40, 17, 1, 70], table, BLOCK)
    md = _builder().build(0, cm)
    assert md.prefix is None and not md.uses_persistent_buffers
    main = md.main
    assert main.cu_seqlens_q.tolist() == [0, 1, 18, 19, 24]
    assert main.seq_lens.tolist() == [40, 17, 1, 70]
    assert torch.equal(main.page_table, table)
    assert (main.max_seqlen_q, main.max_seqlen_k, main.causal) == (17, 70, True)
    assert main.cu_seqlens_k is None  # FA4 takes seqused_k


def test_fa2_gets_cumulative_key_lengths(monkeypatch):
    install(monkeypatch, fa2())
    cm, _ = _decode_batch([40, 17, 3], block=FA2_BLOCK)
    md = _builder(block=FA2_BLOCK).build(0, cm)
    assert md.main.cu_seqlens_k.tolist() == [0, 40, 57, 60]


def test_cascade_build_exact():
    gen = torch.Generator().manual_seed(2)
    query_lens, seq_lens = [1, 3, 1], [70, 80, 65]
    table, _ = assign_blocks(seq_lens, BLOCK, common_prefix_len=64, generator=gen)
    cm = make_common_attn_metadata(query_lens, seq_lens, table, BLOCK)
    md = _builder().build(64, cm)
    prefix, suffix = md.prefix, md.main
    assert md.common_prefix_len == 64
    assert prefix.cu_seqlens_q.tolist() == [0, 5] and prefix.seq_lens.tolist() == [64]
    assert prefix.page_table.tolist() == [table[0, :4].tolist()]
    assert (prefix.max_seqlen_q, prefix.max_seqlen_k, prefix.causal) == (5, 64, False)
    assert suffix.cu_seqlens_q.tolist() == [0, 1, 4, 5]
    assert suffix.seq_lens.tolist() == [6, 16, 1]
    assert torch.equal(suffix.page_table, table[:, 4:])
    assert (suffix.max_seqlen_q, suffix.max_seqlen_k, suffix.causal) == (3, 16, True)


def test_cascade_is_refused_with_a_sliding_window_or_a_bad_prefix():
    gen = torch.Generator().manual_seed(3)
    table, _ = assign_blocks([70, 80], BLOCK, common_prefix_len=64, generator=gen)
    cm = make_common_attn_metadata([1, 1], [70, 80], table, BLOCK)
    with pytest.raises(ValueError, match="sliding window"):
        _builder(sliding_window=32).build(64, cm)
    with pytest.raises(ValueError, match="within every request's context"):
        _builder().build(80, cm)


def test_decode_batch_is_laid_out_for_its_capture_size():
    builder = _builder(capture_sizes=(4, 8))
    cm, table = _decode_batch([40, 17, 3, 90, 33])
    md = builder.build(0, cm)
    main = md.main
    assert md.uses_persistent_buffers and md.num_actual_tokens == 5
    assert main.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]
    assert main.seq_lens.tolist() == [40, 17, 3, 90, 33, 0, 0, 0]
    assert main.page_table.shape == (8, 1024 // BLOCK)
    assert torch.equal(main.page_table[:5, : table.shape[1]], table)
    assert (main.max_seqlen_q, main.max_seqlen_k) == (1, 1024)
    # the next step reuses the same memory: a captured graph reads the new values
    cm2, table2 = _decode_batch([7, 8], seed=1)
    md2 = builder.build(0, cm2)
    assert md2.main.seq_lens.data_ptr() == main.seq_lens.data_ptr()
    assert md2.main.seq_lens.tolist() == [7, 8, 0, 0]
    assert md2.main.cu_seqlens_q.tolist() == [0, 1, 2, 2, 2]
    assert torch.equal(md2.main.page_table[:2, : table2.shape[1]], table2)


@pytest.mark.parametrize("fa2_interface", [False, True], ids=["seqused_k", "cu_seqlens_k"])
def test_replay_steps_stay_exact_at_fixed_addresses(monkeypatch, fa2_interface):
    """Over steps that go back and forth between captured sizes and batches, every buffer
    holds exactly the step's values, at the same addresses per captured size."""
    block = BLOCK
    if fa2_interface:
        install(monkeypatch, fa2())
        block = FA2_BLOCK
    builder = _builder(capture_sizes=(4, 8), block=block)
    steps = [[40, 17, 3], [41, 18, 4], [41, 18, 4, 9], [5, 6, 7, 8, 9], [42, 19], [4, 5, 6, 7]]
    passes = {}
    for seed, lens in enumerate(steps):
        cm, table = _decode_batch(lens, seed=seed, block=block)
        main = builder.build(0, cm).main
        padded = 4 if len(lens) <= 4 else 8
        n = len(lens)
        assert main.cu_seqlens_q.tolist() == list(range(n + 1)) + [n] * (padded - n)
        assert main.seq_lens.tolist() == lens + [0] * (padded - n)
        assert torch.equal(main.page_table[:n, : table.shape[1]], table)
        if fa2_interface:
            assert main.cu_seqlens_k.tolist() == np.cumsum([0, *lens, *[0] * (padded - n)]).tolist()
        else:
            assert main.cu_seqlens_k is None
        # one set of addresses per captured size: what a graph captured for it reads
        first = passes.setdefault(padded, main)
        assert main.seq_lens.data_ptr() == first.seq_lens.data_ptr()
        assert main.cu_seqlens_q.data_ptr() == first.cu_seqlens_q.data_ptr()


def test_replay_steps_copy_from_an_engine_table_wider_and_longer_than_the_batch():
    """The engine's table may have more rows than requests and more columns than
    max_model_len needs (a persistent buffer): each request's pages still land in its row."""
    builder = _builder(capture_sizes=(4,))
    width = 1024 // BLOCK
    wide = torch.randint(1, 500, (6, width + 3), dtype=torch.int32)
    for lens in ([40, 17, 3], [1000, 2, 900], [70, 1024], [1, 2, 3, 4], [100, 200, 300]):
        n = len(lens)
        cm = make_common_attn_metadata([1] * n, lens, wide[:n], BLOCK)
        # rows past the batch, columns past the buffer's
        cm = dataclasses.replace(cm, block_table_tensor=wide, block_table_cpu=wide)
        main = builder.build(0, cm).main
        for row, seq_len in enumerate(lens):
            pages = -(-seq_len // BLOCK)
            assert torch.equal(main.page_table[row, :pages], wide[row, :pages]), (lens, row)
        assert main.page_table.shape == (4, width)


def test_a_builder_for_cuda_is_made_without_touching_cuda(monkeypatch):
    """Making a builder reads no CUDA state: an engine may make builders before CUDA is up."""

    def fail():
        raise AssertionError("CUDA touched")

    for name in ("current_device", "init", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, fail)
    builder = _builder(capture_sizes=(4,), device="cuda")
    assert builder.device == torch.device("cuda")


def test_the_mirrors_the_capture_copy_is_sized_by_are_checked_when_made():
    cm = make_common_attn_metadata([1] * 3, [100, 17, 3], torch.ones(3, 8, dtype=torch.int32),
                                   BLOCK)  # fmt: skip
    # below the longest request: the copy would take too few columns
    with pytest.raises(ValueError, match="CommonAttentionMetadata: max_query_len / max_seq"):
        dataclasses.replace(cm, max_seq_len=10)


def test_capture_sizes_beyond_max_num_reqs_are_refused():
    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes .* \[8\] with max_num_reqs=4"):
        _builder(capture_sizes=(2, 8), max_num_reqs=4)


def test_fa2_decode_layout_carries_cumulative_key_lengths(monkeypatch):
    install(monkeypatch, fa2())
    builder = _builder(capture_sizes=(4,), block=FA2_BLOCK)
    md = builder.build(0, _decode_batch([40, 17, 3], block=FA2_BLOCK)[0])
    assert md.uses_persistent_buffers
    assert md.main.cu_seqlens_k.tolist() == [0, 40, 57, 60, 60]


def test_decodes_beyond_the_capture_sizes_or_prefills_use_the_step_tensors():
    builder = _builder(capture_sizes=(2,))
    cm, _ = _decode_batch([40, 17, 3])
    assert not builder.build(0, cm).uses_persistent_buffers
    assert not _builder().build(0, _decode_batch([5])[0]).uses_persistent_buffers
    capture = builder.build_for_cudagraph_capture(_decode_batch([9, 4])[0])
    assert capture.uses_persistent_buffers and capture.main.seq_lens.tolist() == [9, 4]
    mixed = make_common_attn_metadata([1, 4], [9, 4], _ints([[3], [4]]), BLOCK)
    with pytest.raises(ValueError, match="single-token decodes"):
        builder.build_for_cudagraph_capture(mixed)


@pytest.mark.parametrize("fa2_interface", [False, True], ids=["seqused_k", "cu_seqlens_k"])
def test_persistent_graph_inputs_are_read_in_place(monkeypatch, fa2_interface):
    """Under `has_persistent_graph_inputs` a decode batch of a captured size (capture and replay
    alike) is laid out over the step's own tensors, which the runner keeps at fixed addresses:
    nothing is copied, FA2's key offsets aside, which land in one builder buffer."""
    block = BLOCK
    if fa2_interface:
        install(monkeypatch, fa2())
        block = FA2_BLOCK
    builder = _builder(capture_sizes=(2, 4), block=block, persistent=True)
    cu_k_address = None
    for seed, lens in enumerate([[40, 17, 3, 9], [41, 18, 4, 10], [7, 70]]):
        cm, table = _decode_batch(lens, seed=seed, block=block)
        md = builder.build_for_cudagraph_capture(cm) if seed == 0 else builder.build(0, cm)
        main = md.main
        assert not md.uses_persistent_buffers  # (not the builder's buffers: the step's)
        assert main.seq_lens.data_ptr() == cm.seq_lens.data_ptr()
        assert main.page_table.data_ptr() == cm.block_table_tensor.data_ptr()
        assert main.cu_seqlens_q.data_ptr() == cm.query_start_loc.data_ptr()
        assert main.seq_lens.tolist() == lens and torch.equal(main.page_table, table)
        assert main.cu_seqlens_q.tolist() == list(range(len(lens) + 1))
        # bounded as the graph was captured, whatever this step's longest request
        assert (main.max_seqlen_q, main.max_seqlen_k) == (1, 1024)
        if fa2_interface:
            assert main.cu_seqlens_k.tolist() == np.cumsum([0, *lens]).tolist()
            cu_k_address = cu_k_address or main.cu_seqlens_k.data_ptr()
            assert main.cu_seqlens_k.data_ptr() == cu_k_address  # what the graph reads
        else:
            assert main.cu_seqlens_k is None


def test_persistent_graph_inputs_take_batches_of_other_sizes_as_eager_steps():
    builder = _builder(capture_sizes=(2, 4), persistent=True)
    cm, _ = _decode_batch([40, 17, 3])  # 3 requests: no captured size, not a graph step
    main = builder.build(0, cm).main
    assert main.seq_lens.data_ptr() == cm.seq_lens.data_ptr()
    assert main.max_seqlen_k == 40  # the plain layout's: the step's own longest
    with pytest.raises(ValueError, match=r"padded to a capture size \(got 3 requests"):
        builder.build_for_cudagraph_capture(cm)
    # 3 requests over a captured size's 4 slot rows: a replay the runner did not pad (the
    # graph would read a fourth request's row and, on FA2, key offsets nobody wrote)
    gen = torch.Generator().manual_seed(0)
    table, _ = assign_blocks([40, 17, 3], BLOCK, generator=gen)
    unpadded = make_common_attn_metadata([1] * 3, [40, 17, 3], table, BLOCK, num_padded_tokens=4)
    with pytest.raises(ValueError, match=r"got 3 requests over 4 slot_mapping rows"):
        builder.build(0, unpadded)


def test_build_reads_no_device_values():
    """Device tensors on the meta device hold no values: any read of them would raise."""
    builder = _builder(capture_sizes=(4,), device="meta")
    gen = torch.Generator().manual_seed(4)
    table, _ = assign_blocks([70, 80, 65], BLOCK, common_prefix_len=64, generator=gen)
    for query_lens in ([1, 1, 1], [1, 3, 1]):
        cm = make_common_attn_metadata(query_lens, [70, 80, 65], table, BLOCK, device="meta")
        builder.build(0, cm)
        md = builder.build(64, cm)
        assert md.prefix.max_seqlen_q == sum(query_lens)


def test_block_table_too_narrow_is_rejected():
    cm = make_common_attn_metadata([1], [9], _ints([[3]]), BLOCK)
    lens = torch.tensor([40], dtype=torch.int32)  # more keys than the table's one column holds
    cm = dataclasses.replace(
        cm, seq_lens=lens, seq_lens_cpu=lens, num_computed_tokens_cpu=lens - 1, max_seq_len=40
    )
    with pytest.raises(ValueError, match="block_table too small"):
        _builder().build(0, cm)


def test_the_mirrors_the_kernels_are_sized_by_are_checked_when_made():
    step = make_common_attn_metadata([1, 3], [40, 7], _ints([[3, 4, 5], [6, 0, 0]]), BLOCK)
    cases = [
        # the longest sequence understated: the width check (and max_seqlen_k) would be too small
        ({"max_seq_len": 9}, r"max_seq_len below .* \(got 3 / 9, expected >= 3 / 40\)"),
        # the kernel's grid would skip the prefill's last two queries
        ({"max_query_len": 1}, "max_query_len / max_seq_len below"),
        ({"num_actual_tokens": 3}, "num_actual_tokens disagrees"),
        ({"num_computed_tokens_cpu": _ints([39, 0])}, "num_computed_tokens_cpu must equal"),
        ({"block_table_tensor": step.block_table_tensor.long()}, "block_table_tensor must be"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=f"CommonAttentionMetadata: .*{message}"):
            dataclasses.replace(step, **changes)
    _builder().build(0, step)


def test_use_cascade_attention_says_yes_for_16_requests_sharing_512_tokens():
    builder = _builder()
    args = dict(num_query_heads=32, num_kv_heads=8, num_sms=132)
    decodes = np.ones(16, dtype=np.int32)
    assert builder.use_cascade_attention(512, decodes, use_alibi=False, use_sliding_window=False,
                                         **args)  # fmt: skip
    assert not builder.use_cascade_attention(512, decodes, use_alibi=True,
                                             use_sliding_window=False, **args)  # fmt: skip
    assert not builder.use_cascade_attention(512, decodes, use_alibi=False,
                                             use_sliding_window=True, **args)  # fmt: skip
    assert not _builder(sliding_window=64).use_cascade_attention(
        512, decodes, use_alibi=False, use_sliding_window=False, **args
    )
