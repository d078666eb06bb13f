"""Block tables of a shuffled paged cache, and the slots of chosen key positions.

Physical blocks come from a pool larger than needed, in `torch.randperm` order; block 0 (the
null block) is never assigned and fills unused table entries, so a kernel that assumes
contiguous blocks or reads block 0 is caught. A slot is `block_id * block_size + offset`
(docs/semantics.md, "KV cache").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from anyattn.slots import compute_slot_mapping

__all__ = ["assign_blocks", "cross_slot_mapping", "token_slots"]


def assign_blocks(
    seq_lens: Sequence[int], block_size: int, *, common_prefix_len: int = 0,
    num_cols: int | None = None, generator: torch.Generator | None = None,
    spare_blocks: bool = True,
) -> tuple[torch.Tensor, int]:  # fmt: skip
    """Shuffled physical blocks for each request, from a pool larger than needed.

    Args:
        seq_lens: tokens each request must hold.
        common_prefix_len: shared leading tokens, a multiple of `block_size`: the same physical
            blocks lead every request's table.
        num_cols: width of the table (default: the most blocks any request needs).
        spare_blocks: a pool half as large again as needed (at least 4 spare blocks), so that
            the ids used are sparse in it; False: exactly the blocks needed, plus block 0.

    Returns:
        `(block_table, num_blocks)`: int32 `[num_reqs, num_cols]` (CPU, unused entries 0, the
        null block) and the pool size.
    """
    if common_prefix_len % block_size:
        raise ValueError(
            f"assign_blocks: common_prefix_len must be a multiple of block_size to share whole "
            f"blocks (got {common_prefix_len} and {block_size})."
        )
    num_shared = common_prefix_len // block_size
    needed = [-(-s // block_size) for s in seq_lens]
    num_cols = max(max(needed, default=0), num_cols or 0)
    total = num_shared + sum(n - num_shared for n in needed)
    # Spare blocks make the used ids sparse in the pool, not just permuted among themselves.
    num_blocks = 1 + total + (max(4, total // 2) if spare_blocks else 0)
    pool = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    shared, pool = pool[:num_shared], pool[num_shared:]
    block_table = torch.zeros(len(needed), max(num_cols, 1), dtype=torch.int32)
    for r, n in enumerate(needed):
        own, pool = pool[: n - num_shared], pool[n - num_shared :]
        block_table[r, :n] = torch.tensor(shared + own, dtype=torch.int32)
    return block_table, num_blocks


def token_slots(
    block_table: torch.Tensor, positions: list[torch.Tensor], block_size: int
) -> torch.Tensor:
    """int64 slots of the given key positions of each request (row r of `block_table`)."""
    parts = [
        block_table[r, pos // block_size].long() * block_size + pos % block_size
        for r, pos in enumerate(positions)
    ]
    return torch.cat(parts)


def cross_slot_mapping(
    block_table: torch.Tensor, encoder_seq_lens: Sequence[int], first_step: Sequence[bool],
    block_size: int,
) -> torch.Tensor:  # fmt: skip
    """Slots of the encoder tokens of first-step requests, in batch order (int64, CPU)."""
    rows = [r for r, first in enumerate(first_step) if first]
    if not rows:
        return torch.zeros(0, dtype=torch.int64)
    lens = torch.tensor([encoder_seq_lens[r] for r in rows], dtype=torch.int32)
    start = torch.zeros(len(rows) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=start[1:])
    return compute_slot_mapping(block_table[rows], start, lens, block_size)
