"""The forward of a layer that runs decodes and prefills on different backends over one cache
(docs/per_phase.md): both parts' calls are checked, the step's K/V written once (by the decode
impl), then each part runs on its impl into its rows of one output; LSEs come back in natural
base whatever base each impl writes.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from anyattn.declarations import AttentionBackend
from anyattn.impl import AttentionImpl, AttentionLayer
from anyattn.phase_metadata import PhaseSplitMetadata
from anyattn.types import ENCODER_TYPES
from anyattn.validation import cache_block_shape, check_layer_call, check_step_against_cache

__all__ = ["PhaseLayer", "forward_by_phase"]


class PhaseLayer(AttentionLayer, Protocol):
    """What `forward_by_phase` reads of the layer (`anyattn.layer.Attention` has it)."""

    layer_name: str
    backend: type[AttentionBackend]
    impl: AttentionImpl
    prefill_impl: AttentionImpl | None


def _part_lse(output_lse: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """A contiguous float32 buffer for one part's LSEs (impls take `[num_heads, num_tokens]`
    contiguous; a column slice of the caller's buffer is not)."""
    if output_lse is None:
        return None
    return torch.empty(
        (output_lse.shape[0], rows.stop - rows.start), dtype=torch.float32, device=output_lse.device
    )


def _is_layer_cache(impl: AttentionImpl, kv_cache: object, split: PhaseSplitMetadata) -> bool:
    """Whether `kv_cache` has the shape of the layer's standard cache (`cache_block_shape`)."""
    part = split.decode if split.decode is not None else split.prefill
    return isinstance(kv_cache, torch.Tensor) and tuple(kv_cache.shape[1:]) == cache_block_shape(
        impl, getattr(part, "block_size", None)
    )


def forward_by_phase(
    layer: PhaseLayer,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    split: PhaseSplitMetadata,
    output: torch.Tensor,
    output_lse: torch.Tensor | None,
) -> torch.Tensor:
    """Run one per-phase step of `layer` (shapes as `Attention.forward`); writes
    `output[:num_actual_tokens]` and `output_lse[:, :num_actual_tokens]` (natural log).

    Raises:
        ValueError: the layer has no prefill backend but the step has a prefill part, or the
            first problem either part's call has (nothing is written then).
    """
    prefill_impl = layer.prefill_impl
    if split.prefill is not None and prefill_impl is None:
        raise ValueError(
            f"Attention({layer.layer_name}).forward: the step has a prefill part but the layer "
            f"runs one backend ({layer.backend.get_name()}). Call use_backend(decode, "
            "prefill_backend=...) first, or build the step with the layer's one builder."
        )
    num_decode_tokens, num_tokens = split.num_decode_tokens, split.num_actual_tokens
    parts: list[tuple[AttentionImpl, object, slice]] = []
    if split.decode is not None:
        parts.append((layer.impl, split.decode, slice(0, num_decode_tokens)))
    if split.prefill is not None:
        assert prefill_impl is not None
        parts.append((prefill_impl, split.prefill, slice(num_decode_tokens, query.shape[0])))
    # One set of row views per part, the very objects checked and then run (the check's
    # record is matched by identity, so `forward` does not check them again).
    calls = [
        (impl, metadata, rows, query[rows], None if key is None else key[rows],
         None if value is None else value[rows], output[rows], _part_lse(output_lse, rows))
        for impl, metadata, rows in parts
    ]  # fmt: skip
    # The whole step against the cache first, so that a bad slot or block id is reported with
    # the step's own request and token indices (a part's check counts within the part). A
    # cache of another shape is left to the parts' checks, which say what it should be.
    if layer.impl.attn_type not in ENCODER_TYPES and _is_layer_cache(layer.impl, kv_cache, split):
        api = f"Attention({layer.layer_name}).forward"
        check_step_against_cache(api, split.common_attn_metadata, kv_cache)
    # Every part's call is checked before the one cache write: a refused call writes nothing.
    for impl, metadata, _, q, k, v, out, lse in calls:
        check_layer_call(impl, layer, q, k, v, kv_cache, metadata, out, lse, writes_kv=False)
    if key is not None:
        step = split.common_attn_metadata
        layer.impl.do_kv_cache_update(layer, key, value, kv_cache, step.slot_mapping, step)
    for impl, metadata, rows, q, k, v, out, lse in calls:
        impl.forward(layer, q, k, v, kv_cache, metadata, out, output_lse=lse)
        if output_lse is not None:
            assert lse is not None
            real = slice(rows.start, min(rows.stop, num_tokens))
            scale = 1.0 if impl.lse_base_on_e else math.log(2.0)  # log2 -> natural log
            output_lse[:, real] = lse[:, : real.stop - real.start] * scale
    return output
