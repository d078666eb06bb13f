"""FLASHINFER's metadata: per layer, its record's `LayerPlan` (the wrappers a build planned, or
XQA's inputs). A wrapper holds one plan at a time, so each plan remembers the build that made it
and a forward on metadata whose wrappers have been planned since is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from anyattn.layer_params import LayerParams
from anyattn.metadata import CommonAttentionMetadata

__all__ = ["FlashInferMetadata", "LayerPlan", "WrapperSlot", "check_plans_current"]


class WrapperSlot:
    """A wrapper (or XQA's CUDA-graph buffers), the build whose plan it holds, and the event
    recorded after that plan (CUDA), which the next plan waits for while the device has not
    yet run the plan's copy."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.generation = 0
        self.event: Any = None  # recorded after the last plan (CUDA)

    def wait_for_last_copy(self) -> None:
        """Block only while the device has not yet run the last plan's copy."""
        if self.event is not None and not self.event.query():
            self.event.synchronize()

    def plan(self, generation: int, device: torch.device, *args: Any, **kwargs: Any) -> None:
        """`obj.plan(*args, **kwargs)` for build `generation`, after the last plan's copy has
        run; records the event the next plan waits for (CUDA). A plan that raises leaves the
        slot with no usable plan (generation 0)."""
        self.wait_for_last_copy()
        self.generation = 0
        self.obj.plan(*args, **kwargs)
        self.generation = generation
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))


def check_plans_current(api: str, generation: int, slots: tuple[WrapperSlot, ...]) -> None:
    """Raises `RuntimeError` when a build after `generation` has planned any of `slots` again
    (metadata holding those plans is stale)."""
    for slot in slots:
        if slot.generation != generation:
            raise RuntimeError(
                f"{api}: the metadata is stale (built by build {generation}; build "
                f"{slot.generation} has planned its wrappers since). Run a step's layers "
                "before building the next step, or build again."
            )


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """What the layers of one record run for one step.

    Attributes:
        record: the layers' `LayerParams`.
        decode: the planned decode wrapper, or None (no decodes, or XQA runs them).
        ragged: the planned ragged prefill wrapper, or None (no fresh prefills it runs).
        paged: the planned paged prefill wrapper, or None (no other prefills).
        xqa: XQA's inputs for the decodes, `(page_table, seq_lens, workspace)`: int32
            `[decode_rows, pages]`, int32 `[decode_rows]`, its zeroed uint8 workspace; or None.
        window_left: FlashInfer's window (`sliding_window - 1`, -1 for none).
    """

    record: LayerParams
    decode: Any
    ragged: Any
    paged: Any
    xqa: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    window_left: int
    generation: int
    slots: tuple[WrapperSlot, ...] = field(repr=False)

    def check_current(self, api: str) -> None:
        """Raises `RuntimeError` when a later build has planned this plan's wrappers again."""
        check_plans_current(api, self.generation, self.slots)


@dataclass(frozen=True, slots=True)
class FlashInferMetadata:
    """What `FlashInferImpl.forward` needs for one step (frozen; see the module docstring).

    Attributes:
        num_actual_tokens: real tokens; output rows past it are untouched (except a CUDA-graph
            decode batch's padding rows, see `decode_rows`).
        slot_mapping: int64 `[num_tokens]` (device), for the cache write.
        causal: False for bidirectional attention.
        num_decodes: the leading single-token requests (= their tokens).
        decode_rows: query rows the decode run covers: `num_decodes`, or the padded batch size
            of a CUDA-graph decode step (its padding rows are written too).
        paged_tokens, ragged_tokens: `[start, end)` token rows of the paged wrapper's
            requests and of the fresh prefills the ragged wrapper runs.
        cudagraph_size: the captured batch size this step is planned for, or None.
        block_size, num_kv_heads, head_size, dtype, cache_dtype: the KV-cache spec.
        layer_names: the builder's layers (a forward of another layer is refused).
        plans: layer name -> its record's `LayerPlan`.
        common_attn_metadata: the step it was built from (its mirrors for the checks).
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    causal: bool
    num_decodes: int
    decode_rows: int
    paged_tokens: tuple[int, int]
    ragged_tokens: tuple[int, int]
    cudagraph_size: int | None
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    layer_names: frozenset[str]
    plans: dict[str, LayerPlan] = field(repr=False)
    common_attn_metadata: CommonAttentionMetadata = field(repr=False)
