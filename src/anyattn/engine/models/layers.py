"""Building blocks shared by the model families: RMSNorm, gated MLP and the self-attention
block around `anyattn.layer.Attention` (RoPE is in `rope.py`).

Every block computes what transformers computes, in the same order where rounding could tell
the difference (RMSNorm in fp32, then cast). Fused where each PyTorch call is a fixed cost:
q/k/v are one matmul, gate/up one matmul, and RoPE rotates q and k together. Projections are
`Linear`s (`linear.py`: weight layouts per device). Parameters are allocated empty;
`weight_slots` tells the loader where each Hugging Face tensor goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from anyattn.backend import AttentionBackend
from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.linear import Linear
from anyattn.engine.models.rope import apply_rotary
from anyattn.engine.models.weights import WeightSlot
from anyattn.layer import Attention

__all__ = ["ACTIVATIONS", "GatedMLP", "RMSNorm", "SelfAttention"]

Slots = Iterator[tuple[str, WeightSlot]]


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter (the checkpoint fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


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
        # In fp32 the fused kernel gives the step-by-step formula's bits.
        self._is_fused = dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[num_tokens, hidden_size]` -> same shape and dtype."""
        if self._is_fused:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # One fused fp32 normalisation (the same bits as the step-by-step formula) instead of
        # five element-wise kernels: an eager decode step launches two norms per layer.
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
        self.has_bias = has_bias
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
        parts = {"gate_proj": slice(0, n), "up_proj": slice(n, 2 * n)}
        for proj, rows in parts.items():
            yield f"{prefix}.{proj}.weight", self.gate_up.weight_slot(rows)
            if self.has_bias:
                yield f"{prefix}.{proj}.bias", self.gate_up.bias_slot(rows)
        yield f"{prefix}.down_proj.weight", self.down.weight_slot()
        if self.has_bias:
            yield f"{prefix}.down_proj.bias", self.down.bias_slot()


class SelfAttention(nn.Module):
    """q/k/v projection (one matmul), RoPE on q and k, paged attention through
    `anyattn.layer.Attention` (named `layer_name`: caches and metadata are keyed by it), output
    projection. q, k and v reach `Attention` as views of the fused projection (rows strided)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        has_qkv_bias: bool,
        has_o_bias: bool,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        layer_name: str,
        dtype: torch.dtype,
        device: torch.device | str,
        block_size: int,
        backend: str | type[AttentionBackend] | None,
        kv_cache_dtype: str,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        qkv_size = self.q_size + 2 * self.kv_size
        self.has_qkv_bias, self.has_o_bias = has_qkv_bias, has_o_bias
        factory = {"dtype": dtype, "device": device}
        self.qkv = Linear(hidden_size, qkv_size, has_bias=has_qkv_bias, **factory)
        self.o = Linear(self.q_size, hidden_size, has_bias=has_o_bias, **factory)
        self.attn = Attention(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            dtype=dtype,
            layer_name=layer_name,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            backend=backend,
            device=device,
        )

    @classmethod
    def from_config(
        cls, config: ModelConfig, index: int, attn_kwargs: dict[str, object]
    ) -> SelfAttention:
        """The attention block of decoder layer `index` (its window from the config)."""
        return cls(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_size=config.head_dim,
            scale=config.attention_scale,
            has_qkv_bias=config.attention_bias,
            has_o_bias=config.o_proj_bias,
            sliding_window=config.layer_sliding_windows[index],
            logits_soft_cap=config.attn_logit_softcapping,
            layer_name=f"model.layers.{index}.self_attn.attn",
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
        rows = {
            "q_proj": slice(0, q),
            "k_proj": slice(q, q + kv),
            "v_proj": slice(q + kv, q + 2 * kv),
        }
        for proj, part in rows.items():
            yield f"{prefix}.{proj}.weight", self.qkv.weight_slot(part)
            if self.has_qkv_bias:
                yield f"{prefix}.{proj}.bias", self.qkv.bias_slot(part)
        yield f"{prefix}.o_proj.weight", self.o.weight_slot()
        if self.has_o_bias:
            yield f"{prefix}.o_proj.bias", self.o.bias_slot()
