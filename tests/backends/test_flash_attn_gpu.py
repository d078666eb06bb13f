"""FLASH_ATTN on a GPU with FlashAttention-4 installed (`flash_attn.cute`).

The whole conformance kit in bf16 and fp16 (fp8 KV where declared), pages of the kernel's tile
size (TMA loads) in both layouts, cascade attention against the plain path with its prefix pass
counted, a decode CUDA graph captured once and replayed for new batches against eager runs, and
`build` under `torch.cuda.set_sync_debug_mode("error")`.

Run: `PYTHONPATH=src python3 -m pytest -q -m gpu tests/backends/test_flash_attn_gpu.py`
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from anyattn.backends import flash_attn_versions as versions
from anyattn.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from anyattn.backends.flash_attn_entry_point import FlashAttnVersion
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing import (
    KitLayer,
    assign_blocks,
    check_backend,
    get_spec,
    layer_records,
    run_case,
)
from anyattn.testing.cases import Case, plan_cases
from anyattn.types import KVCacheLayout


def _fa4_installed() -> bool:
    # torch.cuda first: on a CPU machine nothing is imported at collection.
    return torch.cuda.is_available() and any(
        i.version is FlashAttnVersion.FA4 for i in versions.installed_interfaces()
    )


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _fa4_installed(), reason="flash_attn.cute (FA4) not importable"),
]

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_conformance_kit(dtype):
    report = check_backend(FlashAttentionBackend, "cuda", dtype)
    report.assert_passed()
    # FA4's varlen call takes no ALiBi and no descales: exactly these are not declared.
    assert sorted({n.split(":")[0] for n in report.not_declared}) == [
        "alibi", "fp8", "per_head_scales",
    ]  # fmt: skip


# FA4's paged bidirectional kernel on sm90 is wrong at these (benchmarks/
# fa4_cross_attention_repro.py); the builder reads their keys contiguously. 64 and 128 stay paged.
_BIDIRECTIONAL_HEAD_SIZES = [64, 80, 96, 128, 144, 176, 192, 256]


@pytest.mark.parametrize("head_size", _BIDIRECTIONAL_HEAD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cross_and_non_causal_attention_at_every_head_size_real_models_use(head_size, dtype):
    """The cross and non-causal kit cases (the long cross-attention batch of 8 query heads over 1
    KV head included) at each head size, against the float64 oracle."""
    features = ["encoder_decoder", "non_causal"]
    cases, _ = plan_cases(FlashAttentionBackend, "cuda", dtype, features, quick=False)
    cases = [replace(case, head_size=head_size) for case in cases]
    assert {case.feature for case in cases} == set(features)
    failed = [
        (r.name, r.max_error, r.bound)
        for case in cases
        for r in run_case(FlashAttentionBackend, case, "cuda", dtype)
        if not r.passed
    ]
    assert not failed


def test_no_fp8_kv_is_declared():
    # (FA4 and FA2 take no fp8; FA3's fp8 kernels round the query to e4m3, past the bound)
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert not FlashAttentionBackend.supports_kv_cache_dtype(name)
    assert versions.installed_interfaces()[0].kv_cache_dtypes == ("auto", "float16", "bfloat16")


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_pages_of_the_tile_size_load_by_tma(layout):
    """Head size 128 on sm90/sm100 tiles keys by 128: pages of 128 take FA4's TMA path."""
    for spec in ("chunked_prefill", "mixed"):
        case = Case(f"tma/{layout}/{spec}", "block_sizes", get_spec(spec), num_heads=8,
                    num_kv_heads=2, head_size=128, block_size=128, layout=layout)  # fmt: skip
        failed = [r for r in run_case(FlashAttentionBackend, case, "cuda", DTYPE) if not r.passed]
        assert not failed, [(r.name, r.max_error, r.bound, r.detail) for r in failed]


def _builder(limits: BatchLimits) -> FlashAttentionMetadataBuilder:
    spec = AttentionSpec(BLOCK, KV_HEADS, HEAD_SIZE, DTYPE)
    return FlashAttentionMetadataBuilder(spec, layer_records(spec, ["layer.0"]), limits, "cuda")


def _cache(num_blocks: int, gen: torch.Generator, layout=KVCacheLayout.NHD) -> torch.Tensor:
    cache = allocate_kv_cache(FlashAttentionBackend, num_blocks, BLOCK, KV_HEADS, HEAD_SIZE,
                              DTYPE, layout=layout, device="cuda")  # fmt: skip
    cache.copy_(torch.randn(cache.shape, generator=gen).to(DTYPE))
    return cache


def _layer() -> KitLayer:
    one = torch.tensor(1.0, device="cuda")
    return KitLayer("layer.0", one, one)


def test_cascade_matches_the_plain_path_with_one_prefix_pass(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    prefix, num_reqs = 512, 16
    query_lens = [1 if r % 4 else 5 for r in range(num_reqs)]
    seq_lens = [prefix + 9 + 7 * r + q for r, q in enumerate(query_lens)]
    table, num_blocks = assign_blocks(seq_lens, BLOCK, common_prefix_len=prefix, generator=gen)
    cm = make_common_attn_metadata(query_lens, seq_lens, table, BLOCK, "cuda")
    builder = _builder(BatchLimits(num_reqs, 256, 2048))
    assert builder.use_cascade_attention(prefix, cm.query_lens_cpu.numpy(), HEADS, KV_HEADS,
                                         False, False, 132)  # fmt: skip
    calls = []
    original = FlashAttentionImpl._attend

    def counting(self, interface, q, k, v, pass_, *args, **kwargs):
        calls.append((pass_.page_table.shape[0], pass_.causal, pass_.max_seqlen_k))
        return original(self, interface, q, k, v, pass_, *args, **kwargs)

    monkeypatch.setattr(FlashAttentionImpl, "_attend", counting)
    impl = FlashAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
    cache = _cache(num_blocks, gen)
    n = cm.num_actual_tokens
    q = torch.randn(n, HEADS, HEAD_SIZE, generator=gen).to(DTYPE).cuda()
    plain, cascade = torch.empty_like(q), torch.empty_like(q)
    lse_plain = torch.empty(HEADS, n, device="cuda")
    lse_cascade = torch.empty_like(lse_plain)
    impl.forward(_layer(), q, None, None, cache, builder.build(0, cm), plain, output_lse=lse_plain)
    impl.forward(_layer(), q, None, None, cache, builder.build(prefix, cm), cascade,
                 output_lse=lse_cascade)  # fmt: skip
    assert calls == [
        (num_reqs, True, cm.max_seq_len),
        (1, False, prefix),  # the prefix pass: every query, once
        (num_reqs, True, cm.max_seq_len - prefix),
    ]
    torch.testing.assert_close(cascade, plain, atol=1.5e-2, rtol=1.5e-2)
    torch.testing.assert_close(lse_cascade, lse_plain, atol=1e-3, rtol=1e-4)


def _decode_step(seq_lens, num_blocks, gen):
    # random blocks of the pool (never the null block 0); sharing is harmless for reads
    shape = (len(seq_lens), 1024 // BLOCK)
    table = torch.randint(1, num_blocks, shape, generator=gen, dtype=torch.int32)
    return make_common_attn_metadata([1] * len(seq_lens), seq_lens, table, BLOCK, "cuda")


def _capture(impl, layer, q_buf, cache, md, out_buf) -> torch.cuda.CUDAGraph:
    """`impl.forward` over `md` captured once, after a warm-up on a side stream (JIT
    compilation happens outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        impl.forward(layer, q_buf, None, None, cache, md, out_buf)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(layer, q_buf, None, None, cache, md, out_buf)
    return graph


def test_decode_cuda_graph_replays_new_batches_like_eager():
    gen = torch.Generator().manual_seed(1)
    limits = BatchLimits(16, 16, 1024, cudagraph_capture_sizes=(16,))
    graph_builder, eager_builder = _builder(limits), _builder(BatchLimits(16, 16, 1024))
    num_blocks = 1 + 4 * (1024 // BLOCK)
    cache = _cache(num_blocks, gen, KVCacheLayout.HND)
    impl = FlashAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
    layer = _layer()
    q_buf = torch.zeros(16, HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")
    out_buf = torch.zeros_like(q_buf)

    capture_cm = _decode_step([int(x) for x in torch.randint(1, 1000, (16,), generator=gen)],
                              num_blocks, gen)  # fmt: skip
    md = graph_builder.build_for_cudagraph_capture(capture_cm)
    graph = _capture(impl, layer, q_buf, cache, md, out_buf)

    previous = None
    for num_reqs in (11, 16, 3):
        seq_lens = [int(x) for x in torch.randint(1, 1000, (num_reqs,), generator=gen)]
        cm = _decode_step(seq_lens, num_blocks, gen)
        replay_md = graph_builder.build(0, cm)
        # laid out for the captured size, in the captured buffers
        assert replay_md.main.page_table.data_ptr() == md.main.page_table.data_ptr()
        assert replay_md.main.page_table.shape[0] == 16
        q = torch.randn(num_reqs, HEADS, HEAD_SIZE, generator=gen).to(DTYPE).cuda()
        q_buf[:num_reqs].copy_(q)
        graph.replay()
        eager = torch.empty_like(q)
        impl.forward(layer, q, None, None, cache, eager_builder.build(0, cm), eager)
        torch.testing.assert_close(out_buf[:num_reqs], eager, atol=1.5e-2, rtol=1.5e-2)
        if previous is not None:
            assert not torch.equal(out_buf[:num_reqs], previous[:num_reqs])
        previous = out_buf.clone()


def test_decode_cuda_graph_over_persistent_step_tensors_replays_like_eager():
    """`has_persistent_graph_inputs`, as the engine's runner keeps its promise: every step's device
    tensors are its fixed buffers, padded with dummies (one key over the null block) to the
    captured size; the graph reads them in place, and each replay matches an eager run."""
    gen = torch.Generator().manual_seed(3)
    size, width = 16, 1024 // BLOCK
    limits = BatchLimits(16, 16, 1024, cudagraph_capture_sizes=(size,),
                         has_persistent_graph_inputs=True)  # fmt: skip
    builder, eager_builder = _builder(limits), _builder(BatchLimits(16, 16, 1024))
    num_blocks = 1 + 4 * width
    cache = _cache(num_blocks, gen)
    impl = FlashAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
    layer = _layer()
    q_buf = torch.zeros(size, HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")
    out_buf = torch.zeros_like(q_buf)
    buffers = {  # the runner's persistent device tensors
        "query_start_loc": torch.zeros(size + 1, dtype=torch.int32, device="cuda"),
        "seq_lens": torch.zeros(size, dtype=torch.int32, device="cuda"),
        "block_table_tensor": torch.zeros(size, width, dtype=torch.int32, device="cuda"),
        "slot_mapping": torch.zeros(size, dtype=torch.int64, device="cuda"),
    }

    def padded_step(seq_lens):
        real = _decode_step(seq_lens, num_blocks, gen)
        dummies = size - len(seq_lens)
        null_rows = torch.zeros(dummies, width, dtype=torch.int32)
        table = torch.cat([real.block_table_tensor.cpu(), null_rows])
        # (the dummies write nothing: slot -1)
        slots = torch.cat([real.slot_mapping_cpu, torch.full((dummies,), -1)])
        padded = make_common_attn_metadata(
            [1] * size, seq_lens + [1] * dummies, table, BLOCK, "cuda", slot_mapping=slots
        )
        for name, buffer in buffers.items():
            buffer.copy_(getattr(padded, name))
        return real, replace(padded, **buffers)

    _, capture_cm = padded_step([int(x) for x in torch.randint(1, 1000, (size,), generator=gen)])
    md = builder.build_for_cudagraph_capture(capture_cm)
    assert md.main.seq_lens.data_ptr() == buffers["seq_lens"].data_ptr()
    graph = _capture(impl, layer, q_buf, cache, md, out_buf)

    for num_reqs in (11, 16, 3):
        seq_lens = [int(x) for x in torch.randint(1, 1000, (num_reqs,), generator=gen)]
        real, cm = padded_step(seq_lens)
        replay_md = builder.build(0, cm)
        assert replay_md.main.page_table.data_ptr() == md.main.page_table.data_ptr()
        q = torch.randn(num_reqs, HEADS, HEAD_SIZE, generator=gen).to(DTYPE).cuda()
        q_buf[:num_reqs].copy_(q)
        graph.replay()
        eager = torch.empty_like(q)
        impl.forward(layer, q, None, None, cache, eager_builder.build(0, real), eager)
        torch.testing.assert_close(out_buf[:num_reqs], eager, atol=1.5e-2, rtol=1.5e-2)


def test_build_never_waits_on_the_gpu():
    gen = torch.Generator().manual_seed(2)
    seq_lens = [600, 530, 700, 515, 900, 1000, 640, 777]
    mixed_lens = [1, 9, 1, 1, 40, 1, 3, 1]
    table, _ = assign_blocks(seq_lens, BLOCK, common_prefix_len=512, generator=gen)
    mixed = make_common_attn_metadata(mixed_lens, seq_lens, table, BLOCK, "cuda")
    decode = make_common_attn_metadata([1] * 8, seq_lens, table, BLOCK, "cuda")
    builder = _builder(BatchLimits(8, 256, 1024, cudagraph_capture_sizes=(4, 8)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        builder.build(0, mixed)
        builder.build(512, mixed)
        assert builder.build(0, decode).uses_persistent_buffers
        builder.build_for_cudagraph_capture(decode)
    finally:
        torch.cuda.set_sync_debug_mode("default")
