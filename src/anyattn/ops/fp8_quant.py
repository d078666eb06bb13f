"""The one rounding rule of fp8 KV caches, in PyTorch (`quantize_fp8`) and Triton (`fp8_bits`).

docs/semantics.md ("fp8 caches") states the rule for every backend; this module implements it.

An fp8 cache stores `x / scale` for a model value `x` (float32, float16 or bfloat16) and its
float32 `scale` (per tensor, or per KV head):

1. `y = float32(x) / scale`, one correctly rounded IEEE float32 division (not the approximate
   `div.full.f32` that `x / scale` compiles to in Triton on NVIDIA GPUs);
2. `y` rounded to the nearest fp8 value, ties to even (e4m3fn: `torch.float8_e4m3fn`, e5m2:
   `torch.float8_e5m2`), subnormals included;
3. values past the format's largest finite value, infinities included, saturate to it
   (±448 for e4m3fn, ±57344 for e5m2), as vLLM's kernels do; never inf;
4. NaN, of either sign and any payload, stores the positive NaN byte 0x7F in both formats (the
   sign of a NaN quotient differs between CPUs and GPUs, so it is not kept); -0.0 and values
   that round to zero keep their sign.

Both functions give the same bytes on every device for every input (Triton's own fp32 -> fp8
cast is not used: the interpreter rounds it wrongly and its NaN sign follows the hardware).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = ["FP8_NAN_BYTE", "quantize_fp8"]

FP8_NAN_BYTE = 0x7F
"""The byte every NaN is stored as, in e4m3fn and e5m2 alike."""

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x / scale` in fp8 by the module's rule (correctly rounded, saturating, NaN -> 0x7F).

    Args:
        x: any shape, float32 / float16 / bfloat16.
        scale: float32, broadcastable to `x` (`[]`, or `[num_kv_heads, 1]` for a per-head scale
            of `[..., num_kv_heads, head_size]` rows), on `x`'s device. A 0-dim tensor, not a
            Python number: CUDA multiplies by the reciprocal of a host scalar, which is not a
            correctly rounded division.
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.

    Returns:
        A new tensor of the broadcast shape and dtype `dtype`.
    """
    assert dtype in _FP8_DTYPES, dtype
    fp8_max = torch.finfo(dtype).max
    y = x.float() / scale
    # torch's cast rounds to nearest even but turns values past the range into NaN (e4m3fn) or
    # inf (e5m2), so saturate first; NaN bytes are set afterwards, whatever the clamp made of them.
    stored = y.clamp(-fp8_max, fp8_max).to(dtype).view(torch.uint8)
    return torch.where(y.isnan(), FP8_NAN_BYTE, stored).view(dtype)


if triton is not None:

    @triton.jit
    def fp8_bits(y, IS_E4M3: tl.constexpr):
        """The fp8 bytes (uint8, `y`'s shape) of float32 `y` by the module's rule (steps 2-4);
        bitcast them to the cache's fp8 type to store them.

        Integer arithmetic only, so the interpreter and every GPU give the same bytes.
        """
        if IS_E4M3:
            mant_bits = 3
            exp_bias = 7
            max_bits = 0x43E00000  # float32 bits of 448.0
        else:
            mant_bits = 2
            exp_bias = 15
            max_bits = 0x47600000  # float32 bits of 57344.0
        drop = 23 - mant_bits  # float32 mantissa bits that fp8 does not keep
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        # Saturation: float32 bits of non-negative values order like the values themselves.
        mag = tl.minimum(bits & 0x7FFFFFFF, max_bits)
        exponent = mag >> 23
        # Normal fp8 results: round the float32 bits at `drop` (ties to even); a carry out of
        # the mantissa moves into the exponent, as it should. Then rebias the exponent.
        odd = (mag >> drop) & 1
        normal = ((mag + ((1 << (drop - 1)) - 1) + odd) >> drop) - ((127 - exp_bias) << mant_bits)
        # Subnormal fp8 results: the significand (implicit bit included) shifted right so that
        # one unit is fp8's smallest subnormal, rounded to nearest even. A result of
        # 1 << mant_bits is the smallest normal byte, which is what it encodes. The shift is
        # kept within [drop + 1, 25] (shifting by 32 or more, or by a negative amount, is
        # undefined): 25 leaves nothing of a 24-bit significand, and exponents in fp8's normal
        # range, whose result is not used here, get the smallest shift.
        significand = tl.where(exponent > 0, (mag & 0x7FFFFF) | 0x800000, mag)
        below_normal = tl.minimum(tl.maximum(exponent, 1), 127 - exp_bias)
        shift = tl.minimum(151 - exp_bias - mant_bits - below_normal, 25)
        kept = significand >> shift
        rest = significand & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
        code = tl.where(mag >= (128 - exp_bias) << 23, normal, kept)
        code = tl.where(is_nan, 0x7F, code | sign)
        return code.to(tl.uint8)
