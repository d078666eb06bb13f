"""The running requests' per-slot state as persistent numpy arrays, and a step's inputs from it.

A running request owns one slot (a row of each array) from admission until it finishes or is
preempted; the scheduler writes the rows, the model runner gathers a step from them (`gather`).

Arrays (R = max_num_reqs, L = max_model_len, B = ceil(L / block_size)), zero in free rows:

    token_ids     int32 [R, L + 1]  prompt then output tokens (PLACEHOLDER: sampled by a step
                                    still on the device); past num_tokens: stale
    num_tokens    int32 [R]         known tokens (prompt + output)
    num_computed  int32 [R]         leading tokens whose K/V are in the cache
    block_table   int32 [R, B]      engine block ids; past num_blocks: 0 (the null block)
    num_blocks    int32 [R]         filled columns of block_table
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from anyattn.engine.sequence import PLACEHOLDER

__all__ = ["InputBatch", "StepInputs"]


@dataclass(frozen=True)
class StepInputs:
    """One step's flat inputs, requests back to back in the given slot order (numpy, CPU):
    int64 `input_ids`, `positions`, `slot_mapping` `[num_tokens]`; int32 `query_start_loc`
    `[num_reqs + 1]`, `seq_lens` (context + new), `num_computed` (context) `[num_reqs]`, and
    `block_table` `[num_reqs, the most blocks any of them holds]`."""

    input_ids: np.ndarray
    positions: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    num_computed: np.ndarray
    block_table: np.ndarray
    slot_mapping: np.ndarray


class InputBatch:
    """Per-slot arrays of the running requests (module docstring)."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # lowest free slot first: a small batch stays in the leading rows
        self._free = list(range(max_num_reqs - 1, -1, -1))

    @classmethod
    def from_lists(
        cls,
        token_ids: Sequence[Sequence[int]],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
    ) -> tuple[InputBatch, np.ndarray]:
        """`(batch, slots)`: a batch holding the given requests in slots 0 .. n-1."""
        longest = max((len(t) for t in token_ids), default=1)
        widest = max((len(b) for b in block_tables), default=1)
        batch = cls(max(len(token_ids), 1), max(longest, widest * block_size), block_size)
        slots = [
            batch.add(tokens, computed, blocks)
            for tokens, computed, blocks in zip(token_ids, num_computed, block_tables, strict=True)
        ]
        return batch, np.asarray(slots, dtype=np.int32)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def add(self, token_ids: Sequence[int], num_computed: int, block_table: Sequence[int]) -> int:
        """Write a request into a free slot; returns it. RuntimeError: no free slot;
        ValueError: more tokens or blocks than a row holds."""
        if not self._free:
            raise RuntimeError(f"InputBatch.add: all {self.max_num_reqs} slots are taken.")
        if len(token_ids) > self.max_model_len or len(block_table) > self.max_blocks:
            raise ValueError(
                f"InputBatch.add: {len(token_ids)} tokens / {len(block_table)} blocks exceed a "
                f"row ({self.max_model_len} tokens, {self.max_blocks} blocks)."
            )
        slot = self._free.pop()
        self.token_ids[slot, : len(token_ids)] = token_ids
        self.num_tokens[slot] = len(token_ids)
        self.num_computed[slot] = num_computed
        self.block_table[slot, : len(block_table)] = block_table
        self.num_blocks[slot] = len(block_table)
        return slot

    def remove(self, slot: int) -> None:
        """Free a slot (its request finished or was preempted)."""
        self.block_table[slot, : self.num_blocks[slot]] = 0
        self.num_tokens[slot] = self.num_computed[slot] = self.num_blocks[slot] = 0
        self._free.append(slot)

    def extend_blocks(self, slot: int, block_table: Sequence[int]) -> None:
        """Write the blocks of `block_table` past those the row holds (the request grew)."""
        start, end = int(self.num_blocks[slot]), len(block_table)
        if end > start:
            self.block_table[slot, start:end] = block_table[start:end]
            self.num_blocks[slot] = end

    def advance(self, slots: np.ndarray, num_new: np.ndarray) -> None:
        """Count `num_new` more tokens of each slot as computed."""
        self.num_computed[slots] += num_new

    def append_tokens(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Append one token to each of `slots` (distinct slots)."""
        self.token_ids[slots, self.num_tokens[slots]] = tokens
        self.num_tokens[slots] += 1

    def reserve_tokens(self, slots: np.ndarray) -> None:
        """Append one token of unknown value (`PLACEHOLDER`) to each of `slots` (distinct)."""
        self.append_tokens(slots, np.full(len(slots), PLACEHOLDER, dtype=np.int32))

    def fill_tokens(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Give the reserved last token of each of `slots` its value."""
        self.token_ids[slots, self.num_tokens[slots] - 1] = tokens

    def gather(self, slots: np.ndarray, num_new: np.ndarray) -> StepInputs:
        """The step that runs the next `num_new[i]` tokens of each `slots[i]`, in this order."""
        num_new = np.asarray(num_new, dtype=np.int32)
        num_reqs = len(slots)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        computed = self.num_computed[slots]
        # the request row and position of every new token
        rows = np.repeat(np.arange(num_reqs), num_new)
        offsets = np.arange(num_tokens) - query_start_loc[rows]
        positions = computed[rows].astype(np.int64) + offsets
        input_ids = self.token_ids[slots[rows], positions].astype(np.int64)
        width = int(self.num_blocks[slots].max(initial=1))
        block_table = self.block_table[slots, :width]
        blocks = block_table[rows, positions // self.block_size].astype(np.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=computed + num_new,
            num_computed=computed,
            block_table=block_table,
            slot_mapping=slot_mapping,
        )

    def common_prefix_len(self, slots: np.ndarray) -> int:
        """Tokens in the leading KV blocks every request of `slots` shares within its context
        (0 for fewer than two requests)."""
        if len(slots) < 2:
            return 0
        width = int(self.num_blocks[slots].min())
        table = self.block_table[slots, :width]
        same = (table == table[0]).all(axis=0) & (table[0] != 0)
        shared = width if same.all() else int(np.argmin(same))
        context = int(self.num_computed[slots].min()) // self.block_size
        return min(shared, context) * self.block_size
