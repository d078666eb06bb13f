"""Gemma2: the Llama graph with Gemma's changes.

- the token embedding is scaled by `sqrt(hidden_size)` (in the model dtype);
- RMSNorm scales by `1 + weight`;
- each layer norms the attention and MLP outputs as well as their inputs (four norms);
- the MLP is GeGLU (`gelu_pytorch_tanh`);
- scores are scaled by `query_pre_attn_scalar ** -0.5` and soft-capped;
- even layers use a sliding window, odd layers full attention (from `layer_types`);
- the output logits are soft-capped (`CausalLM.compute_logits`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.base import CausalLM
from anyattn.engine.models.layers import GatedMLP, RMSNorm, SelfAttention, Slots

__all__ = ["Gemma2DecoderLayer", "Gemma2ForCausalLM"]

_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class Gemma2DecoderLayer(nn.Module):
    """One Gemma2 layer: `h += norm(attn(norm(h)))`, `h += norm(mlp(norm(h)))`."""

    def __init__(self, config: ModelConfig, index: int, attn_kwargs: dict[str, object]) -> None:
        super().__init__()
        factory = {"dtype": attn_kwargs["dtype"], "device": attn_kwargs["device"]}
        for name in _NORMS:
            norm = RMSNorm(config.hidden_size, config.rms_norm_eps, has_unit_offset=True, **factory)
            self.add_module(name, norm)
        self.self_attn = SelfAttention.from_config(config, index, attn_kwargs)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, **factory
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
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, attn_metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)

    def weight_slots(self, prefix: str) -> Slots:
        for name in _NORMS:
            yield from getattr(self, name).weight_slots(f"{prefix}.{name}")
        yield from self.self_attn.weight_slots(f"{prefix}.self_attn")
        yield from self.mlp.weight_slots(f"{prefix}.mlp")


class Gemma2ForCausalLM(CausalLM):
    """Gemma2 (see `CausalLM` for the interface)."""

    has_unit_offset_norms = True

    def __init__(self, config: ModelConfig, **kwargs: object) -> None:
        super().__init__(config, **kwargs)
        # transformers rounds sqrt(hidden_size) to fp32 first, then to the model dtype.
        normalizer = torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer(
            "embed_scale", normalizer.to(dtype=self.dtype, device=self.device), persistent=False
        )

    def make_layer(self, index: int, attn_kwargs: dict[str, object]) -> nn.Module:
        return Gemma2DecoderLayer(self.config, index, attn_kwargs)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_weight) * self.embed_scale
