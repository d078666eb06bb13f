"""Engine models against transformers: config mapping, building blocks, and whole-model logits
of tiny random checkpoints over paged KV caches (prefill batches and mixed prefill/decode)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from anyattn.backends.torch_attn import TorchAttentionBackend
from anyattn.engine.hf_loader import load_hf_folder
from anyattn.engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from anyattn.engine.models import MODEL_REGISTRY, build_model
from anyattn.engine.models.layers import RMSNorm
from anyattn.engine.models.rope import RotaryEmbedding, apply_rotary, rope_inv_freq

transformers = pytest.importorskip("transformers")

KINDS = ("llama", "llama_tied", "qwen2", "mistral", "gemma2")
# docs/semantics.md ("Tolerance") asks for 1e-3 against transformers in fp32; these models land
# at 2e-6 .. 4e-6.
ATOL = RTOL = 2e-5


def _load(tiny_hf_model, kind: str, **kwargs):
    folder, hf_model = tiny_hf_model(kind)
    config, weights = load_hf_folder(folder)
    model = build_model(config, dtype=torch.float32, backend="TORCH", **kwargs)
    model.load_weights(weights)
    return model, hf_model


def _prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


# ---------------------------------------------------------------------------------------------
# Whole models


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_batch_matches_transformers(kind, tiny_hf_model, paged_runner, hf_logits):
    model, hf_model = _load(tiny_hf_model, kind)
    vocab = model.config.vocab_size
    # Lengths straddle the windows (Mistral 5, Gemma2 4) and the block size (4).
    prompts = {"a": _prompt(1, 13, vocab), "b": _prompt(2, 1, vocab), "c": _prompt(3, 7, vocab)}
    outputs = paged_runner(model).step(list(prompts.items()))
    for (rid, prompt), logits in zip(prompts.items(), outputs, strict=True):
        ref = hf_logits(hf_model, prompt)
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL, msg=f"request {rid}")


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_prefill_and_decode_steps_match_transformers(
    kind, tiny_hf_model, paged_runner, hf_logits
):
    """Chunked prefills next to decodes, then three decode steps, against transformers' logits
    of the full sequences (causal: position p sees tokens <= p only)."""
    model, hf_model = _load(tiny_hf_model, kind)
    vocab = model.config.vocab_size
    seqs = {"a": _prompt(4, 12, vocab), "b": _prompt(5, 9, vocab), "c": _prompt(6, 15, vocab)}
    # (request, start, end) per step; decodes first in every step, as the TORCH builder asks.
    schedule = [
        [("a", 0, 9), ("b", 0, 4)],
        [("a", 9, 10), ("b", 4, 6), ("c", 0, 7)],
        [("a", 10, 11), ("b", 6, 7), ("c", 7, 12)],
        [("a", 11, 12), ("b", 7, 8), ("c", 12, 13)],
        [("b", 8, 9), ("c", 13, 14)],
        [("c", 14, 15)],
    ]
    refs = {rid: hf_logits(hf_model, seq) for rid, seq in seqs.items()}
    runner = paged_runner(model)
    for number, step in enumerate(schedule):
        outputs = runner.step([(rid, seqs[rid][start:end]) for rid, start, end in step])
        for (rid, start, end), logits in zip(step, outputs, strict=True):
            torch.testing.assert_close(
                logits,
                refs[rid][start:end],
                atol=ATOL,
                rtol=RTOL,
                msg=f"step {number}, request {rid}, positions {start}..{end - 1}",
            )


def test_bfloat16_error_within_twice_transformers_bfloat16_error(
    tiny_hf_model, paged_runner, hf_logits
):
    """docs/semantics.md's 16-bit whole-model rule ("Tolerance"): our bf16 error against the
    fp32 reference may be at most twice transformers' own bf16 error."""
    folder, hf_model = tiny_hf_model("llama")
    config, weights = load_hf_folder(folder)
    model = build_model(config, dtype=torch.bfloat16, backend="TORCH")
    model.load_weights(weights)
    assert model.embed_weight.dtype == torch.bfloat16
    prompt = _prompt(7, 9, config.vocab_size)
    logits = paged_runner(model).step([("a", prompt)])[0]
    assert logits.dtype == torch.float32
    reference = hf_logits(hf_model, prompt)
    hf_bf16_error = (hf_logits(copy.deepcopy(hf_model).bfloat16(), prompt) - reference).abs().max()
    assert (logits - reference).abs().max() <= 2 * hf_bf16_error


@pytest.mark.parametrize("kind", KINDS)
def test_attention_layers_in_order_with_their_windows(kind, tiny_hf_model):
    model, hf_model = _load(tiny_hf_model, kind)
    layers = model.attention_layers()
    assert [layer.layer_name for layer in layers] == [
        f"model.layers.{i}.self_attn.attn" for i in range(model.config.num_hidden_layers)
    ]
    hf_windows = [
        getattr(layer.self_attn, "sliding_window", None) for layer in hf_model.model.layers
    ]
    if kind == "mistral":  # transformers reads Mistral's window from the config in every layer
        hf_windows = [hf_model.config.sliding_window] * len(layers)
    assert [layer.impl.sliding_window for layer in layers] == hf_windows
    assert all(layer.backend is TorchAttentionBackend for layer in layers)


def test_selector_picks_a_backend_per_layer_when_none_is_given(tiny_hf_model):
    folder, _ = tiny_hf_model("gemma2")
    config, _ = load_hf_folder(folder)
    model = build_model(config, dtype=torch.float32)
    assert {layer.backend.get_name() for layer in model.attention_layers()} == {"TORCH"}


# ---------------------------------------------------------------------------------------------
# Weight loading


def _state_dict(tiny_hf_model, kind: str) -> dict[str, torch.Tensor]:
    _, hf_model = tiny_hf_model(kind)
    return {k: v.clone() for k, v in hf_model.state_dict().items()}


def test_load_weights_names_missing_unexpected_and_misshaped(tiny_hf_model):
    model, _ = _load(tiny_hf_model, "qwen2")
    weights = _state_dict(tiny_hf_model, "qwen2")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    weights["model.norm.weight"] = torch.zeros(7)
    with pytest.raises(ValueError) as info:
        model.load_weights(weights.items())
    message = str(info.value)
    assert "missing: model.layers.1.self_attn.k_proj.bias" in message
    assert "unexpected: model.layers.0.mlp.extra.weight" in message
    assert "model.norm.weight (got (7,), expected (64,))" in message


def test_load_weights_casts_and_ignores_tied_head_and_rotary_buffers(tiny_hf_model):
    folder, _ = tiny_hf_model("llama_tied")
    config, _ = load_hf_folder(folder)
    model = build_model(config, dtype=torch.float32, backend="TORCH")
    weights = _state_dict(tiny_hf_model, "llama_tied")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    weights["model.rotary_emb.inv_freq"] = torch.ones(8)
    model.load_weights((name, w.to(torch.bfloat16)) for name, w in weights.items())
    # tied: the embedding is the head's weight (its row-major copy, float32 on the CPU)
    assert model.embed_weight is model.lm_head.weight_rows
    assert torch.equal(model.lm_head.weight, model.embed_weight)
    expected = weights["model.layers.2.self_attn.v_proj.weight"].to(torch.bfloat16).float()
    q, kv = model.layers[2].self_attn.q_size, model.layers[2].self_attn.kv_size
    qkv = model.layers[2].self_attn.qkv
    assert torch.equal(qkv.weight[q + kv :], expected)
    assert torch.equal(qkv.weight_rows[q + kv :], expected)


def test_build_model_rejects_unknown_architecture():
    config = ModelConfig(
        architecture="gpt2",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
    )
    with pytest.raises(ValueError, match="llama, mistral, qwen2, gemma2"):
        build_model(config, dtype=torch.float32)
    assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES.values())


# ---------------------------------------------------------------------------------------------
# Building blocks


def _hf_llama_config(**rope):
    return transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 500000.0, **rope},
    )


ROPE_VARIANTS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.5},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 256,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 2048,
        "attention_factor": 0.9,
    },
}


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_rope_matches_transformers(variant):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = _hf_llama_config(**ROPE_VARIANTS[variant])
    ours = ModelConfig.from_hf({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    hf_rope = LlamaRotaryEmbedding(hf_config)
    inv_freq, factor = rope_inv_freq(
        ours.head_dim, ours.rope_theta, ours.rope_scaling, ours.max_position_embeddings
    )
    assert torch.equal(inv_freq, hf_rope.inv_freq)
    assert factor == hf_rope.attention_scaling

    positions = torch.tensor([0, 1, 2, 17, 511, 1000, 4095])
    table = RotaryEmbedding(
        ours.head_dim,
        ours.rope_theta,
        ours.rope_scaling,
        ours.max_position_embeddings,
        max_positions=4096,
        dtype=torch.float32,
        device="cpu",
    )
    cos, signed_sin = table(positions)
    hf_cos, hf_sin = hf_rope(torch.zeros(1), positions[None])
    half = ours.head_dim // 2
    # cos/sin of the same float32 angles; vectorised and scalar tails may differ by an ulp.
    torch.testing.assert_close(cos[:, 0], hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(signed_sin[:, 0, half:], hf_sin[0, :, half:], atol=1e-6, rtol=0)
    torch.testing.assert_close(-signed_sin[:, 0, :half], hf_sin[0, :, :half], atol=1e-6, rtol=0)


def test_apply_rotary_is_bitwise_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 16, generator=generator)  # [num_tokens, num_heads, head_size]
    k = torch.randn(5, 2, 16, generator=generator)
    cos, sin = torch.randn(2, 5, 16, generator=generator)
    signed_sin = torch.cat((-sin[:, :8], sin[:, 8:]), dim=-1)
    # transformers broadcasts [num_tokens, head_size] over heads at unsqueeze_dim=1
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    ours = apply_rotary(torch.cat((q, k), dim=1), cos[:, None], signed_sin[:, None])
    assert torch.equal(ours[:, :4], hf_q)
    assert torch.equal(ours[:, 4:], hf_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_matches_transformers(dtype, gemma):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(0)
    hidden = 576
    x = (3 * torch.randn(37, hidden, generator=generator)).to(dtype)
    weight = torch.randn(hidden, generator=generator)
    hf_norm = (Gemma2RMSNorm if gemma else LlamaRMSNorm)(hidden, eps=1e-5).to(dtype)
    ours = RMSNorm(hidden, 1e-5, dtype=dtype, device="cpu", has_unit_offset=gemma)
    with torch.no_grad():
        hf_norm.weight.copy_(weight)
        for name, slot in ours.weight_slots("norm"):
            slot.target.copy_(slot.transform(weight.to(dtype)) if slot.transform else weight)
            assert name == "norm.weight"
        expected = hf_norm(x)
        got = ours(x)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------
# Config mapping


@pytest.mark.parametrize("kind", KINDS)
def test_from_hf_agrees_with_transformers_config(kind, tiny_hf_model):
    folder, hf_model = tiny_hf_model(kind)
    hf = hf_model.config
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert config.architecture == kind.removesuffix("_tied")
    assert (config.hidden_size, config.num_hidden_layers) == (hf.hidden_size, hf.num_hidden_layers)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf_model.model.layers[0].self_attn.head_dim,
    )
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.attention_scale == hf_model.model.layers[0].self_attn.scaling
    assert config.dtype == torch.float32
    assert config.eos_token_ids == (() if hf.eos_token_id is None else (hf.eos_token_id,))


SMOLLM2_135M = {  # transformers 4.x style: rope_theta, rope_scaling, torch_dtype
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 49152,
}


def test_from_hf_reads_a_transformers_4_smollm2_config():
    config = ModelConfig.from_hf(SMOLLM2_135M)
    assert config.architecture == "llama"
    assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (64, 3, 100000.0)
    assert config.rope_scaling is None
    assert config.tie_word_embeddings and config.dtype == torch.bfloat16
    assert config.layer_sliding_windows == (None,) * 30
    assert not (config.attention_bias or config.o_proj_bias or config.mlp_bias)
    assert config.attention_scale == 64**-0.5


def test_from_hf_reads_llama31_rope_scaling_and_eos_list():
    config = ModelConfig.from_hf(
        {
            **SMOLLM2_135M,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "eos_token_id": [128001, 128008, 128009],
        }
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config.eos_token_ids == (128001, 128008, 128009)


def test_from_hf_linear_scaling_with_old_type_key():
    config = ModelConfig.from_hf({**SMOLLM2_135M, "rope_scaling": {"type": "linear", "factor": 2}})
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, 4096),  # MistralConfig's default
        ({"sliding_window": None}, None),  # Mistral v0.2+: no window
        ({"sliding_window": 7}, 7),
    ],
)
def test_from_hf_mistral_sliding_window(extra, expected):
    base = {**SMOLLM2_135M, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    base.pop("tie_word_embeddings")
    config = ModelConfig.from_hf({**base, **extra})
    assert config.sliding_window == expected
    assert config.layer_sliding_windows == (expected,) * 30


def test_from_hf_qwen2_window_needs_use_sliding_window():
    base = {**SMOLLM2_135M, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    assert ModelConfig.from_hf(base).layer_sliding_windows == (None,) * 30
    assert ModelConfig.from_hf(base).attention_bias
    assert not ModelConfig.from_hf(base).o_proj_bias
    config = ModelConfig.from_hf({**base, "use_sliding_window": True, "max_window_layers": 28})
    assert config.layer_sliding_windows == (None,) * 28 + (64, 64)


def test_from_hf_gemma2_defaults_alternate_windows():
    config = ModelConfig.from_hf(
        {
            "architectures": ["Gemma2ForCausalLM"],
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "gelu",  # gemma2 reads hidden_activation
        }
    )
    assert config.layer_sliding_windows == (4096, None, 4096, None)
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.attention_scale == 256**-0.5
    assert config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_id) == (2, 1)


def test_from_hf_accepts_model_type_without_architectures():
    config = dict(SMOLLM2_135M)
    del config["architectures"]
    assert ModelConfig.from_hf(config).architecture == "llama"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "unsupported architecture.*LlamaForCausalLM, MistralForCausalLM, "
            "Qwen2ForCausalLM, Gemma2ForCausalLM",
        ),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "unsupported RoPE type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "low_freq_factor"),
        ({"hidden_size": None}, "has no 'hidden_size'"),
        ({"num_attention_heads": "9"}, "num_attention_heads must be a positive int"),
        ({"num_key_value_heads": 2}, "multiple of num_key_value_heads"),
        ({"hidden_act": "relu"}, "unsupported hidden_act"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        ({"torch_dtype": "int8"}, "unknown dtype"),
    ],
)
def test_from_hf_rejects_bad_configs(change, match):
    config = {**SMOLLM2_135M, **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(config)


def test_model_config_is_frozen():
    config = ModelConfig.from_hf(SMOLLM2_135M)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 1  # type: ignore[misc]
