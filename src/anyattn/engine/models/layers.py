"""Building blocks shared by the model families: RMSNorm, gated MLP, the self-attention block
around `anyattn.layer.Attention` and the decoder layer made of them.

Every block computes what transformers computes, in the same order where rounding could tell
the difference. q/k/v are one matmul, gate/up one, and RoPE rotates q and k together.
Parameters are allocated empty; `weight_slots` tells the loader where each Hugging Face tensor
goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.linear import Linear
from anyattn.engine.models.rope import apply_rotary
from anyattn.engine.models.weights import WeightSlot, empty_param
from anyattn.layer import Attention

__all__ = ["ACTIVATIONS", "DecoderLayer", "GatedMLP", "RMSNorm", "SelfAttention"]

Slots = Iterator[tuple[str, WeightSlot]]


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, in fp32, cast back to `x.dtype`. With
    `has_unit_offset` (Gemma) the scale is `1 + w`, kept in fp32 as transformers does."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        has_unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.has_unit_offset = has_unit_offset
        weight_dtype = torch.float32 if has_unit_offset else dtype
        self.weight = empty_param(hidden_size, dtype=weight_dtype, device=device)
        self._is_fused = dtype == torch.float32  # then F.rms_norm gives the formula's bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[num_tokens, hidden_size]` -> same shape and dtype."""
        if self._is_fused:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        if self.has_unit_offset:
            return (h * self.weight).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def weight_slots(self, prefix: str) -> Slots:
        transform = _one_plus if self.has_unit_offset else None
        yield f"{prefix}.weight", WeightSlot(self.weight, transform)


def _one_plus(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`, gate and up fused into one matmul; `hidden_act` "silu"
    (SwiGLU), "gelu_pytorch_tanh" (GeGLU: Gemma2) or "gelu"."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        has_bias: bool = False,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.act = ACTIVATIONS[hidden_act]
        factory = {"has_bias": has_bias, "dtype": dtype, "device": device}
        self.gate_up = Linear(hidden_size, 2 * intermediate_size, **factory)
        self.down = Linear(intermediate_size, hidden_size, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[num_tokens, hidden_size]` -> `[num_tokens, hidden_size]`."""
        gate_up = self.gate_up(x)  # [num_tokens, 2 * intermediate_size]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down(self.act(gate) * up)

    def weight_slots(self, prefix: str) -> Slots:
        n = self.intermediate_size
        yield from self.gate_up.weight_slots(
            {f"{prefix}.gate_proj": slice(0, n), f"{prefix}.up_proj": slice(n, None)}
        )
        yield from self.down.weight_slots({f"{prefix}.down_proj": slice(None)})


class SelfAttention(nn.Module):
    """q/k/v projection (one matmul), RoPE on q and k, paged attention through
    `anyattn.layer.Attention` (named `model.layers.<index>.self_attn.attn`, the key of its cache
    and metadata), output projection, as `config` says for decoder layer `index`."""

    def __init__(self, config: ModelConfig, index: int, attn_kwargs: dict[str, object]) -> None:
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, config.head_dim
        self.q_size = num_heads * config.head_dim
        self.kv_size = num_kv_heads * config.head_dim
        factory = {"dtype": attn_kwargs["dtype"], "device": attn_kwargs["device"]}
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv = Linear(config.hidden_size, qkv_size, has_bias=config.attention_bias, **factory)
        self.o = Linear(self.q_size, config.hidden_size, has_bias=config.o_proj_bias, **factory)
        self.attn = Attention(
            num_heads,
            config.head_dim,
            config.attention_scale,
            num_kv_heads,
            layer_name=f"model.layers.{index}.self_attn.attn",
            sliding_window=config.layer_sliding_windows[index],
            logits_soft_cap=config.attn_logit_softcapping,
            **attn_kwargs,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: object,
    ) -> torch.Tensor:
        """hidden: `[num_tokens, hidden_size]`; cos/sin from `RotaryEmbedding` -> same shape
        as hidden."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv(hidden).contiguous()  # [num_tokens, q + 2 * kv], rows viewed as heads
        heads = self.num_heads + self.num_kv_heads
        # qk: [num_tokens, num_heads + num_kv_heads, head_size], rotated in one go
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, self.head_size)
        qk = apply_rotary(qk, cos, sin)
        q = qk[:, : self.num_heads]  # [num_tokens, num_heads, head_size]
        k = qk[:, self.num_heads :]  # [num_tokens, num_kv_heads, head_size]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_size)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, num_heads, head_size]
        # reshape, not view: a backend may hand back an output with q's (row-strided) layout
        return self.o(out.reshape(num_tokens, self.q_size))

    def weight_slots(self, prefix: str) -> Slots:
        q, kv = self.q_size, self.kv_size
        parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, None)}
        yield from self.qkv.weight_slots({f"{prefix}.{p}": rows for p, rows in parts.items()})
        yield from self.o.weight_slots({f"{prefix}.o_proj": slice(None)})


# Gemma2's `post_attention_layernorm` norms the attention output, Llama's the MLP input.
_NORMS = ("input_layernorm", "post_attention_layernorm")
_SANDWICH_NORMS = (*_NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")
Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: `h += attn(norm(h))`, `h += mlp(norm(h))`; with
    `has_sandwich_norms` (Gemma2: four norms, scaling by `1 + w`) `h += norm(attn(norm(h)))`,
    `h += norm(mlp(norm(h)))`.

    `self_attn` is a `SelfAttention`, or, when `mla_rotate` is given, an `MLAAttention` that
    rotates its rope parts with `mla_rotate(x, cos, sin)` (`apply_rotary` or
    `apply_rotary_interleaved`). `mlp` is a `GatedMLP` or an `MoE`.
    """

    def __init__(
        self,
        config: ModelConfig,
        self_attn: nn.Module,
        mlp: nn.Module,
        *,
        has_sandwich_norms: bool = False,
        mla_rotate: Rotate | None = None,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.has_sandwich_norms = has_sandwich_norms
        self.norm_names = _SANDWICH_NORMS if has_sandwich_norms else _NORMS
        for name in self.norm_names:
            norm = RMSNorm(
                config.hidden_size,
                config.rms_norm_eps,
                has_unit_offset=has_sandwich_norms,
                dtype=dtype,
                device=device,
            )
            self.add_module(name, norm)
        self.self_attn, self.mlp = self_attn, mlp
        self.mla_rotate = mla_rotate

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: object,
    ) -> torch.Tensor:
        """hidden: `[num_tokens, hidden_size]`, `cos_sin` from `RotaryEmbedding` -> same shape
        as hidden."""
        cos, sin = cos_sin
        x = self.input_layernorm(hidden)
        rotate = self.mla_rotate
        if rotate is None:
            attn = self.self_attn(x, cos, sin, kv_cache, attn_metadata)
        else:

            def rope(q_pe: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                # q_pe: [num_tokens, num_heads, R], k_pe: [num_tokens, 1, R]
                return rotate(q_pe, cos, sin), rotate(k_pe, cos, sin)

            attn = self.self_attn(x, rope, kv_cache, attn_metadata)
        if not self.has_sandwich_norms:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)

    def weight_slots(self, prefix: str) -> Slots:
        for name in self.norm_names:
            yield from getattr(self, name).weight_slots(f"{prefix}.{name}")
        if self.mla_rotate is None:
            yield from self.self_attn.weight_slots(f"{prefix}.self_attn")
        else:  # MLAAttention's parameters carry the checkpoint's names (q_proj, kv_a_proj...)
            for name, param in self.self_attn.named_parameters():
                yield f"{prefix}.self_attn.{name}", WeightSlot(param)
        yield from self.mlp.weight_slots(f"{prefix}.mlp")
