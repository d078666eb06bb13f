"""`Linear` on the CPU: both weight layouts loaded alike, and every row count (the one-row
matrix-vector path and the `weight @ x.T` path) against a float64 product."""

from __future__ import annotations

import pytest
import torch

from anyattn.engine.models.linear import Linear
from anyattn.engine.models.weights import load_into_slots


def _loaded(in_features: int, out_features: int, has_bias: bool, dtype=torch.float32):
    """A Linear whose weight arrives as two row ranges (as a fused q/k/v or gate/up does)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if has_bias else None
    linear = Linear(in_features, out_features, has_bias=has_bias, dtype=dtype, device="cpu")
    split = out_features // 3
    parts = {"a": slice(0, split), "b": slice(split, out_features)}
    slots = dict(linear.weight_slots(parts))
    tensors = [(f"{name}.weight", weight[rows]) for name, rows in parts.items()]
    if has_bias:
        tensors += [(f"{name}.bias", bias[rows]) for name, rows in parts.items()]
    load_into_slots("test", slots, tensors)
    return linear, weight, bias


def test_float32_keeps_both_layouts_with_the_same_values():
    linear, weight, _ = _loaded(48, 80, has_bias=False)
    assert linear.weight.stride() == (1, 80)  # column-major
    assert linear.weight_rows is not None and linear.weight_rows.is_contiguous()
    assert torch.equal(linear.weight, weight)
    assert torch.equal(linear.weight_rows, weight)


def test_other_cpu_dtypes_keep_one_column_major_layout():
    linear, weight, _ = _loaded(48, 80, has_bias=False, dtype=torch.bfloat16)
    assert linear.weight_rows is None
    assert linear.weight.stride() == (1, 80)
    assert torch.equal(linear.weight, weight.to(torch.bfloat16))


@pytest.mark.parametrize("num_tokens", [1, 2, 8, 37])
@pytest.mark.parametrize("has_bias", [False, True])
def test_every_row_count_matches_a_float64_product(num_tokens, has_bias):
    linear, weight, bias = _loaded(576, 150, has_bias)
    generator = torch.Generator().manual_seed(1)
    # a strided input (every other column of a wider one): the layer must not depend on layout
    x = torch.randn(num_tokens, 2 * 576, generator=generator)[:, ::2]
    with torch.inference_mode():
        out = linear(x)
    ref64 = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    ref32 = torch.nn.functional.linear(x, weight, bias)
    assert out.shape == (num_tokens, 150) and out.dtype == torch.float32
    # the fp32 reference's own error, doubled, plus fp32 rounding at the outputs' magnitude
    floor = 2 * torch.finfo(torch.float32).eps * ref64.abs().max().item()
    bound = 2 * (ref32.double() - ref64).abs().max().item() + floor
    assert (out.double() - ref64).abs().max().item() <= bound
