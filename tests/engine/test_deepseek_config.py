"""DeepSeek-V2/V3 configs read against transformers' own config and modules: MLA sizes, the
YaRN-scaled softmax scale, routing fields, the rope table and both rotary pairings; the
published DeepSeek-V2-Lite and V3 config.json files; refused configs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.rope import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_interleaved,
)

transformers = pytest.importorskip("transformers")

DEEPSEEK_MODELS = ("deepseek_v2", "deepseek_v2_group", "deepseek_v3", "deepseek_v3_512")


@pytest.mark.parametrize("kind", DEEPSEEK_MODELS)
def test_from_hf_agrees_with_transformers(kind, tiny_hf_model):
    folder, hf_model = tiny_hf_model(kind)
    hf = hf_model.config
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    attn = hf_model.model.layers[0].self_attn
    assert config.architecture == kind[:11]
    assert config.attention_scale == attn.scaling  # mscale^2 / sqrt(P + R) where YaRN sets it
    mla = config.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim) == (
        hf.q_lora_rank,
        hf.kv_lora_rank,
        hf.qk_rope_head_dim,
    )
    assert (mla.qk_nope_head_dim, mla.v_head_dim) == (hf.qk_nope_head_dim, hf.v_head_dim)
    assert mla.is_rope_interleaved == (kind.startswith("deepseek_v2") or hf.rope_interleave)
    assert config.head_dim == hf.head_dim == hf.qk_rope_head_dim
    moe = config.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        hf.n_routed_experts,
        hf.num_experts_per_tok,
        hf.moe_intermediate_size,
    )
    assert moe.num_shared_experts == hf.n_shared_experts
    assert moe.routed_scaling_factor == hf.routed_scaling_factor
    is_moe = [type(layer.mlp).__name__.endswith(("Moe", "MoE")) for layer in hf_model.model.layers]
    assert [moe.is_moe_layer(i) for i in range(config.num_hidden_layers)] == is_moe
    assert any(is_moe) and not all(is_moe)


# The published config.json files (the keys the engine reads, DeepSeek's spellings).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}


def _mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0


def test_reads_the_published_deepseek_v3_config():
    config = ModelConfig.from_hf(DEEPSEEK_V3)
    assert config.architecture == "deepseek_v3"
    assert config.mla.q_lora_rank == 1536 and config.mla.is_rope_interleaved
    assert config.mla.kv_lora_rank + config.mla.qk_rope_head_dim == 576
    assert config.attention_scale == pytest.approx(192**-0.5 * _mscale(40, 1.0) ** 2, rel=1e-12)
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["factor"] == 40
    moe = config.moe
    assert (moe.scoring, moe.topk_method, moe.n_group, moe.topk_group) == (
        "sigmoid",
        "noaux_tc",
        8,
        4,
    )
    assert moe.norm_topk_prob and moe.routed_scaling_factor == 2.5
    assert [moe.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert config.num_key_value_heads == 128 and config.dtype == torch.bfloat16


def test_reads_the_published_deepseek_v2_lite_config():
    config = ModelConfig.from_hf(DEEPSEEK_V2_LITE)
    assert config.architecture == "deepseek_v2"
    assert config.mla.q_lora_rank is None and config.mla.is_rope_interleaved
    assert config.attention_scale == pytest.approx(192**-0.5 * _mscale(40, 0.707) ** 2, rel=1e-12)
    moe = config.moe
    assert (moe.scoring, moe.topk_method, moe.n_group, moe.num_experts_per_tok) == (
        "softmax",
        "greedy",
        None,
        6,
    )
    assert not moe.norm_topk_prob and moe.num_shared_experts == 2


@pytest.mark.parametrize(
    ("base", "change", "match"),
    [
        (DEEPSEEK_V2_LITE, {"num_experts_per_tok": None}, "has no 'num_experts_per_tok'"),
        (DEEPSEEK_V2_LITE, {"topk_method": "noaux_tc"}, "unsupported topk_method for deepseek_v2"),
        (DEEPSEEK_V2_LITE, {"scoring_func": "sigmoid"}, "got scoring_func 'sigmoid'"),
        (DEEPSEEK_V3, {"topk_method": "group_limited_greedy"}, "expected one of noaux_tc"),
        (DEEPSEEK_V3, {"n_group": 7}, "n_group equal groups"),
        (DEEPSEEK_V3, {"topk_group": 9}, "topk_group must be <= n_group"),
        (DEEPSEEK_V3, {"n_group": 256, "topk_group": 8}, "at least 2 per group"),
        (DEEPSEEK_V3, {"num_experts_per_tok": 300}, "num_experts_per_tok exceeds"),
        (DEEPSEEK_V3, {"attention_bias": True}, "attention_bias is not supported"),
        (DEEPSEEK_V3, {"moe_layer_freq": 2}, "moe_layer_freq is not supported"),
        (DEEPSEEK_V3, {"kv_lora_rank": 0}, "kv_lora_rank must be a positive int"),
        (DEEPSEEK_V3, {"qk_rope_head_dim": 63}, "qk_rope_head_dim must be even"),
        (DEEPSEEK_V3, {"n_shared_experts": -1}, "n_shared_experts must be an int >= 0"),
    ],
)
def test_refuses_bad_deepseek_configs_naming_the_field(base, change, match):
    config = {k: v for k, v in {**base, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(config)


def test_q_lora_rank_null_means_one_query_projection_and_absent_means_the_default():
    assert ModelConfig.from_hf(DEEPSEEK_V2_LITE).mla.q_lora_rank is None
    config = dict(DEEPSEEK_V2_LITE)
    del config["q_lora_rank"]
    assert ModelConfig.from_hf(config).mla.q_lora_rank == 1536  # transformers' default


# ---------------------------------------------------------------------------------------------
# RoPE: the table and both pairings against transformers' DeepSeek code


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3_512"])
def test_rope_table_matches_transformers(kind, tiny_hf_model):
    folder, hf_model = tiny_hf_model(kind)
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    hf_rope = hf_model.model.rotary_emb
    table = RotaryEmbedding(
        config.head_dim,
        config.rope_theta,
        config.rope_scaling,
        config.max_position_embeddings,
        max_positions=128,
        dtype=torch.float32,
        device="cpu",
    )
    positions = torch.tensor([0, 1, 5, 31, 32, 100, 127])
    cos, signed_sin = table(positions)
    half = config.head_dim // 2
    if kind == "deepseek_v2":  # complex exponentials times the attention factor
        freqs_cis = hf_rope(torch.zeros(1), positions[None])[0]
        expected_cos, expected_sin = freqs_cis.real, freqs_cis.imag
    else:
        hf_cos, hf_sin = hf_rope(torch.zeros(1), positions[None])
        expected_cos, expected_sin = hf_cos[0, :, :half], hf_sin[0, :, :half]
    torch.testing.assert_close(cos[:, 0, :half], expected_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(signed_sin[:, 0, half:], expected_sin, atol=1e-6, rtol=0)


def _cos_sin(num_tokens: int, rope: int, generator: torch.Generator):
    angles = torch.rand(num_tokens, rope // 2, generator=generator) * 6.0
    emb = torch.cat((angles, angles), dim=-1)  # [num_tokens, rope], as RotaryEmbedding's
    signed_sin = torch.cat((-emb[:, : rope // 2].sin(), emb[:, rope // 2 :].sin()), dim=-1)
    return angles, emb.cos(), emb.sin(), signed_sin


def test_interleaved_rotation_matches_transformers_v2_and_v3():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 16, generator=generator)  # [num_tokens, num_heads, rope]
    k = torch.randn(5, 1, 16, generator=generator)
    angles, cos, sin, signed_sin = _cos_sin(5, 16, generator)
    ours_q = apply_rotary_interleaved(q, cos[:, None], signed_sin[:, None])
    ours_k = apply_rotary_interleaved(k, cos[:, None], signed_sin[:, None])
    # V3: the same layout (pairs' first elements, then second elements)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(ours_q, hf_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_k, hf_k, atol=1e-6, rtol=0)
    # V2: complex rotation in [batch, heads, tokens, rope], the pairs left interleaved
    freqs_cis = torch.polar(torch.ones_like(angles), angles)[None]  # [1, num_tokens, rope / 2]
    v2_q, v2_k = apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs_cis)
    v2_q, v2_k = v2_q[0].transpose(0, 1), v2_k[0].transpose(0, 1)
    deinterleave = torch.cat((torch.arange(0, 16, 2), torch.arange(1, 16, 2)))
    torch.testing.assert_close(ours_q, v2_q[..., deinterleave], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_k, v2_k[..., deinterleave], atol=1e-6, rtol=0)


def test_neox_rotation_matches_transformers_v3_without_interleave():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(1)
    q = torch.randn(4, 2, 8, generator=generator)
    k = torch.randn(4, 1, 8, generator=generator)
    _, cos, sin, signed_sin = _cos_sin(4, 8, generator)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(apply_rotary(q, cos[:, None], signed_sin[:, None]), hf_q)
    assert torch.equal(apply_rotary(k, cos[:, None], signed_sin[:, None]), hf_k)
