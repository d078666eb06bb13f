"""Slots and blocks (docs/semantics.md, "KV cache"): where each new token's K/V is written,
and how an engine block table maps onto a smaller kernel block size.

A slot is `block_id * block_size + offset`; -1 marks padding that is never written. Block 0 is
the null block, never allocated, the filler of unused table entries.
"""

from __future__ import annotations

import torch

__all__ = ["compute_slot_mapping", "expand_block_table"]


def compute_slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """The cache slot of every new token: `block_table[r, p // block_size] * block_size +
    p % block_size` at position `p` of request `r`; tokens past the real ones get -1.

    Args:
        block_table: int32 `[num_reqs, max_blocks]`, blocks of `block_size` tokens.
        query_start_loc: int32 `[num_reqs + 1]`, on the same device as block_table.
        seq_lens: int32 `[num_reqs]`, context + new tokens.
        num_tokens: length of the int64 result (default: the real tokens).

    Raises:
        ValueError: a sequence needs more blocks than `block_table` has columns.
    """
    num_reqs = seq_lens.shape[0]
    query_lens = (query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]).long()
    num_real = int(query_start_loc[num_reqs]) if num_reqs else 0
    num_tokens = num_real if num_tokens is None else num_tokens
    if num_tokens < num_real:
        raise ValueError(
            f"compute_slot_mapping: num_tokens is smaller than the real tokens (got {num_tokens}, "
            f"expected >= {num_real})."
        )
    max_blocks = block_table.shape[1]
    needed = (int(seq_lens.max()) + block_size - 1) // block_size if num_reqs else 0
    if needed > max_blocks:
        raise ValueError(
            f"compute_slot_mapping: block_table too narrow for the longest sequence (got "
            f"{max_blocks} columns, expected >= {needed} for block_size {block_size})."
        )
    device = block_table.device
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    if num_real == 0:
        return slots
    # token t of request r sits at position context_r + (t - query_start_loc[r])
    req = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens.to(device))
    offset_in_query = torch.arange(num_real, device=device) - query_start_loc[req].long()
    context = (seq_lens.long() - query_lens).to(device)
    positions = context[req] + offset_in_query
    block_ids = block_table[req, positions // block_size].long()
    slots[:num_real] = block_ids * block_size + positions % block_size
    return slots


def expand_block_table(
    block_table: torch.Tensor, block_size: int, kernel_block_size: int
) -> torch.Tensor:
    """Split each engine block of int32 `block_table [num_reqs, max_blocks]` into
    k = `block_size // kernel_block_size` kernel blocks: b becomes `b*k ... b*k + k - 1`
    (the null block 0 stays null), giving `[num_reqs, max_blocks * k]`; the cache is viewed
    with the smaller block size."""
    if block_size % kernel_block_size:
        raise ValueError(
            f"expand_block_table: block_size must be a multiple of kernel_block_size (got "
            f"{block_size} and {kernel_block_size})."
        )
    k = block_size // kernel_block_size
    if k == 1:
        return block_table
    sub = torch.arange(k, dtype=block_table.dtype, device=block_table.device)
    expanded = block_table.unsqueeze(-1) * k + sub
    return expanded.flatten(1)
