"""The metadata MLA backends share (docs/mla.md, "Two paths"), and the context chunk plan.

A step is laid out decodes first (the builder's `reorder_batch_threshold` is 1): its first
`num_decode_tokens` rows are decode tokens, one per decode request, run absorbed
(`forward_mqa`); the rest, `num_prefill_tokens` rows of `num_prefills` requests, run
up-projected (`forward_mha`). A prefill request's cached context is read in chunks of at most
`workspace_tokens` latent rows across requests (`plan_context_chunks`), planned in `build` from
the CPU mirrors: `forward_*` never plans.

A backend that needs more adds it by subclassing: a frozen dataclass subclass of `MLAMetadata`
(or of its decode / prefill parts) with the backend's fields, made by its builder's overrides
(`MLAMetadataBuilder.plan_decodes`, `plan_prefills`, `build`; `extend_metadata` copies a built
`MLAMetadata` into the subclass).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TypeVar

import numpy as np
import torch

from anyattn.metadata import CommonAttentionMetadata

__all__ = [
    "MLAChunkPiece",
    "MLAContextChunk",
    "MLADecodeMetadata",
    "MLAMetadata",
    "MLAPrefillMetadata",
    "extend_metadata",
    "plan_context_chunks",
]


@dataclass(frozen=True)
class MLAChunkPiece:
    """One prefill request's share of a context chunk.

    Attributes:
        request: index among the step's prefill requests.
        q_start, q_len: that request's query rows, counted from the first prefill row.
        row_start, row_len: its rows within the chunk (`[row_start, row_start + row_len)`).
        context_start: position of its first row in the request's sequence.
    """

    request: int
    q_start: int
    q_len: int
    row_start: int
    row_len: int
    context_start: int


@dataclass(frozen=True)
class MLAContextChunk:
    """At most `workspace_tokens` cached latent rows, read (and up-projected) together.

    For a kernel that runs every prefill request over the chunk at once, `cu_seq_lens` gives
    each prefill request's rows in it (its keys there): request r holds rows
    `[cu_seq_lens[r], cu_seq_lens[r + 1])`, none for a request whose context the chunk does not
    hold. Such a request attends to no key in the chunk: its partial LSE is -inf, and the merge
    must give that side weight 0 (`anyattn.ops.merge_attn_states` does; the running side is
    finite, since a query always sees its own token).

    Attributes:
        num_tokens: rows in the chunk.
        slots: int64 `[num_tokens]` (device): the cache slot of each row
            (`block_id * block_size + offset`).
        slots_cpu: the same, on the CPU.
        pieces: the requests whose context the chunk holds, in row order.
        cu_seq_lens: int32 `[num_prefills + 1]` (device): row offsets of each prefill request
            in the chunk (`cu_seq_lens[-1] == num_tokens`).
        cu_seq_lens_cpu: the same, on the CPU.
        max_seq_len: the most rows one request has in the chunk.
    """

    num_tokens: int
    slots: torch.Tensor
    slots_cpu: torch.Tensor
    pieces: tuple[MLAChunkPiece, ...]
    cu_seq_lens: torch.Tensor
    cu_seq_lens_cpu: torch.Tensor
    max_seq_len: int


@dataclass(frozen=True)
class MLADecodeMetadata:
    """The decode part: one query row per decode token, in row order.

    Attributes:
        block_table: int32 `[num_decode_tokens, max_blocks]` (device): each row's request's
            blocks.
        seq_lens: int32 `[num_decode_tokens]` (device): keys of each row (its position + 1).
        seq_lens_cpu: the same, on the CPU.
        max_seq_len: the longest of them.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    max_seq_len: int


@dataclass(frozen=True)
class MLAPrefillMetadata:
    """The prefill part: requests with new tokens to attend causally and maybe a context.

    Attributes:
        query_start_loc: int32 `[num_prefills + 1]` (device): row offsets, from the first
            prefill row.
        query_start_loc_cpu: the same, on the CPU.
        seq_lens_cpu, context_lens_cpu: int32 `[num_prefills]`: context + new tokens, and
            context alone.
        max_query_len: the longest query among them.
        block_table: int32 `[num_prefills, max_blocks]` (device).
        chunks: the context chunk plan (empty when no request has a context).
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    context_lens_cpu: torch.Tensor
    max_query_len: int
    block_table: torch.Tensor
    chunks: tuple[MLAContextChunk, ...]


@dataclass(frozen=True)
class MLAMetadata:
    """One step of one MLA KV-cache group, as every MLA impl reads it. Read-only.

    Attributes:
        num_actual_tokens: real rows; rows past it are left untouched.
        num_reqs: real requests.
        block_size: tokens per cache block.
        slot_mapping: int64 `[num_tokens]` (device): where each new row's latent is written.
        num_decodes, num_decode_tokens: the leading decode requests and their rows.
        num_prefills, num_prefill_tokens: the requests and rows after them.
        decode: the decode part, or None when the step has no decode row.
        prefill: the prefill part, or None when it has no prefill row.
        workspace_tokens: the most rows a context chunk holds.
        layer_names: the builder's layers (every entry point refuses any other).
        common_attn_metadata: the step it was built from (its mirrors for the checks).
    """

    num_actual_tokens: int
    num_reqs: int
    block_size: int
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: MLADecodeMetadata | None
    prefill: MLAPrefillMetadata | None
    workspace_tokens: int
    layer_names: frozenset[str]
    common_attn_metadata: CommonAttentionMetadata


M = TypeVar("M", bound=MLAMetadata)


def extend_metadata(base: MLAMetadata, metadata_cls: type[M], **extra: object) -> M:
    """`base`'s fields and `extra` as a `metadata_cls`, a backend's subclass of `MLAMetadata`
    (how a builder that overrides `build` adds its plan to the shared one).

    Raises:
        TypeError: `metadata_cls` not an `MLAMetadata` subclass, or `extra` naming a field it
            lacks.
    """
    if not (isinstance(metadata_cls, type) and issubclass(metadata_cls, MLAMetadata)):
        raise TypeError(
            f"extend_metadata: metadata_cls must be a subclass of MLAMetadata (got "
            f"{metadata_cls!r})."
        )
    shared = {f.name: getattr(base, f.name) for f in fields(MLAMetadata)}
    return metadata_cls(**shared, **extra)


def plan_context_chunks(
    context_lens: np.ndarray,
    query_start_loc: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    workspace_tokens: int,
) -> list[tuple[np.ndarray, tuple[MLAChunkPiece, ...]]]:
    """Split the prefill requests' contexts, in request order, into chunks of at most
    `workspace_tokens` rows; a request's context may span chunks, and a chunk requests. A
    request without new tokens (no query) has its context left out.

    Args:
        context_lens: int `[num_prefills]`: cached tokens before each request's new ones.
        query_start_loc: int `[num_prefills + 1]`: row offsets from the first prefill row.
        block_table: int `[num_prefills, max_blocks]`: physical block ids.
        block_size: tokens per block.
        workspace_tokens: most rows per chunk (>= 1).

    Returns:
        `[(slots int64 [num_rows], pieces), ...]`, one entry per chunk, in order.
    """
    chunks: list[tuple[np.ndarray, tuple[MLAChunkPiece, ...]]] = []
    pieces: list[MLAChunkPiece] = []
    slots: list[np.ndarray] = []
    filled = 0
    for request, context in enumerate(context_lens.tolist()):
        start = 0
        q_start = int(query_start_loc[request])
        q_len = int(query_start_loc[request + 1]) - q_start
        while q_len and start < context:
            take = min(context - start, workspace_tokens - filled)
            positions = np.arange(start, start + take)
            blocks = block_table[request, positions // block_size].astype(np.int64)
            slots.append(blocks * block_size + positions % block_size)
            pieces.append(MLAChunkPiece(request, q_start, q_len, filled, take, start))
            filled += take
            start += take
            if filled == workspace_tokens:
                chunks.append((np.concatenate(slots), tuple(pieces)))
                pieces, slots, filled = [], [], 0
    if pieces:
        chunks.append((np.concatenate(slots), tuple(pieces)))
    return chunks
