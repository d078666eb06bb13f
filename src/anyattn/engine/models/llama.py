"""The Llama graph: Llama 2/3, SmolLM2, Mistral (sliding window) and Qwen2 (q/k/v biases).

Pre-norm decoder layers: `h += attn(norm(h))`, `h += mlp(norm(h))`, SwiGLU MLP, GQA, RoPE.
The four families differ only in what `ModelConfig` already records (biases, per-layer
sliding windows, tied embeddings, RoPE scaling), so one class serves them all.
"""

from __future__ import annotations

import torch
from torch import nn

from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.base import CausalLM
from anyattn.engine.models.layers import GatedMLP, RMSNorm, SelfAttention, Slots

__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM"]


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer; `index` picks its sliding window from the config."""

    def __init__(self, config: ModelConfig, index: int, attn_kwargs: dict[str, object]) -> None:
        super().__init__()
        factory = {"dtype": attn_kwargs["dtype"], "device": attn_kwargs["device"]}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = SelfAttention.from_config(config, index, attn_kwargs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            has_bias=config.mlp_bias,
            **factory,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: object,
    ) -> torch.Tensor:
        """hidden: `[num_tokens, hidden_size]` -> same shape."""
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), cos, sin, kv_cache, attn_metadata
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def weight_slots(self, prefix: str) -> Slots:
        yield from self.input_layernorm.weight_slots(f"{prefix}.input_layernorm")
        yield from self.self_attn.weight_slots(f"{prefix}.self_attn")
        yield from self.post_attention_layernorm.weight_slots(f"{prefix}.post_attention_layernorm")
        yield from self.mlp.weight_slots(f"{prefix}.mlp")


class LlamaForCausalLM(CausalLM):
    """Llama, SmolLM2, Mistral and Qwen2 (see `CausalLM` for the interface)."""

    def make_layer(self, index: int, attn_kwargs: dict[str, object]) -> nn.Module:
        return LlamaDecoderLayer(self.config, index, attn_kwargs)
