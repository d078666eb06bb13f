"""`Linear`: `x @ weight.T + bias`, with the weight laid out for what the device's BLAS reads
fastest at the step's number of rows.

On the CPU in float32 (MKL) one row is fastest over a column-major weight and two or more as
`weight @ x.T` over a row-major one (benchmarks/cpu_linear.py), so the weight is kept in both
layouts there, at twice its memory. Elsewhere one layout serves: row-major on CUDA,
column-major on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from anyattn.engine.models.weights import WeightSlot, empty_param

__all__ = ["Linear"]


class Linear(nn.Module):
    """A `[out_features, in_features]` weight (and optional bias) applied to
    `[num_tokens, in_features]` inputs.

    `weight` is the logical weight `F.linear` takes (column-major storage on the CPU);
    `weight_rows` is its row-major copy on the CPU in float32, else None. Both are filled by
    the loader through `weight_slots`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        has_bias: bool = False,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        device = torch.device(device)
        factory = {"dtype": dtype, "device": device}
        if device.type == "cpu":
            # [in, out] row-major storage: its transpose is the column-major [out, in] weight.
            storage = torch.empty(in_features, out_features, **factory)
            self.weight = nn.Parameter(storage.t(), requires_grad=False)
        else:
            self.weight = empty_param(out_features, in_features, **factory)
        self.weight_rows = None
        if device.type == "cpu" and dtype == torch.float32:
            self.weight_rows = empty_param(out_features, in_features, **factory)
        self.bias = empty_param(out_features, **factory) if has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[num_tokens, in_features]` -> `[num_tokens, out_features]`.

        From two rows on, on the CPU in float32, the result is the transpose of the
        `[out_features, num_tokens]` product (strides `(1, num_tokens)`): element-wise ops and
        the residual add read it as it is, and a copy into rows would cost a pass over data
        the other core just wrote. Call `.contiguous()` where rows must be contiguous.
        """
        if self.weight_rows is None or x.shape[0] < 2:
            return F.linear(x, self.weight, self.bias)
        # x must be row-major for MKL's fast path (x.t() column-major).
        out = torch.mm(self.weight_rows, x.contiguous().t()).t()  # [num_tokens, out] view
        return out if self.bias is None else out + self.bias

    def weight_slots(self, parts: dict[str, slice]) -> Iterator[tuple[str, WeightSlot]]:
        """The slots of the checkpoint's `<name>.weight` (and `.bias`) tensors, `name` filling
        rows `parts[name]` of this (possibly fused) layer, in both layouts."""
        for name, rows in parts.items():
            copies = () if self.weight_rows is None else (self.weight_rows[rows],)
            yield f"{name}.weight", WeightSlot(self.weight[rows], copies=copies)
            if self.bias is not None:
                yield f"{name}.bias", WeightSlot(self.bias[rows])
