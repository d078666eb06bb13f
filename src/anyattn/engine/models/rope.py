"""Rotary position embedding: inverse frequencies of plain RoPE and its "linear", "dynamic",
"llama3" and "yarn" variants (the float32 operations of transformers' `ROPE_INIT_FUNCTIONS`,
so the same bits), a cos/sin table per position, and the rotation (Neox layout, or DeepSeek's
interleaved pairs)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary", "apply_rotary_interleaved", "rope_inv_freq"]


def rope_inv_freq(
    head_size: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
) -> tuple[torch.Tensor, float]:
    """(float32 inverse frequencies `[head_size // 2]`, the attention factor scaling cos/sin);
    "dynamic" gives its value up to `max_position_embeddings` (where the base is unchanged)."""
    dim = head_size
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rope_type = "default" if rope_scaling is None else rope_scaling["rope_type"]
    params = rope_scaling or {}
    if rope_type == "dynamic":
        # transformers' NTK base at max_position_embeddings (growth 1, written out as
        # transformers writes it so that the bits agree)
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
    """A cos/sin table for positions below `max_positions`, indexed once per step. Neox layout;
    `sin`'s first half is stored negated, so `x * cos + roll(x, half) * sin` is exactly
    transformers' `x * cos + rotate_half(x) * sin`."""

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


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [num_tokens, num_heads, head_size]` whose rotary pairs are interleaved,
    `(x0, x1), (x2, x3), ...` (DeepSeek); the result holds the rotated pairs' first elements,
    then their second ones (transformers' DeepSeek-V3 layout, which keeps q·k)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., half:]  # per-pair angle; the unsigned half of `sin`
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
