"""Building blocks shared by the model families: RMSNorm, rotary embedding, gated MLP and the
self-attention block around `anyattn.layer.Attention`.

Every block computes what transformers computes, in the same order where rounding could tell
the difference (RMSNorm in fp32 and then cast, RoPE as `x * cos + rotate_half(x) * sin`), and
is laid out for speed on a CPU at batch 1, where each PyTorch call costs microseconds: q/k/v are
one matmul, gate/up are one matmul, the RoPE table is computed once and indexed by position, and
RoPE rotates q and k together. Parameters are allocated empty; `weight_slots` tells the loader
where each Hugging Face tensor goes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from anyattn.backend import AttentionBackend
from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.weights import WeightSlot
from anyattn.layer import Attention

__all__ = [
    "GatedMLP",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "apply_rotary",
    "rope_inv_freq",
]

Slots = Iterator[tuple[str, WeightSlot]]


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter (the checkpoint fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def empty_linear_weight(
    out_features: int, in_features: int, *, dtype: torch.dtype, device: torch.device | str
) -> nn.Parameter:
    """An uninitialised `[out_features, in_features]` weight for `F.linear`.

    On the CPU it is stored column-major (its transpose is contiguous). `F.linear` multiplies by
    the transpose, which the BLAS then reads as a plain row-major `[in, out]` matrix instead of a
    transposed one: a batch-8 decode step of SmolLM2-135M measured 84 ms instead of 93 (2-core
    Xeon, fp32), batch 1 and a 512-token prefill the same or slightly faster. The logical shape,
    and so the loaders and `F.linear`, are unchanged. CUDA keeps the row-major layout.
    """
    if torch.device(device).type != "cpu":
        return empty_param(out_features, in_features, dtype=dtype, device=device)
    storage = torch.empty(in_features, out_features, dtype=dtype, device=device)
    return nn.Parameter(storage.t(), requires_grad=False)


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, computed in fp32 and cast back to `x.dtype`.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square.
        has_unit_offset: Gemma's variant: the checkpoint stores `w` and the scale is `1 + w`, kept
            in fp32 (transformers multiplies in fp32 before casting).
    """

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
        # In fp32 the fused kernel gives the bits of the step-by-step formula (checked on the CPU)
        # in one call instead of six.
        self._is_fused = dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[num_tokens, hidden_size]` -> same shape and dtype."""
        if self._is_fused:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.has_unit_offset:
            return (h * self.weight).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def weight_slots(self, prefix: str) -> Slots:
        transform = _one_plus if self.has_unit_offset else None
        yield f"{prefix}.weight", WeightSlot(self.weight, transform)


def _one_plus(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


def rope_inv_freq(
    head_size: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and the attention factor that scales cos/sin.

    Computes what transformers' `ROPE_INIT_FUNCTIONS` compute (same float32 operations, so the
    same bits) for plain RoPE and the "linear", "dynamic" (its value up to
    `max_position_embeddings`, where transformers leaves the base unchanged), "llama3" and
    "yarn" variants.

    Returns:
        (float32 `[head_size // 2]`, attention factor).
    """
    dim = head_size
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rope_type = "default" if rope_scaling is None else rope_scaling["rope_type"]
    params = rope_scaling or {}
    if rope_type == "dynamic":
        # transformers' NTK base at sequence length max_position_embeddings, the longest it
        # keeps the initial frequencies for; the growth term is 1 there, written out as
        # transformers writes it so that the bits agree.
        factor, seq_len = params["factor"], max_position_embeddings
        growth = (factor * seq_len / max_position_embeddings) - (factor - 1)
        rope_theta = rope_theta * growth ** (dim / (dim - 2))
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(dim, rope_theta, exponents, params, max_position_embeddings)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    dim: int,
    base: float,
    exponents: torch.Tensor,
    params: dict[str, Any],
    max_position_embeddings: int,
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between, and scale
    cos/sin by an attention factor (https://arxiv.org/abs/2309.00071)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base**exponents
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """A cos/sin table for every position up to `max_positions`, indexed once per step.

    Neox layout (rotate_half): the two halves of each head are the real and imaginary parts.
    The table stores `cos` and `sin` with its first half negated, so that
    `x * cos + roll(x, half) * sin` is exactly transformers' `x * cos + rotate_half(x) * sin`.

    Args:
        head_size: rotary dimension (the whole head).
        rope_theta, rope_scaling, max_position_embeddings: as in `ModelConfig`.
        max_positions: table length (positions must stay below it).
    """

    def __init__(
        self,
        head_size: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
        max_position_embeddings: int,
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(
            head_size, rope_theta, rope_scaling, max_position_embeddings
        )
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_size // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_size]
        cos = emb.cos() * attention_factor
        sin = emb.sin() * attention_factor
        half = head_size // 2
        sin[:, :half] = -sin[:, :half]
        # cos_sin: [max_positions, 2, head_size]
        table = torch.stack((cos, sin), dim=1).to(dtype=dtype, device=device)
        self.register_buffer("cos_sin", table, persistent=False)
        self.max_positions = max_positions

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 `[num_tokens]` -> (cos, signed sin), each `[num_tokens, 1, head_size]`
        (broadcast over heads)."""
        table = self.cos_sin[positions]  # [num_tokens, 2, head_size]
        return table[:, 0:1], table[:, 1:2]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [num_tokens, num_heads, head_size]` by `RotaryEmbedding` output (new tensor)."""
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # halves swapped: [x2, x1]
    return x * cos + swapped * sin


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`, with gate and up fused into one matmul.

    Args:
        hidden_act: "silu" (SwiGLU: Llama, Mistral, Qwen2), "gelu_pytorch_tanh" (GeGLU: Gemma2)
            or "gelu".
        has_bias: the three projections have biases (Llama's `mlp_bias`).
    """

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
        self.act = _ACTIVATIONS[hidden_act]
        self.gate_up_weight = empty_linear_weight(
            2 * intermediate_size, hidden_size, dtype=dtype, device=device
        )
        self.down_weight = empty_linear_weight(
            hidden_size, intermediate_size, dtype=dtype, device=device
        )
        self.gate_up_bias = self.down_bias = None
        if has_bias:
            self.gate_up_bias = empty_param(2 * intermediate_size, dtype=dtype, device=device)
            self.down_bias = empty_param(hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[num_tokens, hidden_size]` -> `[num_tokens, hidden_size]`."""
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)  # [num_tokens, 2 * inter]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.linear(self.act(gate) * up, self.down_weight, self.down_bias)

    def weight_slots(self, prefix: str) -> Slots:
        n = self.intermediate_size
        for kind in ("weight", "bias"):
            gate_up, down = getattr(self, f"gate_up_{kind}"), getattr(self, f"down_{kind}")
            if gate_up is None:
                continue
            yield f"{prefix}.gate_proj.{kind}", WeightSlot(gate_up[:n])
            yield f"{prefix}.up_proj.{kind}", WeightSlot(gate_up[n:])
            yield f"{prefix}.down_proj.{kind}", WeightSlot(down)


class SelfAttention(nn.Module):
    """q/k/v projection (one matmul), RoPE on q and k, paged attention through
    `anyattn.layer.Attention`, output projection.

    q, k and v reach `Attention` as views into the fused projection (as in vLLM): the last
    dimension is contiguous, rows are strided when `num_tokens > 1`.

    Args:
        hidden_size, num_heads, num_kv_heads, head_size: the layer's sizes.
        scale: factor applied to `q·k`.
        has_qkv_bias, has_o_bias: which projections have biases.
        sliding_window: W (keys `p - W < j <= p`) or None.
        logits_soft_cap: soft cap of the attention scores, or None.
        layer_name: unique name of the `Attention` layer (KV caches and metadata are keyed by it).
        block_size, backend, kv_cache_dtype: passed to `Attention`, which selects the backend.
    """

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
        self.qkv_weight = empty_linear_weight(qkv_size, hidden_size, dtype=dtype, device=device)
        self.qkv_bias = empty_param(qkv_size, dtype=dtype, device=device) if has_qkv_bias else None
        self.o_weight = empty_linear_weight(hidden_size, self.q_size, dtype=dtype, device=device)
        self.o_bias = empty_param(hidden_size, dtype=dtype, device=device) if has_o_bias else None
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
        qkv = F.linear(hidden, self.qkv_weight, self.qkv_bias)  # [num_tokens, q + 2 * kv]
        heads = self.num_heads + self.num_kv_heads
        # qk: [num_tokens, num_heads + num_kv_heads, head_size], rotated in one go
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads, self.head_size)
        qk = apply_rotary(qk, cos, sin)
        q = qk[:, : self.num_heads]  # [num_tokens, num_heads, head_size]
        k = qk[:, self.num_heads :]  # [num_tokens, num_kv_heads, head_size]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_size)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, num_heads, head_size]
        # reshape, not view: a backend may hand back an output with q's (row-strided) layout
        return F.linear(out.reshape(num_tokens, self.q_size), self.o_weight, self.o_bias)

    def weight_slots(self, prefix: str) -> Slots:
        q, kv = self.q_size, self.kv_size
        rows = {
            "q_proj": slice(0, q),
            "k_proj": slice(q, q + kv),
            "v_proj": slice(q + kv, q + 2 * kv),
        }
        for proj, part in rows.items():
            yield f"{prefix}.{proj}.weight", WeightSlot(self.qkv_weight[part])
            if self.qkv_bias is not None:
                yield f"{prefix}.{proj}.bias", WeightSlot(self.qkv_bias[part])
        yield f"{prefix}.o_proj.weight", WeightSlot(self.o_weight)
        if self.o_bias is not None:
            yield f"{prefix}.o_proj.bias", WeightSlot(self.o_bias)
