"""FLASHINFER_MLA on the CPU, through a stand-in for FlashInfer that computes what FlashInfer
documents (`flashinfer_mla_fake`, `flashinfer_fake`): the MLA conformance kit against the float64
oracle (so the builder's CSR metadata, page ids, ragged launches and LSE merges are right), the
plans a step makes, stale metadata, and the declarations. The real kernels run in
tests/backends/test_flashinfer_mla_gpu.py.
"""

from __future__ import annotations

import flashinfer_fake
import flashinfer_mla_fake
import pytest
import torch

from anyattn import registry
from anyattn.backends import flashinfer_version
from anyattn.backends.flashinfer_mla import (
    FlashInferMLABackend,
    FlashInferMLAImpl,
    FlashInferMLAMetadataBuilder,
)
from anyattn.config import AttentionSelectorConfig, BatchLimits, MLAAttentionSpec
from anyattn.metadata import make_common_attn_metadata
from anyattn.selector import explain, select_backend
from anyattn.testing import check_backend
from anyattn.types import DeviceInfo

DEEPSEEK = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


class CpuFlashInferMLA(FlashInferMLABackend):
    """FLASHINFER_MLA's builder and impl on the CPU over the stand-in (tests only)."""

    supported_device_types = ("cpu", "cuda")

    @staticmethod
    def get_impl_cls() -> type[FlashInferMLAImpl]:
        return CpuFlashInferMLAImpl

    @staticmethod
    def get_builder_cls() -> type[FlashInferMLAMetadataBuilder]:
        return CpuFlashInferMLABuilder


class CpuFlashInferMLAImpl(FlashInferMLAImpl):
    backend = CpuFlashInferMLA


class CpuFlashInferMLABuilder(FlashInferMLAMetadataBuilder):
    backend = CpuFlashInferMLA


@pytest.fixture
def fake(monkeypatch):
    module = flashinfer_mla_fake.install(monkeypatch)
    yield module
    flashinfer_version.import_flashinfer.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conformance_kit_through_the_stand_in(fake, dtype: torch.dtype) -> None:
    report = check_backend(CpuFlashInferMLA, "cpu", dtype)
    report.assert_passed()
    assert "mla" in flashinfer_mla_fake.runs and "ragged" in flashinfer_fake.runs


def _builder(heads=(4,), block_size=16, workspace_tokens=None):
    spec = MLAAttentionSpec(block_size=block_size, dtype=torch.bfloat16, **DEEPSEEK)
    extra = {} if workspace_tokens is None else {"workspace_tokens": workspace_tokens}
    impls = {
        f"l{i}": CpuFlashInferMLAImpl(h, 0.1, **DEEPSEEK, **extra) for i, h in enumerate(heads)
    }
    limits = BatchLimits(max_num_reqs=8, max_num_tokens=256, max_model_len=512)
    records = {name: impl.layer_params() for name, impl in impls.items()}
    return CpuFlashInferMLABuilder(spec, records, limits, torch.device("cpu")), impls


def test_decode_plan_is_csr_of_each_rows_pages(fake) -> None:
    builder, _ = _builder(heads=(4, 4, 8))
    table = torch.tensor([[7, 3, 0], [5, 0, 0], [2, 9, 4]], dtype=torch.int32)
    cm = make_common_attn_metadata([1, 1, 1], [20, 16, 33], table, 16, torch.device("cpu"))
    md = builder.build(0, cm)
    plans = flashinfer_mla_fake.plans
    assert len(plans) == 2  # one plan per distinct (num_heads, scale), not per layer
    assert md.plans["l0"] is md.plans["l1"] and md.plans["l2"] is not md.plans["l0"]
    p = plans[0]
    assert p["indptr"].tolist() == [0, 2, 3, 6] and p["indices"].tolist() == [7, 3, 5, 2, 9, 4]
    assert p["kv_len"].tolist() == [20, 16, 33] and p["qo"].tolist() == [0, 1, 2, 3]
    assert (p["ckv"], p["kpe"], p["page_size"], p["causal"]) == (512, 64, 16, False)
    assert (p["query_layout"], p["kv_cache_layout"], p["lse_mode"]) == ("split", "packed", "basee")
    assert md.plans["l0"].new_tokens is None


def test_context_chunks_leave_out_requests_without_rows(fake) -> None:
    # Requests 0 and 2 have a context, request 1 (between them) is fresh: a chunk holding
    # both contexts runs as two launches, so that no launch has a request without keys.
    builder, _ = _builder(workspace_tokens=64)
    table = torch.arange(1, 13, dtype=torch.int32).view(3, 4)
    cm = make_common_attn_metadata([5, 3, 4], [25, 3, 30], table, 16, torch.device("cpu"))
    md = builder.build(0, cm)
    plan = md.plans["l0"]
    assert plan.new_tokens.q_start == 0 and plan.new_tokens.q_end == 12
    assert len(plan.chunks) == 1
    launches = [(x.q_start, x.q_end, x.key_start, x.key_end, x.causal) for x in plan.chunks[0]]
    assert launches == [(0, 5, 0, 20, False), (8, 12, 20, 46, False)]


def test_stale_metadata_is_refused(fake) -> None:
    builder, _ = _builder()
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    cm = make_common_attn_metadata([1], [20], table, 16, torch.device("cpu"))
    first = builder.build(0, cm)
    builder.build(0, cm)
    with pytest.raises(RuntimeError, match="stale"):
        first.plans["l0"].check_current("test")


def test_declarations_and_choice_on_sm90(fake) -> None:
    config = AttentionSelectorConfig(head_size=576, qk_rope_head_dim=64, dtype=torch.bfloat16,
                                     use_mla=True)  # fmt: skip
    assert select_backend(config, DeviceInfo.parse("sm90")).get_name() == "FLASHINFER_MLA"
    text = explain(config, DeviceInfo.parse("sm80"))
    assert "FLASHINFER_MLA" in str(text) and "sm80 not supported" in str(text)
    other = AttentionSelectorConfig(head_size=384, qk_rope_head_dim=64, dtype=torch.bfloat16,
                                    use_mla=True)  # fmt: skip
    assert FlashInferMLABackend.validate_configuration(other, DeviceInfo.parse("sm90"))
    assert "192/128" in FlashInferMLABackend.get_mla_head_dims_reason(64, 64, 64)
    with pytest.raises(ValueError, match="v_head_dim"):
        FlashInferMLAImpl(4, 0.1, **{**DEEPSEEK, "v_head_dim": 96})
    assert registry.get_backend_class("FLASHINFER_MLA") is FlashInferMLABackend
