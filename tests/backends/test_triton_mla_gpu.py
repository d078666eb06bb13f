"""TRITON_MLA on CUDA (`gpu` marker; skipped without a GPU): the MLA conformance kit in bf16 and
fp16 (every kit split it declares: 512+64, 320+64, 64+16; fp8 caches; LSE), split-KV forced on
DeepSeek's split, and CUDA-graph capture and replay of a uniform decode batch. Every declared
split with every dtype also runs in the declaration sweep (tests/backends/test_declarations.py
-k TRITON_MLA), and the decode kernel's bf16 cases in tests/ops/test_mla_decode.py.

    pytest -m gpu tests/backends/test_triton_mla_gpu.py tests/ops/test_mla_decode.py
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from anyattn.backends.triton_mla import TritonMLABackend, TritonMLAImpl
from anyattn.backends.triton_mla_builder import TritonMLAMetadataBuilder
from anyattn.config import BatchLimits, MLAAttentionSpec
from anyattn.metadata import make_common_attn_metadata
from anyattn.ops.mla_decode import mla_decode_ref
from anyattn.testing import (
    MLACase,
    check_backend,
    error_bound,
    get_spec,
    max_abs_error,
    run_mla_case,
)

pytestmark = [pytest.mark.gpu]

DEEPSEEK = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
            "v_head_dim": 128}  # fmt: skip


class SplittingBuilder(TritonMLAMetadataBuilder):
    """Split-KV from 8 keys per split, so that the kit's short decodes split."""

    min_keys_per_split = 8


class SplittingTritonMLA(TritonMLABackend):
    @staticmethod
    def get_builder_cls() -> type[TritonMLAMetadataBuilder]:
        return SplittingBuilder


SplittingBuilder.backend = SplittingTritonMLA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conformance_kit_on_cuda(dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    check_backend(TritonMLABackend, "cuda", dtype).assert_passed()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["many_decodes", "mixed"])
def test_split_kv_forced_on_cuda(dtype: torch.dtype, name: str) -> None:
    pytest.importorskip("triton")
    case = MLACase(f"split/{name}", "decode", get_spec(name), num_heads=16, check_lse=True)
    results = run_mla_case(SplittingTritonMLA, case, torch.device("cuda"), dtype, seed=3)
    failed = [f"{r.name}: {r.detail} ({r.max_error:.3g} > {r.bound:.3g})" for r in results
              if not r.passed]  # fmt: skip
    assert not failed, failed


def _fill(table: torch.Tensor, seq_lens: torch.Tensor, lens: list[int], seed: int) -> None:
    """Shuffled blocks of a 256-block pool (block 0 unused) for each row, in place."""
    gen = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(255, generator=gen) + 1)[: table.numel()].view(table.shape)
    table.copy_(ids.to(torch.int32))
    seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("num_heads", [16, 128])
def test_cuda_graph_capture_and_replay(num_heads: int) -> None:
    """Capture forward_mqa over a batch's tensors, refill them (lengths, pages, queries,
    cache) with another batch of the same size, replay: the result equals an eager forward on
    the new batch and the float64 reference."""
    pytest.importorskip("triton")
    block_size, rows, width = 16, 4, 60
    spec = MLAAttentionSpec(block_size=block_size, dtype=torch.bfloat16, **DEEPSEEK)
    limits = BatchLimits(
        max_num_reqs=rows,
        max_num_tokens=rows,
        max_model_len=width * block_size,
        cudagraph_capture_sizes=(rows,),
        has_persistent_graph_inputs=True,
    )
    impl = TritonMLAImpl(num_heads, 0.07, **DEEPSEEK)
    builder = TritonMLAMetadataBuilder(spec, {"l": impl.layer_params()}, limits, "cuda")
    layer = SimpleNamespace(layer_name="l", k_scale=torch.tensor(1.0))
    cuda = torch.device("cuda")
    table = torch.zeros(rows, width, dtype=torch.int32, device=cuda)
    seq_lens = torch.zeros(rows, dtype=torch.int32, device=cuda)
    cache = torch.randn(256, block_size, 576, device=cuda).bfloat16()
    q = torch.randn(rows, num_heads, 576, device=cuda).bfloat16()
    out = torch.zeros(rows, num_heads, 512, device=cuda, dtype=torch.bfloat16)

    def metadata(lens: list[int], capture: bool):
        cm = make_common_attn_metadata([1] * rows, lens, table.cpu(), block_size, cuda)
        cm = dataclasses.replace(cm, seq_lens=seq_lens, block_table_tensor=table)
        return builder.build_for_cudagraph_capture(cm) if capture else builder.build(0, cm)

    _fill(table, seq_lens, [5, 300, 960, 64], seed=1)
    md = metadata([960] * rows, capture=True)  # capture sizes launches for max_model_len
    assert md.decode_plan.num_splits > 1
    impl.forward_mqa(layer, q[..., :512], q[..., 512:], cache, md, out)  # warm-up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward_mqa(layer, q[..., :512], q[..., 512:], cache, md, out)
    lens_b = [700, 1, 33, 960]
    _fill(table, seq_lens, lens_b, seed=2)
    q.copy_(torch.randn_like(q, dtype=torch.float32).bfloat16())
    cache.copy_(torch.randn_like(cache, dtype=torch.float32).bfloat16())
    graph.replay()
    eager = torch.zeros_like(out)
    impl.forward_mqa(layer, q[..., :512], q[..., 512:], cache, metadata(lens_b, False), eager)
    torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
    args = (q[..., :512], q[..., 512:], cache, table, seq_lens, 0.07)
    ref64, _ = mla_decode_ref(*args, compute_dtype=torch.float64)
    lowp, _ = mla_decode_ref(*args, compute_dtype=torch.bfloat16)
    assert max_abs_error(out, ref64) <= error_bound(ref64, lowp, torch.bfloat16)
    assert not math.isnan(out.float().sum().item())
