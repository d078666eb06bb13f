"""The logits soft cap `cap * tanh(s / cap)` of the Triton attention kernels: `apply_soft_cap`.

Two forms, chosen by the kernel's input dtype:

- accurate (float32 inputs): within 2 float32 ulps of the correctly rounded value of
  `cap * tanh(s / cap)` for |s| <= 10 * cap (tests/ops/test_soft_cap.py checks caps 1, 20 and
  50). It uses only operations that IEEE rounds exactly (division rounded to nearest, fma,
  integer bit manipulation), no approximate hardware exp or tanh, so its error does not depend
  on the GPU and runs under Triton's interpreter, which has no libdevice.
- fast (float16 / bfloat16 inputs): `cap * (1 - 2 / (exp(2 s / cap) + 1))`, a few instructions.
  Cancellation near 0 costs it up to ~2e4 float32 ulps (an absolute error of a few 1e-7 * cap,
  too much for the float32 bound of the conformance kit), but that error (< 2^-20 * cap) is far
  below the rounding of 16-bit probabilities.

Both give ±cap for ±inf and NaN for NaN.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

if triton is not None:

    @triton.jit
    def apply_soft_cap(s, cap, ACCURATE: tl.constexpr):
        """`cap * tanh(s / cap)` of float32 scores `s` (any shape); `cap` a float32 scalar > 0.

        ACCURATE: the accurate form (for float32 inputs), else the fast one (module doc).
        """
        if not ACCURATE:
            return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))
        u = tl.div_rn(s, cap)
        a = tl.abs(u)
        # |u| < 0.75: tanh(u) = u * (1 + z * p(z)), z = u^2, p a near-minimax fit (relative error
        # 2e-9). As s + s * (z * p) the rounding of u only reaches the correction (< 17%).
        z = u * u
        p = tl.fma(z, 0.0017425077967345715, -0.007667044177651405)
        p = tl.fma(p, z, 0.021458519622683525)
        p = tl.fma(p, z, -0.05389471352100372)
        p = tl.fma(p, z, 0.13332721590995789)
        p = tl.fma(p, z, -0.33333316445350647)
        small = tl.fma(s, z * p, s)
        # |u| >= 0.75: cap * (1 - 2 / (e^y + 1)), y = 2|u| (tanh(10) rounds to 1, so y <= 20).
        # e^y = 2^k * (1 + m), m = expm1(r) by Taylor (degree 7, error < 1e-8) on the reduced
        # r = y - k ln2 in [-ln2/2, ln2/2] (ln 2 in two parts: k * LN2_HI is exact). r also takes
        # the rounding error of u, (s - u * cap) / cap from an exact fma, so that it adds nothing.
        y = 2.0 * tl.minimum(a, 10.0, propagate_nan=tl.PropagateNan.ALL)
        k = tl.floor(tl.fma(y, 1.4426950408889634, 0.5))
        u_error = tl.where(a < 10.0, tl.fma(-u, cap, s) / cap, 0.0)  # 0 for ±inf, not NaN
        r = tl.fma(-k, 0.693145751953125, y)
        r = tl.fma(tl.where(u < 0, -2.0, 2.0), u_error, r)
        r = tl.fma(-k, 1.428606765330187e-06, r)
        m = tl.fma(r, 1.0 / 5040, 1.0 / 720)
        m = tl.fma(m, r, 1.0 / 120)
        m = tl.fma(m, r, 1.0 / 24)
        m = tl.fma(m, r, 1.0 / 6)
        m = tl.fma(m, r, 0.5)
        m = tl.fma(m, r, 1.0)
        m = m * r
        two_k = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # 2^k, exact
        t = tl.div_rn(2.0, tl.fma(two_k, m, two_k + 1.0))  # 2 / (e^y + 1), <= 0.37
        large = tl.fma(-cap, t, cap)
        return tl.where(a < 0.75, small, tl.where(u < 0, -large, large))
