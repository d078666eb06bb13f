"""A step split by phase: its leading decode requests and the (fresh or chunked) prefills after
them, each described by its own `CommonAttentionMetadata` and built by its own backend's builder
(docs/per_phase.md).

`split_by_phase` cuts a decodes-first step in two; `PhaseSplitMetadata` is what a per-phase
layer (`anyattn.layer.Attention` with a prefill backend) receives: the whole step (whose slot
mapping the layer writes once) and the two parts' built metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from anyattn.metadata import CommonAttentionMetadata

__all__ = ["PhaseSplitMetadata", "split_by_phase"]


@dataclass(frozen=True)
class PhaseSplitMetadata:
    """One step of a layer that runs decodes and prefills on different backends: the whole
    step (`common_attn_metadata`, whose `slot_mapping` the layer writes K/V with once), and
    the metadata each backend's builder built over `split_by_phase`'s parts, `decode` for rows
    `[0, num_decode_tokens)` and `prefill` for the rest (None for a part without requests)."""

    common_attn_metadata: CommonAttentionMetadata
    num_decode_tokens: int
    decode: object | None
    prefill: object | None

    @property
    def num_actual_tokens(self) -> int:
        return self.common_attn_metadata.num_actual_tokens

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.common_attn_metadata.slot_mapping


def _max(values: np.ndarray) -> int:
    return int(values.max()) if values.size else 0


def split_by_phase(
    common: CommonAttentionMetadata, num_decodes: int
) -> tuple[CommonAttentionMetadata | None, CommonAttentionMetadata | None]:
    """Cut a decodes-first step after its first `num_decodes` requests.

    `common` has its decodes first (`anyattn.metadata.split_decodes_and_prefills`). The
    decode part holds requests `[0, num_decodes)` and their tokens `[0, D)`; the prefill part
    the rest, offsets rebased to 0, slot mapping `slot_mapping[D:]` (padding included). Device
    tensors are views or device-side arithmetic (no synchronisation).

    Returns:
        `(decode, prefill)`, each None when it has no request.

    Raises:
        TypeError: `num_decodes` is not an int.
        ValueError: `num_decodes` outside `[0, num_reqs]`, or a cross-attention step.
    """
    num_reqs = common.num_reqs
    if common.encoder_seq_lens_cpu is not None:
        raise ValueError(
            "split_by_phase: cross-attention steps are not split by phase (got encoder_seq_lens, "
            "expected decoder attention). Build them with the layer's one builder."
        )
    if isinstance(num_decodes, bool) or not isinstance(num_decodes, int | np.integer):
        raise TypeError(f"split_by_phase: num_decodes must be an int (got {num_decodes!r}).")
    if not 0 <= num_decodes <= num_reqs:
        raise ValueError(
            f"split_by_phase: num_decodes outside the step (got {num_decodes}, expected 0 <= "
            f"num_decodes <= num_reqs = {num_reqs})."
        )
    num_decode_tokens = int(common.host_batch.query_start_loc[num_decodes])
    decode = prefill = None
    if num_decodes:
        decode = _part(common, slice(0, num_decodes), slice(0, num_decode_tokens))
    if num_decodes < num_reqs:
        prefill = _part(common, slice(num_decodes, num_reqs), slice(num_decode_tokens, None))
    return decode, prefill


def _part(common: CommonAttentionMetadata, reqs: slice, tokens: slice) -> CommonAttentionMetadata:
    """The requests `reqs` of `common`, whose tokens are `tokens`, offsets rebased to 0."""
    host, start = common.host_batch, tokens.start
    loc = slice(reqs.start, reqs.stop + 1)

    def rebased(offsets: torch.Tensor) -> torch.Tensor:  # a view when nothing is subtracted
        return offsets if start == 0 else (offsets - start).to(offsets.dtype)

    return CommonAttentionMetadata(
        query_start_loc=rebased(common.query_start_loc[loc]),
        query_start_loc_cpu=rebased(common.query_start_loc_cpu[loc]),
        seq_lens=common.seq_lens[reqs],
        seq_lens_cpu=common.seq_lens_cpu[reqs],
        num_computed_tokens_cpu=common.num_computed_tokens_cpu[reqs],
        num_reqs=reqs.stop - reqs.start,
        num_actual_tokens=int(host.query_start_loc[reqs.stop]) - start,
        max_query_len=_max(host.query_lens[reqs]),
        max_seq_len=_max(host.seq_lens[reqs]),
        block_table_tensor=common.block_table_tensor[reqs],
        slot_mapping=common.slot_mapping[tokens],
        causal=common.causal,
        block_table_cpu=common.block_table_cpu[reqs],
        slot_mapping_cpu=common.slot_mapping_cpu[tokens],
    )
