"""MLA case planning: splits and features the backend declares run, the rest is listed; the
context-chunk batch forces several chunks; the sweep covers every declared split."""

from __future__ import annotations

import pytest
import torch

from anyattn.testing import MLA_FEATURES, MLA_SHAPES, MLAShape, check_backend, plan_cases
from anyattn.testing.mla_cases import context_chunks_spec
from anyattn.testing.sweep import declaration_cases
from anyattn.types import MultipleOf


def _mla_backend(make_backend, splits=(), **kwargs):
    return make_backend(
        "FAKE_MLA",
        mla=True,
        get_supported_mla_splits=classmethod(lambda cls: list(splits)),
        **kwargs,
    )


def test_the_kit_runs_512_64_a_non_power_of_two_rank_and_a_small_split() -> None:
    splits = [(s.kv_lora_rank, s.qk_rope_head_dim) for s in MLA_SHAPES]
    assert (512, 64) in splits and len(splits) >= 3
    assert any(rank & (rank - 1) for rank, _ in splits)  # a rank that is not a power of two
    # Values narrower than queries/keys everywhere; P != Vd in one.
    assert all(s.v_head_dim != s.qk_nope_head_dim + s.qk_rope_head_dim for s in MLA_SHAPES)
    assert any(s.v_head_dim != s.qk_nope_head_dim for s in MLA_SHAPES)


def test_undeclared_splits_and_features_are_listed_not_run(make_backend) -> None:
    backend = _mla_backend(make_backend, splits=[(512, 64)], kv_cache_dtypes=("auto",))
    cases, not_declared = plan_cases(backend, quick=True)
    assert {c.shape.name for c in cases} == {"512+64"}
    assert {c.feature for c in cases} == set(MLA_FEATURES) - {"fp8", "lse"}
    listed = "\n".join(not_declared)
    assert "split 320+64: MLA latent split 320+64 not supported" in listed
    assert "split 64+16: MLA latent split 64+16 not supported" in listed
    assert "fp8: no fp8 kv_cache_dtype in supported_kv_cache_dtypes" in listed
    assert "lse: supports_lse() is False" in listed


def test_every_batch_feature_runs_at_every_declared_split(make_backend) -> None:
    cases, not_declared = plan_cases(_mla_backend(make_backend), features=["decode", "chunked"])
    assert not_declared == []
    assert [c.name for c in cases] == [
        "512+64/single_decode",
        "512+64/many_decodes",
        "320+64/single_decode",
        "320+64/many_decodes",
        "64+16/single_decode",
        "64+16/many_decodes",
        "512+64/chunked_prefill",
        "320+64/chunked_prefill",
        "64+16/chunked_prefill",
    ]
    # The scale is not 1/sqrt(P + R): an impl ignoring its scale argument fails.
    assert cases[0].scale == pytest.approx(1.25 / (128 + 64) ** 0.5)


def test_a_backend_with_none_of_the_kits_splits_runs_nothing_and_fails(make_backend) -> None:
    backend = _mla_backend(make_backend, splits=[(448, 128)])
    report = check_backend(backend, features=["mixed"])
    assert report.cases == [] and not report.passed
    assert len(report.not_declared) == len(MLA_SHAPES)


def test_mla_backends_take_mla_feature_names_only(make_backend) -> None:
    with pytest.raises(ValueError, match=r"unknown MLA feature \(got gqa, expected names from"):
        plan_cases(_mla_backend(make_backend), features=["decode", "gqa"])


@pytest.mark.parametrize("block_size", [16, 64])
def test_context_chunks_case_needs_three_or_more_chunks(make_backend, block_size) -> None:
    backend = _mla_backend(make_backend, block_sizes=(block_size,))
    (case,), _ = plan_cases(backend, features=["context_chunks"])
    workspace = case.workspace_tokens
    assert case.block_size == block_size and workspace >= block_size
    assert case.spec == context_chunks_spec(workspace) and case.min_context_chunks == 3
    prefill_contexts = [
        c for q, c in zip(case.spec.query_lens, case.spec.context_lens, strict=True) if q > 1
    ]
    assert min(prefill_contexts) > workspace  # the workspace is smaller than each context
    assert sum(prefill_contexts) > 3 * workspace
    assert 1 in case.spec.query_lens  # with a decode among the prefills


def test_sweep_covers_each_declared_split_dtype_cache_dtype_and_block_size(make_backend) -> None:
    backend = _mla_backend(
        make_backend,
        splits=[(512, 64), (448, 128)],
        dtypes=(torch.bfloat16,),
        kv_cache_dtypes=("auto", "fp8_e4m3"),
        block_sizes=(MultipleOf(16),),
        features=("lse",),
    )
    cases, not_declared = declaration_cases(backend, "cpu")
    assert not_declared == []
    ids = [c.id for c in cases]
    assert ids[:2] == ["split-512+64-bfloat16", "split-448+128-bfloat16"]
    assert {"kv_cache_dtype-bfloat16-auto", "kv_cache_dtype-bfloat16-fp8_e4m3"} <= set(ids)
    assert {"block_size-16", "block_size-48", "feature-lse"} <= set(ids)
    unknown_split = cases[1].case.shape
    assert (unknown_split.qk_nope_head_dim, unknown_split.v_head_dim) == (128, 128)
    assert all(c.case.spec.name == f"sweep_b{c.case.block_size}" for c in cases)


def test_mla_shape_rejects_sizes_that_are_not_positive_ints() -> None:
    with pytest.raises(ValueError, match=r"MLAShape: v_head_dim must be a positive int \(got 0\)"):
        MLAShape(512, 64, 128, 0)
