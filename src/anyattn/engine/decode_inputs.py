"""The persistent, padded inputs of graph decode steps (contract in `cuda_graphs`): buffers at
fixed addresses (`DecodeBuffers`), filled on the CPU (`fill_decode_inputs`), copied over and
built into every group's metadata (`StaticDecodeInputs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from anyattn.engine.input_batch import InputBatch
from anyattn.engine.kv_cache_group import KVCacheGroup, in_kernel_blocks
from anyattn.metadata import CommonAttentionMetadata, expand_block_table

__all__ = ["DecodeBuffers", "StaticDecodeInputs", "fill_decode_inputs"]


@dataclass
class DecodeBuffers:
    """Persistent step inputs sized for the largest capture (CPU or device): int64 `input_ids`,
    `positions`, `slot_mapping` `[max_num_tokens]`; int32 `query_start_loc` `[max_num_reqs + 1]`,
    `seq_lens`, `num_computed_tokens` `[max_num_reqs]`, `block_table` `[max_num_reqs,
    max_blocks]` (engine block ids)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor

    @classmethod
    def allocate(
        cls,
        max_num_reqs: int,
        max_num_tokens: int,
        max_blocks: int,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> DecodeBuffers:
        """Zeroed buffers; `pin_memory` for the CPU side of asynchronous copies."""

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

        return cls(
            input_ids=zeros(max_num_tokens, dtype=torch.int64),
            positions=zeros(max_num_tokens, dtype=torch.int64),
            query_start_loc=zeros(max_num_reqs + 1, dtype=torch.int32),
            seq_lens=zeros(max_num_reqs, dtype=torch.int32),
            num_computed_tokens=zeros(max_num_reqs, dtype=torch.int32),
            block_table=zeros(max_num_reqs, max_blocks, dtype=torch.int32),
            slot_mapping=zeros(max_num_tokens, dtype=torch.int64),
        )


def fill_decode_inputs(
    host: DecodeBuffers,
    batch: InputBatch,
    slots: np.ndarray,
    query_len: int,
    num_padded_reqs: int,
) -> int:
    """Write `query_len` new tokens of each of `slots` (int `[R]`) of `batch`, then dummies up
    to `num_padded_reqs` requests, into the first rows of the CPU buffers `host`; returns the
    longest real sequence (context + new tokens; 0 when none)."""
    num_reqs = len(slots)
    n, q = num_padded_reqs, query_len
    assert num_reqs <= n, "a padded batch cannot be smaller than the real one"
    step = batch.gather(slots, np.full(num_reqs, q, dtype=np.int32))
    real, padded = num_reqs * q, n * q
    ids = host.input_ids.numpy()
    positions = host.positions.numpy()
    slot_mapping = host.slot_mapping.numpy()
    table = host.block_table.numpy()
    host.query_start_loc.numpy()[: n + 1] = np.arange(0, (n + 1) * q, q, dtype=np.int32)
    ids[:real] = step.input_ids
    positions[:real] = step.positions
    slot_mapping[:real] = step.slot_mapping
    table[:n] = 0
    table[:num_reqs, : step.block_table.shape[1]] = step.block_table
    host.seq_lens.numpy()[:num_reqs] = step.seq_lens
    host.num_computed_tokens.numpy()[:num_reqs] = step.num_computed
    ids[real:padded] = 0
    positions[real:padded] = np.tile(np.arange(q), n - num_reqs)
    slot_mapping[real:padded] = -1
    host.seq_lens.numpy()[num_reqs:n] = q
    host.num_computed_tokens.numpy()[num_reqs:n] = 0
    return int(step.seq_lens.max(initial=0))


class StaticDecodeInputs:
    """The persistent inputs of graph steps for `groups`, sized for the largest padded batch
    (`max_model_len` sets the table width); on CUDA its host buffers are pinned."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        *,
        block_size: int,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.groups = list(groups)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        device = torch.device(device)
        shape = (max_num_reqs, max_num_tokens, self.max_blocks)
        self.host = DecodeBuffers.allocate(*shape, pin_memory=device.type == "cuda")
        self.dev = DecodeBuffers.allocate(*shape, device=device)
        self._empty = InputBatch(1, max_model_len, block_size)  # for dummy-only batches
        # the persistent expanded tables of groups with a smaller kernel block
        self.kernel_tables: dict[int, torch.Tensor] = {
            index: torch.zeros(
                max_num_reqs,
                self.max_blocks * (block_size // group.kernel_block_size),
                dtype=torch.int32,
                device=device,
            )
            for index, group in enumerate(self.groups)
            if group.kernel_block_size != block_size
        }

    def prepare(
        self,
        batch: InputBatch | None,
        slots: np.ndarray,
        query_len: int,
        num_padded_reqs: int,
        *,
        max_seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
        """Fill the buffers for a padded decode batch (`batch` None: dummies only) and copy them
        to the device; returns `(input_ids, positions, common)`, all views of the buffers.
        `max_seq_len` defaults to the longest real sequence (capture passes max_model_len)."""
        num_reqs, num_tokens = num_padded_reqs, num_padded_reqs * query_len
        batch = batch or self._empty
        longest = fill_decode_inputs(self.host, batch, slots, query_len, num_reqs)
        host, dev = self.host, self.dev
        for name, length in (
            ("input_ids", num_tokens),
            ("positions", num_tokens),
            ("slot_mapping", num_tokens),
            ("query_start_loc", num_reqs + 1),
            ("seq_lens", num_reqs),
            ("block_table", num_reqs),
        ):
            getattr(dev, name)[:length].copy_(getattr(host, name)[:length], non_blocking=True)
        for index, table in self.kernel_tables.items():
            kernel_block_size = self.groups[index].kernel_block_size
            expanded = expand_block_table(
                dev.block_table[:num_reqs], self.block_size, kernel_block_size
            )
            table[:num_reqs].copy_(expanded)
        common = CommonAttentionMetadata(
            query_start_loc=dev.query_start_loc[: num_reqs + 1],
            query_start_loc_cpu=host.query_start_loc[: num_reqs + 1],
            seq_lens=dev.seq_lens[:num_reqs],
            seq_lens_cpu=host.seq_lens[:num_reqs],
            num_computed_tokens_cpu=host.num_computed_tokens[:num_reqs],
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=query_len,
            max_seq_len=longest if max_seq_len is None else max_seq_len,
            block_table_tensor=dev.block_table[:num_reqs],
            slot_mapping=dev.slot_mapping[:num_tokens],
            block_table_cpu=host.block_table[:num_reqs],
            slot_mapping_cpu=host.slot_mapping[:num_tokens],
        )
        return dev.input_ids[:num_tokens], dev.positions[:num_tokens], common

    def build(self, common: CommonAttentionMetadata, *, for_capture: bool) -> dict[str, object]:
        """Layer name -> metadata: `build_for_cudagraph_capture` or `build(0, ...)` per group."""
        metadata: dict[str, object] = {}
        for index, group in enumerate(self.groups):
            table = self.kernel_tables.get(index)
            table = None if table is None else table[: common.num_reqs]
            group_common = in_kernel_blocks(group, common, self.block_size, table)
            if for_capture:
                built = group.builder.build_for_cudagraph_capture(group_common)
            else:
                built = group.builder.build(0, group_common)
            metadata.update(dict.fromkeys(group.layer_names, built))
        return metadata
