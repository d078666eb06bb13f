"""`ModelConfig`: the engine's normalised view of a model's hyper-parameters, read by `from_hf`
from the spellings `config.json` files use across architectures and transformers versions,
absent keys taking the defaults of transformers 5.24's config class of the architecture.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from anyattn.engine.deepseek_config import (
    DEEPSEEK_ARCHITECTURES,
    MLAConfig,
    MoEConfig,
    int_field,
    read_deepseek,
)
from anyattn.types import parse_dtype

__all__ = ["ROPE_TYPES", "SUPPORTED_ARCHITECTURES", "ModelConfig"]

# Hugging Face class name -> our architecture name (also accepted: the `model_type` values).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma2ForCausalLM": "gemma2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")

# What transformers 5.24 assumes when a key is absent from config.json, per architecture.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "gemma2": {
        "max_position_embeddings": 8192,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "deepseek_v2": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "deepseek_v3": {"max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1},
}
_API = "ModelConfig.from_hf"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer, as the engine's models need it (transformers' names).

    Attributes:
        architecture: "llama", "mistral", "qwen2", "gemma2", "deepseek_v2" or "deepseek_v3"
            (the key of `MODEL_REGISTRY`).
        head_dim: the size of each attention head; for DeepSeek (MLA) models the rotary size
            `qk_rope_head_dim`, as in transformers' config (the head sizes are in `mla`).
        intermediate_size: the dense MLP's (DeepSeek: of its first `first_k_dense_replace`
            layers).
        rope_scaling: None for plain RoPE, else {"rope_type": one of `ROPE_TYPES` but
            "default", and that type's parameters as transformers names them}.
        attention_bias / o_proj_bias / mlp_bias: q/k/v, output and MLP projections have biases.
        sliding_window: the widest window W (keys `p - W < j <= p`), None without one;
            `layer_sliding_windows`: W per layer (None: full attention).
        attn_logit_softcapping, final_logit_softcapping, query_pre_attn_scalar: Gemma2's (scores
            scaled by `query_pre_attn_scalar ** -0.5`); None elsewhere.
        eos_token_id: an id, a tuple of ids, or None (see `eos_token_ids`).
        dtype: the checkpoint's dtype from config.json, else None.
        mla, moe: DeepSeek's latent attention and mixture of experts; None for other models.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_sliding_windows: tuple[int | None, ...] = ()
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if not self.layer_sliding_windows:
            windows = (self.sliding_window,) * self.num_hidden_layers
            object.__setattr__(self, "layer_sliding_windows", windows)
        if len(self.layer_sliding_windows) != self.num_hidden_layers:
            raise ValueError(
                f"ModelConfig: layer_sliding_windows must have one entry per layer (got "
                f"{len(self.layer_sliding_windows)}, expected {self.num_hidden_layers})."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig: num_attention_heads must be a multiple of num_key_value_heads (got "
                f"{self.num_attention_heads} and {self.num_key_value_heads})."
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim must be even for RoPE (got {self.head_dim}).")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"ModelConfig: unsupported hidden_act (got {self.hidden_act!r}, expected one of "
                f"{', '.join(ACTIVATIONS)})."
            )

    @property
    def attention_scale(self) -> float:
        """The factor applied to `q·k`: `query_pre_attn_scalar ** -0.5` or `head_dim ** -0.5`
        (MLA: `mla.scale`)."""
        if self.mla is not None:
            return self.mla.scale
        scalar = self.query_pre_attn_scalar or self.head_dim
        return scalar**-0.5

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id (empty when the config names none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return self.eos_token_id

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Read the `config.json` dict of a Llama (SmolLM2 included), Mistral, Qwen2, Gemma2,
        DeepSeek-V2 or DeepSeek-V3 checkpoint written by transformers 4.x or 5.x. ValueError:
        an unsupported architecture or feature, or a missing or ill-typed field; the message
        says which."""
        arch = _architecture(config)
        cfg = _with_defaults(arch, config)
        hidden = int_field(cfg, "hidden_size")
        num_heads = int_field(cfg, "num_attention_heads")
        num_layers = int_field(cfg, "num_hidden_layers")
        has_kv_heads = cfg.get("num_key_value_heads") is not None
        num_kv_heads = int_field(cfg, "num_key_value_heads") if has_kv_heads else num_heads
        head_dim = int_field(cfg, "head_dim") if "head_dim" in cfg else hidden // num_heads
        max_pos = int_field(cfg, "max_position_embeddings")
        theta, rope_scaling = _rope(cfg, max_pos)
        mla = moe = None
        if arch in DEEPSEEK_ARCHITECTURES:
            mla, moe = read_deepseek(arch, config, rope_scaling)
            # MLA has one latent "KV head"; the rope table is of the rotary part only.
            num_kv_heads, head_dim = num_heads, mla.qk_rope_head_dim
        windows = _sliding_windows(arch, cfg, num_layers)
        is_gemma = arch == "gemma2"
        if is_gemma and cfg.get("use_bidirectional_attention"):
            raise ValueError(
                f"{_API}: use_bidirectional_attention is not supported (got True, expected "
                "false or null)."
            )
        has_attn_bias = bool(cfg.get("attention_bias", False))
        dtype_name = cfg.get("dtype", cfg.get("torch_dtype"))
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int_field(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=int_field(cfg, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes biases on q/k/v only; Llama and Gemma2 put attention_bias on all
            # four projections; Mistral has none.
            attention_bias=arch == "qwen2" or (arch != "mistral" and has_attn_bias),
            o_proj_bias=arch in ("llama", "gemma2") and has_attn_bias,
            mlp_bias=arch in ("llama", "deepseek_v2") and bool(cfg.get("mlp_bias", False)),
            sliding_window=max((w for w in windows if w is not None), default=None),
            layer_sliding_windows=windows,
            attn_logit_softcapping=_float_or_none(cfg, "attn_logit_softcapping", is_gemma),
            final_logit_softcapping=_float_or_none(cfg, "final_logit_softcapping", is_gemma),
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if is_gemma else None,
            hidden_act=str(cfg.get("hidden_activation" if is_gemma else "hidden_act", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list | tuple) else eos,
            dtype=None
            if dtype_name is None
            else parse_dtype(dtype_name, argument=f"{_API}: dtype"),
            mla=mla,
            moe=moe,
        )


def _architecture(config: Mapping[str, Any]) -> str:
    names = list(config.get("architectures") or [])
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    model_type = config.get("model_type")
    if not names and model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    got = ", ".join(names) if names else f"model_type={model_type!r}"
    raise ValueError(
        f"{_API}: unsupported architecture (got {got}, expected one of "
        f"{', '.join(SUPPORTED_ARCHITECTURES)})."
    )


def _with_defaults(arch: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` over the architecture's defaults; null counts as absent, except where null
    means "none" (no window, no soft cap, no token id, as many KV heads as heads)."""
    cfg = {**_DEFAULTS[arch], **{k: v for k, v in config.items() if v is not None}}
    nullable = (
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "num_key_value_heads",
        "bos_token_id",
        "eos_token_id",
    )
    for key in nullable:
        if key in config and config[key] is None:
            cfg[key] = None
    return cfg


def _float_or_none(cfg: Mapping[str, Any], key: str, is_used: bool) -> float | None:
    value = cfg.get(key) if is_used else None
    return None if value is None else float(value)


def _rope(cfg: Mapping[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling), merged as transformers 5 does: `rope_scaling` over
    `rope_parameters`, a theta inside the dict over the top-level `rope_theta`."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    layer_types = set(cfg.get("layer_types") or ())
    if layer_types & set(params):
        raise ValueError(
            f"{_API}: per-layer RoPE parameters are not supported (got rope parameters keyed by "
            f"{sorted(layer_types & set(params))}, expected one flat dict)."
        )
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ValueError(
            f"{_API}: partial rotary embeddings are not supported (got partial_rotary_factor "
            f"{partial}, expected 1.0)."
        )
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{_API}: unsupported RoPE type (got {rope_type!r}, expected one of "
            f"{', '.join(ROPE_TYPES)})."
        )
    if rope_type == "default":
        return theta, None
    required = {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "yarn": ("factor",),
    }[rope_type]
    missing = [key for key in required if key not in params]
    if missing:
        raise ValueError(
            f"{_API}: {rope_type} RoPE scaling needs {', '.join(missing)} (got keys "
            f"{sorted(params)})."
        )
    if rope_type in ("llama3", "yarn"):
        # transformers takes a top-level original_max_position_embeddings first (Phi3 style).
        original = cfg.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", max_pos
        )
        params["original_max_position_embeddings"] = int(original)
    return theta, {"rope_type": rope_type, **params}


def _sliding_windows(arch: str, cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """The window of every layer; None means full attention."""
    if arch in ("llama", *DEEPSEEK_ARCHITECTURES):
        return (None,) * num_layers
    window = cfg.get("sliding_window")
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"{_API}: sliding_window must be a positive int or null (got {window!r}).")
    if arch == "mistral":
        # Mistral applies its window to every layer (transformers ignores its layer_types).
        return (window,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        if arch == "qwen2":  # the layers from max_window_layers on slide
            first = int(cfg.get("max_window_layers", 28))
            slides = [i >= first for i in range(num_layers)]
        else:  # Gemma2: even layers slide, odd layers see everything
            slides = [i % 2 == 0 for i in range(num_layers)]
        layer_types = ["sliding_attention" if s else "full_attention" for s in slides]
    known = {"sliding_attention", "full_attention"}
    if len(layer_types) != num_layers or not set(layer_types) <= known:
        raise ValueError(
            f"{_API}: layer_types must list 'sliding_attention' or 'full_attention' for each of "
            f"the {num_layers} layers (got {layer_types!r})."
        )
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
