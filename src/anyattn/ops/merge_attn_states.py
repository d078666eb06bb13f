"""Merge two partial attention results computed over disjoint sets of keys.

Each side holds, per query row, an output normalised over its own keys and the LSE of its
scores. With `m = max(lse_p, lse_s)`, `w_p = exp(lse_p - m)`, `w_s = exp(lse_s - m)`:

    out = (w_p * out_p + w_s * out_s) / (w_p + w_s),   lse = m + log(w_p + w_s)

is attention over the union of the keys. An empty side has LSE -inf (+inf is read as -inf) and
contributes nothing, whatever its rows hold; a row empty on both sides gets zeros and LSE -inf.
A layer's sink is counted in exactly one side (docs/semantics.md, "Merging partial results").

On CUDA, when triton is importable, the merge is one Triton launch; the PyTorch path serves the
CPU and CUDA without triton. `impl=` forces either one.
"""

from __future__ import annotations

import math

import torch

from anyattn.ops.impl_choice import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = ["merge_attn_states", "merge_attn_states_ref"]

_OP = "merge_attn_states"
_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
    lse_base_on_e: bool = True,
    *,
    impl: str = "auto",
) -> None:
    """Write the merge of a prefix and a suffix attention result into `output`, in place.

    Computes in float32 (float64 when an input LSE is float64). The result is formed completely
    before anything is written, so `output` may be `prefix_output` or `suffix_output` (and
    `output_lse` one of the input LSEs).

    Args:
        output: `[num_tokens, num_heads, head_size]`, float32 / float16 / bfloat16; written in
            its own dtype (it may differ from the inputs').
        prefix_output, suffix_output: `[num_tokens, num_heads, head_size]`, float32 / float16 /
            bfloat16, same dtype.
        prefix_lse, suffix_lse: float32 (or float64, which merges in float64)
            `[num_heads, num_tokens]`; -inf (or +inf) marks a row
            with no keys on that side.
        output_lse: optional float32 `[num_heads, num_tokens]` to receive the merged LSE.
        lse_base_on_e: True for natural-log LSEs; False when they are base 2 (`log2` of the sum
            of `exp2` scores), and `output_lse` is then written in base 2 as well.
        impl: "auto" (the Triton kernel on CUDA when triton is importable, else PyTorch),
            "torch" or "triton" (on the CPU it needs `TRITON_INTERPRET=1` set before triton is
            imported).

    Raises:
        TypeError: a non-tensor argument or a wrong dtype.
        ValueError: shapes that disagree, tensors on different devices, an unknown `impl`.
        RuntimeError: `impl="triton"` without triton installed.
    """
    _validate(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)
    if use_triton(_OP, impl, output.device):
        _merge_with_triton(
            output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, lse_base_on_e
        )
        return
    exp, log = (torch.exp, torch.log) if lse_base_on_e else (torch.exp2, torch.log2)
    # lse: [num_heads, num_tokens] -> [num_tokens, num_heads]
    # float64 LSEs (callers that need fp32-exact merges) keep the whole merge in float64: the
    # weights exp(lse - max) amplify LSE rounding by |lse|.
    lse_dtype = torch.promote_types(prefix_lse.dtype, suffix_lse.dtype)
    lse_p = _empty_as_neg_inf(prefix_lse.t().to(lse_dtype))
    lse_s = _empty_as_neg_inf(suffix_lse.t().to(lse_dtype))
    lse_max = torch.maximum(lse_p, lse_s)
    # Rows empty on both sides would compute -inf - -inf = NaN; shift them by 0 instead.
    lse_max = torch.where(lse_max == -math.inf, 0.0, lse_max)
    weight_p = exp(lse_p - lse_max)
    weight_s = exp(lse_s - lse_max)
    total = weight_p + weight_s
    inv_total = 1.0 / torch.where(total > 0, total, 1.0)
    # out: [num_tokens, num_heads, head_size] float32; a side of weight 0 adds exactly 0, even
    # where its rows hold garbage (an impl may leave rows with no keys unwritten).
    out = _weighted(weight_p * inv_total, prefix_output)
    out += _weighted(weight_s * inv_total, suffix_output)
    merged_lse = lse_max + log(total)  # log(0) = -inf for rows empty on both sides
    output.copy_(out)
    if output_lse is not None:
        output_lse.copy_(merged_lse.t())


def merge_attn_states_ref(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
    lse_base_on_e: bool = True,
) -> None:
    """Reference for `merge_attn_states`, one row at a time in float64; no validation."""
    base = math.e if lse_base_on_e else 2.0
    num_tokens, num_heads, _ = output.shape
    for token in range(num_tokens):
        for head in range(num_heads):
            lse_p = float(prefix_lse[head, token])
            lse_s = float(suffix_lse[head, token])
            lse_p = -math.inf if lse_p == math.inf else lse_p
            lse_s = -math.inf if lse_s == math.inf else lse_s
            lse_max = max(lse_p, lse_s)
            if lse_max == -math.inf:
                output[token, head] = 0
                merged_lse = -math.inf
            else:
                weight_p = base ** (lse_p - lse_max)
                weight_s = base ** (lse_s - lse_max)
                total = weight_p + weight_s
                out = 0.0
                if weight_p > 0:
                    out = out + weight_p * prefix_output[token, head].double()
                if weight_s > 0:
                    out = out + weight_s * suffix_output[token, head].double()
                output[token, head] = out / total
                merged_lse = lse_max + math.log(total, base)
            if output_lse is not None:
                output_lse[head, token] = merged_lse


def _merge_with_triton(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None,
    lse_base_on_e: bool,
) -> None:
    num_tokens, num_heads, head_size = output.shape
    if num_tokens == 0 or num_heads == 0:
        return
    block_d = triton.next_power_of_2(head_size)
    has_output_lse = output_lse is not None
    # Never written when has_output_lse is False: the pointer only needs a valid tensor.
    out_lse = output_lse if output_lse is not None else prefix_lse
    _merge_attn_states_kernel[(num_tokens, num_heads)](
        output, prefix_output, prefix_lse, suffix_output, suffix_lse, out_lse, head_size,
        *output.stride(), *prefix_output.stride(), *suffix_output.stride(),
        *prefix_lse.stride(), *suffix_lse.stride(), *out_lse.stride(),
        HAS_OUTPUT_LSE=has_output_lse, BASE_E=lse_base_on_e,
        F64=torch.float64 in (prefix_lse.dtype, suffix_lse.dtype), BLOCK_D=block_d,
        num_warps=1 if block_d <= 256 else 2 if block_d <= 1024 else 4,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _merge_attn_states_kernel(
        out_ptr,
        prefix_ptr,
        prefix_lse_ptr,
        suffix_ptr,
        suffix_lse_ptr,
        out_lse_ptr,
        head_size,
        stride_o_token,
        stride_o_head,
        stride_o_dim,
        stride_p_token,
        stride_p_head,
        stride_p_dim,
        stride_s_token,
        stride_s_head,
        stride_s_dim,
        stride_pl_head,
        stride_pl_token,
        stride_sl_head,
        stride_sl_token,
        stride_ol_head,
        stride_ol_token,
        HAS_OUTPUT_LSE: tl.constexpr,
        BASE_E: tl.constexpr,
        F64: tl.constexpr,  # an LSE is float64: merge in float64, as the PyTorch path does
        BLOCK_D: tl.constexpr,
    ):
        # One program per (token, head): one row of head_size values.
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        lse_p = tl.load(prefix_lse_ptr + head * stride_pl_head + token * stride_pl_token)
        lse_s = tl.load(suffix_lse_ptr + head * stride_sl_head + token * stride_sl_token)
        if F64:
            lse_p = lse_p.to(tl.float64)
            lse_s = lse_s.to(tl.float64)
        else:
            lse_p = lse_p.to(tl.float32)
            lse_s = lse_s.to(tl.float32)
        # An empty side has LSE -inf; +inf is read as -inf too.
        lse_p = tl.where(lse_p == float("inf"), float("-inf"), lse_p)
        lse_s = tl.where(lse_s == float("inf"), float("-inf"), lse_s)
        lse_max = tl.maximum(lse_p, lse_s)
        # Rows empty on both sides would compute -inf - -inf = NaN; shift them by 0 instead.
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        if BASE_E:
            weight_p = tl.exp(lse_p - lse_max)
            weight_s = tl.exp(lse_s - lse_max)
        else:
            weight_p = tl.exp2(lse_p - lse_max)
            weight_s = tl.exp2(lse_s - lse_max)
        total = weight_p + weight_s
        inv_total = 1.0 / tl.where(total > 0, total, 1.0)
        scale_p = weight_p * inv_total
        scale_s = weight_s * inv_total

        dims = tl.arange(0, BLOCK_D)
        mask = dims < head_size
        x_p = tl.load(
            prefix_ptr + token * stride_p_token + head * stride_p_head + dims * stride_p_dim,
            mask=mask,
        )
        x_s = tl.load(
            suffix_ptr + token * stride_s_token + head * stride_s_head + dims * stride_s_dim,
            mask=mask,
        )
        # A side of weight 0 adds exactly 0, even where its rows hold garbage (inf, NaN).
        out = tl.where(scale_p > 0, scale_p * x_p.to(scale_p.dtype), 0.0)
        out += tl.where(scale_s > 0, scale_s * x_s.to(scale_s.dtype), 0.0)
        tl.store(
            out_ptr + token * stride_o_token + head * stride_o_head + dims * stride_o_dim,
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
        if HAS_OUTPUT_LSE:
            if BASE_E:
                merged = lse_max + tl.log(total)  # log(0) = -inf for rows empty on both sides
            else:
                merged = lse_max + tl.log2(total)
            tl.store(
                out_lse_ptr + head * stride_ol_head + token * stride_ol_token,
                merged.to(out_lse_ptr.dtype.element_ty),
            )


def _empty_as_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(lse == math.inf, -math.inf, lse)


def _weighted(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # weight: float32/64 [num_tokens, num_heads]; x: [num_tokens, num_heads, head_size]. The
    # product promotes to the weight's dtype without a separate copy of x.
    weight = weight[..., None]
    return torch.where(weight > 0, weight * x, 0.0)


def _validate(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None,
) -> None:
    outputs = {"output": output, "prefix_output": prefix_output, "suffix_output": suffix_output}
    lses = {"prefix_lse": prefix_lse, "suffix_lse": suffix_lse}
    if output_lse is not None:
        lses["output_lse"] = output_lse
    for name, x in {**outputs, **lses}.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor (got {type(x).__name__}).")
    if output.dim() != 3:
        raise ValueError(
            f"{_OP}: output must be [num_tokens, num_heads, head_size] (got rank {output.dim()}, "
            "expected 3)."
        )
    for name, x in outputs.items():
        if x.shape != output.shape:
            raise ValueError(
                f"{_OP}: {name}'s shape differs from output's (got {list(x.shape)}, expected "
                f"{list(output.shape)})."
            )
        if x.dtype not in _OUTPUT_DTYPES:
            raise TypeError(
                f"{_OP}: {name} has an unsupported dtype (got {x.dtype}, expected float32, "
                "float16 or bfloat16)."
            )
    if suffix_output.dtype != prefix_output.dtype:
        raise TypeError(
            f"{_OP}: suffix_output's dtype differs from prefix_output's (got "
            f"{suffix_output.dtype}, expected {prefix_output.dtype})."
        )
    num_tokens, num_heads, _ = output.shape
    for name, x in lses.items():
        if x.shape != (num_heads, num_tokens):
            raise ValueError(
                f"{_OP}: {name} must be [num_heads, num_tokens] (got {list(x.shape)}, expected "
                f"[{num_heads}, {num_tokens}])."
            )
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"{_OP}: {name} has the wrong dtype (got {x.dtype}, expected torch.float32 or "
                "torch.float64)."
            )
    for name, x in {**outputs, **lses}.items():
        if x.device != output.device:
            raise ValueError(
                f"{_OP}: {name} is on another device than output (got {x.device}, expected "
                f"{output.device}). Put all tensors on one device."
            )
