"""DeepSeek-V2 and DeepSeek-V3: pre-norm decoder layers of multi-head latent attention
(`anyattn.MLAAttention`, docs/mla.md) and a dense SwiGLU MLP in the first
`first_k_dense_replace` layers, a mixture of experts (`moe.py`) after them.

RoPE rotates only the `qk_rope_head_dim` part of the queries and the one shared rope key; its
table is YaRN-scaled as configured (cos/sin times the YaRN attention factor), and its pairs are
DeepSeek's interleaved `(x0, x1), (x2, x3), ...` (V2 always, V3 when `rope_interleave`) or
NeoX's halves. The softmax scale carries `mscale(factor, mscale_all_dim)^2`
(`ModelConfig.attention_scale`). Multi-token-prediction layers of V3 checkpoints
(`model.layers.<n>`, n >= num_hidden_layers) are not run and their tensors are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from anyattn.engine.models.base import CausalLM
from anyattn.engine.models.layers import DecoderLayer
from anyattn.engine.models.moe import MoE, split_fused_experts
from anyattn.engine.models.rope import apply_rotary, apply_rotary_interleaved
from anyattn.mla_layer import MLAAttention

__all__ = ["DeepseekForCausalLM"]

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the
# config's rms_norm_eps (DeepSeek's own code does the same).
_LATENT_NORM_EPS = 1e-6
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekForCausalLM(CausalLM):
    """DeepSeek-V2 and DeepSeek-V3; `attention_layers` are the `MLAAttention` layers, named
    `model.layers.<i>.self_attn`. Steps are not captured in CUDA graphs (see `MoE`)."""

    supports_cuda_graphs = False

    def make_layer(self, index: int, attn_kwargs: dict[str, object]) -> nn.Module:
        """`h += mla(norm(h))`, `h += ffn(norm(h))`, the feed-forward a `GatedMLP` or, from
        layer `first_k_dense_replace` on, an `MoE`."""
        config, mla, moe = self.config, self.config.mla, self.config.moe
        assert mla is not None and moe is not None, "ModelConfig.from_hf sets both for DeepSeek"
        factory = {"dtype": self.dtype, "device": self.device}
        self_attn = MLAAttention(
            config.hidden_size,
            config.num_attention_heads,
            kv_lora_rank=mla.kv_lora_rank,
            qk_rope_head_dim=mla.qk_rope_head_dim,
            qk_nope_head_dim=mla.qk_nope_head_dim,
            v_head_dim=mla.v_head_dim,
            q_lora_rank=mla.q_lora_rank,
            scale=mla.scale,
            rms_norm_eps=_LATENT_NORM_EPS,
            layer_name=f"model.layers.{index}.self_attn",
            **attn_kwargs,
        )
        if moe.is_moe_layer(index):
            mlp: nn.Module = MoE(
                config.hidden_size, moe, config.hidden_act, has_bias=config.mlp_bias, **factory
            )
        else:
            mlp = self.dense_mlp()
        rotate = apply_rotary_interleaved if mla.is_rope_interleaved else apply_rotary
        return DecoderLayer(config, self_attn, mlp, mla_rotate=rotate, **factory)

    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn for layer in self.layers]

    def is_skipped_weight(self, name: str) -> bool:
        match = _LAYER_INDEX.match(name)
        is_extra_layer = match is not None and int(match[1]) >= self.config.num_hidden_layers
        return is_extra_layer or super().is_skipped_weight(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As `CausalLM.load_weights`; experts may come one by one (the hub's layout) or as
        transformers' fused `experts.gate_up_proj` / `experts.down_proj` tensors."""
        super().load_weights(split_fused_experts(weights))
