"""anyattn.config: the frozen selector config, batch limits and KV-cache specs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits, MLAAttentionSpec
from anyattn.types import AttentionType

BOOL_FIELDS = list(AttentionSelectorConfig.flag_names())


def test_selector_config_defaults():
    config = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16)
    assert config.kv_cache_dtype == "auto"
    assert config.block_size is None and config.num_heads is None and config.num_kv_heads is None
    assert config.attn_type is AttentionType.DECODER
    assert all(getattr(config, name) is False for name in BOOL_FIELDS)
    assert config.cache_dtype is torch.bfloat16


def test_selector_config_fields_match_design():
    names = [f.name for f in dataclasses.fields(AttentionSelectorConfig)]
    assert names == [
        "head_size",
        "dtype",
        "kv_cache_dtype",
        "block_size",
        "num_heads",
        "num_kv_heads",
        "use_mla",
        "has_sink",
        "use_sparse",
        "attn_type",
        "has_sliding_window",
        "has_alibi",
        "has_logits_soft_cap",
        "use_non_causal",
        "use_per_head_quant_scales",
        "use_batch_invariant",
        "needs_lse",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
    ]


def test_selector_config_normalises_strings():
    config = AttentionSelectorConfig(
        head_size=64, dtype="bf16", kv_cache_dtype=None, attn_type="encoder_only"
    )
    assert config.dtype is torch.bfloat16
    assert config.kv_cache_dtype == "auto"
    assert config.attn_type is AttentionType.ENCODER_ONLY
    assert config == AttentionSelectorConfig(
        head_size=64, dtype=torch.bfloat16, attn_type=AttentionType.ENCODER_ONLY
    )


def test_selector_config_is_frozen_and_hashable():
    a = AttentionSelectorConfig(head_size=64, dtype="float16", num_heads=8, num_kv_heads=2)
    b = AttentionSelectorConfig(head_size=64, dtype=torch.float16, num_heads=8, num_kv_heads=2)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.head_size = 128  # type: ignore[misc]


def test_selector_config_replace_validates_again():
    config = AttentionSelectorConfig(head_size=64, dtype="float16")
    assert config.replace(kv_cache_dtype="fp8").cache_dtype is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="unknown KV-cache dtype"):
        config.replace(kv_cache_dtype="fp4")


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"head_size": 0}, ValueError, "head_size must be a positive int (got 0)"),
        ({"head_size": -64}, ValueError, "head_size must be a positive int (got -64)"),
        ({"head_size": True}, ValueError, "head_size must be a positive int (got True)"),
        ({"head_size": 64.0}, ValueError, "head_size must be a positive int (got 64.0)"),
        ({"dtype": "float8"}, ValueError, "dtype: unknown dtype (got 'float8'"),
        ({"dtype": torch.float64}, ValueError, "unsupported model dtype (got torch.float64"),
        ({"kv_cache_dtype": "int8"}, ValueError, "unknown KV-cache dtype (got 'int8'"),
        ({"attn_type": "cross"}, ValueError, "unknown attn_type (got 'cross', expected one of"),
        ({"block_size": 0}, ValueError, "block_size must be a positive int or None (got 0)"),
        ({"num_heads": 0}, ValueError, "num_heads must be a positive int or None (got 0)"),
        ({"num_kv_heads": -1}, ValueError, "num_kv_heads must be a positive int or None"),
        (
            {"num_heads": 8, "num_kv_heads": 3},
            ValueError,
            "num_heads must be a multiple of num_kv_heads (got num_heads=8, num_kv_heads=3)",
        ),
        ({"has_sink": 1}, TypeError, "has_sink must be a bool (got 1)"),
        ({"needs_lse": "yes"}, TypeError, "needs_lse must be a bool (got 'yes')"),
    ],
)
def test_selector_config_errors(changes, error, message):
    kwargs = {"head_size": 64, "dtype": "float16", **changes}
    with pytest.raises(error) as raised:
        AttentionSelectorConfig(**kwargs)
    assert str(raised.value).startswith("AttentionSelectorConfig: ")
    assert message in str(raised.value)


def test_batch_limits():
    limits = BatchLimits(
        max_num_reqs=8, max_num_tokens=256, max_model_len=4096, cudagraph_capture_sizes=[8, 1, 4, 8]
    )
    assert limits.num_speculative_tokens == 0
    assert limits.cudagraph_capture_sizes == (1, 4, 8)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_num_reqs": 0}, "max_num_reqs must be a positive int (got 0)"),
        ({"max_num_tokens": None}, "max_num_tokens must be a positive int (got None)"),
        ({"max_model_len": -1}, "max_model_len must be a positive int (got -1)"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens must be an int >= 0 (got -1)"),
        ({"cudagraph_capture_sizes": (1, 0)}, "cudagraph_capture_sizes entry must be a positive"),
    ],
)
def test_batch_limits_errors(changes, message):
    kwargs = {"max_num_reqs": 8, "max_num_tokens": 256, "max_model_len": 4096, **changes}
    with pytest.raises(ValueError, match=r"^BatchLimits: ") as raised:
        BatchLimits(**kwargs)
    assert message in str(raised.value)


def test_batch_limits_persistent_graph_inputs_is_a_bool():
    assert not BatchLimits(8, 256, 4096).has_persistent_graph_inputs
    assert BatchLimits(8, 256, 4096, has_persistent_graph_inputs=True).has_persistent_graph_inputs
    with pytest.raises(TypeError, match=r"^BatchLimits: has_persistent_graph_inputs must be a"):
        BatchLimits(8, 256, 4096, has_persistent_graph_inputs=1)


def test_attention_spec_page_size():
    spec = AttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert spec.cache_dtype is torch.bfloat16
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2
    fp8 = AttentionSpec(16, 8, 128, torch.bfloat16, kv_cache_dtype="fp8_e5m2", sliding_window=4)
    assert fp8.cache_dtype is torch.float8_e5m2
    assert fp8.page_size_bytes == 2 * 16 * 8 * 128


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"block_size": 0}, "AttentionSpec: block_size must be a positive int (got 0)"),
        ({"num_kv_heads": 0}, "AttentionSpec: num_kv_heads must be a positive int (got 0)"),
        ({"head_size": 0}, "AttentionSpec: head_size must be a positive int (got 0)"),
        ({"sliding_window": 0}, "AttentionSpec: sliding_window must be a positive int or None"),
        ({"dtype": "int8"}, "AttentionSpec: dtype: unknown dtype (got 'int8'"),
        ({"kv_cache_dtype": "fp4"}, "AttentionSpec: kv_cache_dtype: unknown KV-cache dtype"),
    ],
)
def test_attention_spec_errors(changes, message):
    kwargs = {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype": "float16", **changes}
    with pytest.raises(ValueError) as raised:
        AttentionSpec(**kwargs)
    assert message in str(raised.value)


MLA_SIZES = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
             "v_head_dim": 128}  # fmt: skip


def test_mla_spec():
    spec = MLAAttentionSpec(block_size=64, dtype="bfloat16", **MLA_SIZES)
    assert (spec.head_size, spec.num_kv_heads, spec.sliding_window) == (576, 1, None)
    assert isinstance(spec, AttentionSpec)
    assert spec.page_size_bytes == 64 * 576 * 2
    fp8 = MLAAttentionSpec(block_size=64, dtype="bfloat16", kv_cache_dtype="fp8", **MLA_SIZES)
    assert fp8.page_size_bytes == 64 * 576
    assert MLAAttentionSpec(block_size=64, dtype="bfloat16", head_size=576, **MLA_SIZES) == spec
    with pytest.raises(ValueError, match=r"MLAAttentionSpec: num_kv_heads must be 1.*\(got 2\)"):
        MLAAttentionSpec(block_size=64, num_kv_heads=2, dtype="bfloat16", **MLA_SIZES)
    with pytest.raises(ValueError, match=r"head_size must be kv_lora_rank \+ qk_rope_head_dim "
                       r"\(got 512, expected 512 \+ 64 = 576\)"):  # fmt: skip
        MLAAttentionSpec(block_size=64, dtype="bfloat16", head_size=512, **MLA_SIZES)
    with pytest.raises(ValueError, match=r"MLAAttentionSpec: v_head_dim must be a positive int"):
        MLAAttentionSpec(block_size=64, dtype="bfloat16", **{**MLA_SIZES, "v_head_dim": 0})


def test_selector_config_qk_rope_head_dim():
    config = AttentionSelectorConfig(576, "bfloat16", use_mla=True, qk_rope_head_dim=64)
    assert config.qk_rope_head_dim == 64
    with pytest.raises(ValueError, match=r"qk_rope_head_dim is for MLA layers \(got "
                       r"qk_rope_head_dim=64 with use_mla=False"):  # fmt: skip
        AttentionSelectorConfig(576, "bfloat16", qk_rope_head_dim=64)
    with pytest.raises(ValueError, match=r"must be smaller than head_size.*\(got 576 for "):
        AttentionSelectorConfig(576, "bfloat16", use_mla=True, qk_rope_head_dim=576)
