"""The declaration sweep's plan: every declared value is covered, and its batch is as promised."""

from __future__ import annotations

import pytest
import torch

from anyattn.registry import AttentionBackendEnum, get_backend_class
from anyattn.testing.sweep import declaration_cases, sweep_spec
from anyattn.types import AttentionType, DeviceInfo, MultipleOf

SM90 = DeviceInfo.parse("sm90")


@pytest.mark.parametrize("block_size", [*range(3, 70), 96, 128, 256])
def test_decoder_batch_has_a_decode_a_fresh_prefill_and_a_long_chunk_off_the_block_grid(
    block_size,
):
    spec = sweep_spec(block_size)
    kinds = set()
    for q, context in zip(spec.query_lens, spec.context_lens, strict=True):
        kinds.add("decode" if q == 1 and context else "fresh" if not context else "chunk")
        if q > 1 and context:
            assert context > 2 * block_size  # spans three or more blocks
        for length in (q, context, q + context):
            assert length == 0 or length % block_size, (q, context)
    assert kinds == {"decode", "fresh", "chunk"}
    assert spec.query_lens[1] == 1  # the decode sits between prefills: reordering matters


@pytest.mark.parametrize("block_size", [5, 16, 48, 256])
def test_encoder_and_cross_batches_stay_off_the_block_grid(block_size):
    encoder = sweep_spec(block_size, AttentionType.ENCODER)
    assert encoder.seq_lens == encoder.query_lens
    cross = sweep_spec(block_size, AttentionType.ENCODER_DECODER)
    assert cross.encoder_seq_lens is not None
    for length in (*encoder.seq_lens, *cross.encoder_seq_lens):
        assert length % block_size
    assert max(cross.encoder_seq_lens) > 2 * block_size


# The standard sweep plans standard backends; MLA backends (TORCH_MLA) take MLA layers, whose
# cases (`MLACase`) and oracle are planned per latent split (the test after this one).
_STANDARD = [m.name for m in AttentionBackendEnum if not get_backend_class(m.name).is_mla()]
_MLA = [m.name for m in AttentionBackendEnum if get_backend_class(m.name).is_mla()]


@pytest.mark.parametrize("name", _STANDARD)
def test_every_declared_value_and_pair_is_planned(name):
    backend = get_backend_class(name)
    cases, not_declared = declaration_cases(backend, SM90)
    assert cases
    planned = {(c.case.head_size, c.dtype) for c in cases}
    refused = " ".join(not_declared)
    dtypes = [
        d for d in (torch.float32, torch.float16, torch.bfloat16) if backend.supports_dtype(d)
    ]
    head_sizes = backend.get_supported_head_sizes() or [64, 80, 96, 128, 256, 65]
    for head_size in head_sizes:
        for dtype in dtypes:
            assert (head_size, dtype) in planned, (head_size, dtype)
    pairs = {(c.dtype, c.case.kv_cache_dtype) for c in cases}
    for dtype in dtypes:
        for cache in backend.supported_kv_cache_dtypes:
            wanted = f"kv_cache_dtype-{str(dtype)[6:]}-{cache}"
            assert (dtype, cache) in pairs or wanted in refused, wanted
    assert {c.case.attn_type for c in cases} == set(backend.supported_attn_types)
    assert {c.case.layout for c in cases} == set(backend.supported_kv_cache_layouts())
    blocks = {c.case.block_size for c in cases}
    for declared in backend.get_supported_kernel_block_sizes() or [MultipleOf(1)]:
        if isinstance(declared, MultipleOf):
            n = declared.base
            assert n in blocks and 256 in blocks and any(b % n == 0 and b & (b - 1) for b in blocks)
        else:
            assert declared in blocks
    features = {c.id for c in cases if c.id.startswith("feature-")}
    for flag in ("sink", "sliding_window", "alibi", "logits_soft_cap", "non_causal", "lse"):
        if getattr(backend, f"supports_{flag}")():
            assert f"feature-{flag}" in features
    assert len({c.id for c in cases}) == len(cases)


@pytest.mark.parametrize("name", _MLA)
def test_every_declared_mla_split_dtype_and_cache_dtype_is_planned(name):
    backend = get_backend_class(name)
    cases, not_declared = declaration_cases(backend, SM90)
    # Only (dtype, cache dtype) pairs the backend's joint rules refuse are left out.
    refused = {entry.split(":")[0] for entry in not_declared}
    assert cases and all(r.startswith("kv_cache_dtype-") for r in refused), not_declared
    dtypes = [
        d for d in (torch.float32, torch.float16, torch.bfloat16) if backend.supports_dtype(d)
    ]
    splits = backend.get_supported_mla_splits() or [(512, 64), (320, 64), (64, 16)]
    planned = {(c.case.shape.kv_lora_rank, c.case.shape.qk_rope_head_dim, c.dtype) for c in cases}
    assert planned == {(rank, rope, d) for rank, rope in splits for d in dtypes}
    pairs = {(c.dtype, c.case.kv_cache_dtype) for c in cases}
    for d in dtypes:
        for cache in backend.supported_kv_cache_dtypes:
            wanted = f"kv_cache_dtype-{str(d)[6:]}-{cache}"
            assert ((d, cache) in pairs) != (wanted in refused), wanted
    assert ("feature-lse" in {c.id for c in cases}) == backend.supports_lse()
    assert len({c.id for c in cases}) == len(cases)


def test_a_backend_off_its_device_plans_nothing():
    assert declaration_cases(get_backend_class("FLASHINFER"), "cpu") == ([], [])


def test_the_sink_case_checks_the_lse_where_the_device_returns_it():
    # FLEX_ATTENTION declares sinks everywhere and LSE on CUDA only.
    flex = get_backend_class("FLEX_ATTENTION")
    for device, check_lse in ((DeviceInfo.cpu(), False), (SM90, True)):
        cases, _ = declaration_cases(flex, device)
        (sink,) = [c for c in cases if c.id == "feature-sink"]
        assert sink.case.check_lse is check_lse
