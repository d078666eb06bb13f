"""Builders refuse, at construction, a KV-cache spec their kernels do not take (what
`validate_configuration` would have refused), instead of failing at the first plan or forward.
"""

from __future__ import annotations

import pytest
import torch
from fa_fakes import fa4, install

from anyattn.backends.flash_attn import FlashAttentionMetadataBuilder
from anyattn.backends.flashinfer import FlashInferMetadataBuilder
from anyattn.backends.flex_attention import FlexAttentionMetadataBuilder
from anyattn.backends.triton_attn import TritonAttentionMetadataBuilder
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.testing import layer_records

LIMITS = BatchLimits(8, 64, 1024)


@pytest.mark.parametrize(
    ("builder", "spec", "message"),
    [
        # 48 is a multiple of 16 (an engine block the runner would split), not a kernel block
        (
            FlashInferMetadataBuilder,
            AttentionSpec(48, 2, 128, torch.bfloat16),
            "kv_cache_spec.block_size not supported by FLASHINFER (got 48, expected 16, 32, 64)",
        ),
        (
            FlashInferMetadataBuilder,
            AttentionSpec(16, 2, 96, torch.bfloat16),
            "kv_cache_spec.head_size not supported by FLASHINFER (got 96, expected 64, 128, 256)",
        ),
        (
            FlashInferMetadataBuilder,
            AttentionSpec(16, 2, 128, torch.float32),
            "kv_cache_spec.dtype not supported by FLASHINFER (got float32, expected float16, "
            "bfloat16)",
        ),
        (
            FlashAttentionMetadataBuilder,
            AttentionSpec(8, 2, 128, torch.bfloat16),
            "kv_cache_spec.block_size not supported by FLASH_ATTN (got 8, expected multiple of 16)",
        ),
        (
            FlexAttentionMetadataBuilder,
            AttentionSpec(16, 2, 40, torch.float32),
            "kv_cache_spec.head_size not supported by FLEX_ATTENTION (got 40, expected 16, 32,",
        ),
        (
            TritonAttentionMetadataBuilder,
            AttentionSpec(16, 2, 12, torch.float16),
            "kv_cache_spec.head_size not supported by TRITON (got 12, expected 8, 16,",
        ),
    ],
    ids=["fi-block", "fi-head", "fi-dtype", "fa-block", "flex-head", "triton-head"],
)
def test_builders_refuse_specs_their_kernels_do_not_take(monkeypatch, builder, spec, message):
    install(monkeypatch, fa4())  # FLASH_ATTN's declarations follow the installed version
    with pytest.raises(ValueError) as raised:
        builder(spec, layer_records(spec), LIMITS, "cpu")
    assert message in str(raised.value)
    assert str(raised.value).startswith(builder.__name__)


def test_a_spec_the_backend_declares_is_taken():
    spec = AttentionSpec(16, 2, 64, torch.float32)
    builder = FlexAttentionMetadataBuilder(spec, layer_records(spec, ["layer.0"]), LIMITS, "cpu")
    assert builder.kv_cache_spec is spec
