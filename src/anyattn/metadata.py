"""The per-step batch description every builder reads, and helpers around it.

`CommonAttentionMetadata` carries device tensors with CPU mirrors, so that builders and checks
never synchronise with the device; it checks its mirrors once, when made (docs/design.md,
"Validation"). The helpers split a batch into decodes and prefills and reorder it decodes
first. Slot mappings and block-table expansion are `anyattn.slots`'s (re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from anyattn.slots import compute_slot_mapping, expand_block_table

__all__ = [
    "CommonAttentionMetadata",
    "HostBatch",
    "StepChecks",
    "apply_swaps",
    "compute_slot_mapping",
    "expand_block_table",
    "first_rows",
    "make_common_attn_metadata",
    "reorder_batch_to_split_decodes_and_prefills",
    "split_decodes_and_prefills",
]


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """One step's batch, shared by every backend's builder. Read-only once made.

    Requests are laid out back to back in the flat token dimension. Tensors may be padded past
    `num_reqs` / `num_actual_tokens` (CUDA graphs); only the real part is meaningful. The CPU
    mirrors must hold the device tensors' values: every check reads the mirrors, never the
    device. Making one checks the mirrors; `anyattn.validation` checks the slots and block ids
    against a cache at the first layer call with that cache.

    Attributes:
        query_start_loc, query_start_loc_cpu: int32 `[num_reqs + 1]` (device, CPU): offsets
            of each request's new tokens.
        seq_lens, seq_lens_cpu: int32 `[num_reqs]`: context + new tokens per request.
        num_computed_tokens_cpu: int32 `[num_reqs]` (CPU): context before this step.
        num_reqs, num_actual_tokens: real requests and tokens (output rows past the real
            tokens are left untouched).
        max_query_len, max_seq_len: longest query (new tokens) and sequence among them.
        block_table_tensor: int32 `[>= num_reqs, max_blocks]` (device): physical block ids in
            kernel-block units. Entries past a request's keys and rows past `num_reqs` are
            never read, nor checked (the engine leaves them 0: the null block, never allocated).
        slot_mapping: int64 `[num_tokens]` (device): cache slot of each new token's K/V (for
            cross attention: of the encoder tokens written this step), `block_id * block_size
            + offset`; -1 marks padding that is never written.
        causal: False for bidirectional attention.
        encoder_seq_lens, encoder_seq_lens_cpu: int32 `[num_reqs]` for cross-attention.
        block_table_cpu, slot_mapping_cpu: the CPU mirrors of `block_table_tensor` and
            `slot_mapping`; None when the tensor is on the CPU (its own mirror).
        host_batch: the checked mirrors (`HostBatch`); checks: what `anyattn.validation` has
            checked of this step since (`StepChecks`).

    Raises:
        ValueError: when made, for mirrors that are not CPU integer tensors of the expected
            shapes or contradict each other, or a slot below -1 or used twice.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    encoder_seq_lens: torch.Tensor | None = None
    encoder_seq_lens_cpu: torch.Tensor | None = None
    block_table_cpu: torch.Tensor | None = None
    slot_mapping_cpu: torch.Tensor | None = None
    host_batch: HostBatch = field(init=False, repr=False, compare=False)
    checks: StepChecks = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        api = "CommonAttentionMetadata"
        for name, tensor in (
            ("block_table", self.block_table_tensor),
            ("slot_mapping", self.slot_mapping),
        ):
            if getattr(self, f"{name}_cpu") is None:
                if not tensor.is_cpu:
                    raise ValueError(
                        f"{api}: {name}_cpu is required for a {name} on {tensor.device} (got "
                        f"None, expected its CPU mirror). Fill it from the same host values."
                    )
                object.__setattr__(self, f"{name}_cpu", tensor)  # a CPU tensor is its own mirror
        host = self._validate(api)
        self._check_table_and_slots(api)
        for array in (host.query_start_loc, host.query_lens, host.seq_lens, host.context_lens):
            array.flags.writeable = False  # shared by every builder of the step
        object.__setattr__(self, "host_batch", host)
        object.__setattr__(self, "checks", StepChecks())

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """int32 `[num_reqs]` (CPU): new tokens per request."""
        loc = self.query_start_loc_cpu[: self.num_reqs + 1]
        return loc[1:] - loc[:-1]

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    def _validate(self, api: str) -> HostBatch:
        """Check shapes, dtypes and the lengths' mirrors (CPU only: no device synchronisation);
        returns them as int64 numpy arrays (`HostBatch`), for builders' planning."""
        num_reqs = self.num_reqs
        for name, tensor, min_len in (
            ("query_start_loc_cpu", self.query_start_loc_cpu, num_reqs + 1),
            ("seq_lens_cpu", self.seq_lens_cpu, num_reqs),
            ("num_computed_tokens_cpu", self.num_computed_tokens_cpu, num_reqs),
        ):
            if not tensor.is_cpu:
                raise ValueError(f"{api}: {name} must be a CPU tensor (got {tensor.device}).")
            dtype = tensor.dtype
            if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
                raise ValueError(f"{api}: {name} must be an integer tensor (got {dtype}).")
            if tensor.ndim != 1 or tensor.shape[0] < min_len:
                raise ValueError(
                    f"{api}: {name} must be 1-D with at least {min_len} entries "
                    f"(got shape {tuple(tensor.shape)})."
                )
        table = self.block_table_tensor
        if table.ndim != 2 or table.shape[0] < num_reqs:
            raise ValueError(
                f"{api}: block_table_tensor must be [num_reqs, max_blocks] with num_reqs >= "
                f"{num_reqs} (got shape {tuple(table.shape)})."
            )
        if table.dtype != torch.int32:
            # (the kernels read it as int32: FlashAttention's page table, FlashInfer's indices)
            raise ValueError(f"{api}: block_table_tensor must be int32 (got {table.dtype}).")
        if self.slot_mapping.dtype != torch.int64:
            raise ValueError(f"{api}: slot_mapping must be int64 (got {self.slot_mapping.dtype}).")
        # int64 copies, so that no mirror dtype wraps around and the engine may refill the
        # mirrors for the next step.
        loc = self.query_start_loc_cpu.numpy()[: num_reqs + 1].astype(np.int64)
        query_lens = loc[1:] - loc[:-1]
        seq_lens = self.seq_lens_cpu.numpy()[:num_reqs].astype(np.int64)
        context = self.num_computed_tokens_cpu.numpy()[:num_reqs].astype(np.int64)
        if num_reqs and (loc[0] != 0 or query_lens.min() < 0):
            raise ValueError(f"{api}: query_start_loc must start at 0 and never decrease.")
        if loc[-1] != self.num_actual_tokens:
            raise ValueError(
                f"{api}: num_actual_tokens disagrees with query_start_loc (got "
                f"{self.num_actual_tokens}, expected {int(loc[-1])})."
            )
        if num_reqs and (seq_lens - query_lens).min() < 0:
            raise ValueError(f"{api}: a request has seq_len shorter than its query length.")
        if num_reqs and (context.min() < 0 or (context + query_lens != seq_lens).any()):
            raise ValueError(
                f"{api}: num_computed_tokens_cpu must equal seq_lens - query lens per request."
            )
        longest_query = int(query_lens.max()) if num_reqs else 0
        longest_seq = int(seq_lens.max()) if num_reqs else 0
        if self.max_query_len < longest_query or self.max_seq_len < longest_seq:
            raise ValueError(
                f"{api}: max_query_len / max_seq_len below the mirrors' longest (got "
                f"{self.max_query_len} / {self.max_seq_len}, expected >= {longest_query} / "
                f"{longest_seq})."
            )
        return HostBatch(loc, query_lens, seq_lens, context, longest_query, longest_seq)

    def _check_table_and_slots(self, api: str) -> None:
        """The block table's and slot mapping's mirrors: CPU, int32 / int64, their device
        tensors' shapes; every slot -1 or >= 0, no slot twice (range: `anyattn.validation`)."""
        pairs = (
            ("block_table_cpu", self.block_table_cpu, self.block_table_tensor, torch.int32),
            ("slot_mapping_cpu", self.slot_mapping_cpu, self.slot_mapping, torch.int64),
        )
        for name, mirror, tensor, dtype in pairs:
            if not mirror.is_cpu or mirror.dtype != dtype or mirror.shape != tensor.shape:
                raise ValueError(
                    f"{api}: {name} must mirror its device tensor on the CPU (got {mirror.device} "
                    f"{mirror.dtype} {tuple(mirror.shape)}, expected cpu {dtype} "
                    f"{tuple(tensor.shape)})."
                )
        slots = self.slot_mapping_cpu.numpy()
        if slots.ndim != 1:
            raise ValueError(f"{api}: slot_mapping must be 1-D (got shape {slots.shape}).")
        if slots.size and slots[slots.argmin()] < -1:
            entry = int(slots.argmin())
            raise ValueError(
                f"{api}: slot_mapping has a negative slot at entry {entry} (got {slots[entry]}, "
                "expected -1 for padding or a slot >= 0)."
            )
        real = np.sort(slots[slots >= 0])
        repeated = np.flatnonzero(real[1:] == real[:-1])
        if repeated.size:
            slot = int(real[repeated[0]])
            entries = np.flatnonzero(slots == slot)[:2].tolist()
            raise ValueError(
                f"{api}: slot_mapping gives slot {slot} to two tokens (got entries {entries[0]} "
                f"and {entries[1]}, expected distinct slots, -1 excepted). Check the block table "
                "the slots were computed from."
            )


@dataclass(slots=True)
class StepChecks:
    """What `anyattn.validation` has checked of one step since its metadata was made.

    Attributes:
        caches: `(num_blocks, block_size)` of every cache the step was checked against.
        call: the arguments of the layer call last checked in full (`check_layer_call`), by
            identity, until that call's `forward` takes it; else None.
        mla_call: `(impl, layer, kv_cache, attn_metadata)` of the `MLAAttention` call under
            way (`check_mla_layer_call`), whose entry points skip the checks made; else None.
    """

    caches: set[tuple[int, int]] = field(default_factory=set)
    call: tuple[object, ...] | None = None
    mla_call: tuple[object, ...] | None = None


@dataclass(slots=True)
class HostBatch:
    """A checked step's CPU mirrors (`CommonAttentionMetadata.host_batch`), real requests only,
    for builders to plan from: int64 read-only copies (the engine may refill the mirrors).

    Attributes:
        query_start_loc: `[num_reqs + 1]`.
        query_lens: `[num_reqs]`.
        seq_lens: `[num_reqs]`.
        context_lens: `[num_reqs]` (`num_computed_tokens_cpu`).
        max_query_len, max_seq_len: the longest of `query_lens` and of `seq_lens` (0 for an
            empty batch): the mirrors' own, where the metadata's fields are upper bounds.
    """

    query_start_loc: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    context_lens: np.ndarray
    max_query_len: int
    max_seq_len: int


def first_rows(tensor: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`tensor[:num_rows]`, or `tensor` itself when it has just that many rows."""
    return tensor if tensor.shape[0] == num_rows else tensor[:num_rows]


def make_common_attn_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_table: torch.Tensor,
    block_size: int,
    device: torch.device | str = "cpu",
    *,
    causal: bool = True,
    encoder_seq_lens: Sequence[int] | None = None,
    num_padded_tokens: int | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> CommonAttentionMetadata:
    """Build a `CommonAttentionMetadata` from per-request lengths (engine and test helper).

    Args:
        query_lens, seq_lens: new tokens, and context + new tokens, per request.
        block_table: int32 `[num_reqs, max_blocks]` physical ids of blocks of `block_size`
            tokens (any device); the device tensors live on `device`.
        encoder_seq_lens: encoder tokens per request for cross-attention.
        num_padded_tokens: pad the slot mapping with -1 up to this many tokens.
        slot_mapping: int64 CPU slots of the K/V the step writes when they are not its new
            tokens' (cross attention: the encoder tokens); default: from `block_table`.
    """
    if len(query_lens) != len(seq_lens):
        raise ValueError(
            f"make_common_attn_metadata: query_lens and seq_lens differ in length (got "
            f"{len(query_lens)} and {len(seq_lens)})."
        )
    device = torch.device(device)
    query_lens_t = torch.tensor(list(query_lens), dtype=torch.int32)
    seq_lens_cpu = torch.tensor(list(seq_lens), dtype=torch.int32)
    query_start_loc_cpu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(query_lens_t, 0, out=query_start_loc_cpu[1:])
    num_tokens = int(query_start_loc_cpu[-1])
    block_table_cpu = block_table.to("cpu", torch.int32)
    if slot_mapping is None:
        slot_mapping = compute_slot_mapping(
            block_table_cpu, query_start_loc_cpu, seq_lens_cpu, block_size, num_padded_tokens
        )
    enc_cpu = None
    if encoder_seq_lens is not None:
        enc_cpu = torch.tensor(list(encoder_seq_lens), dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc_cpu.to(device),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu=seq_lens_cpu,
        num_computed_tokens_cpu=seq_lens_cpu - query_lens_t,
        num_reqs=len(query_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_table_tensor=block_table_cpu.to(device),
        slot_mapping=slot_mapping.to(device),
        causal=causal,
        encoder_seq_lens=None if enc_cpu is None else enc_cpu.to(device),
        encoder_seq_lens_cpu=enc_cpu,
        block_table_cpu=block_table_cpu,
        slot_mapping_cpu=slot_mapping,
    )


def split_decodes_and_prefills(
    common_attn_metadata: CommonAttentionMetadata,
    decode_threshold: int = 1,
    require_uniform: bool = False,
) -> tuple[int, int, int, int]:
    """Split a decodes-first batch (CPU mirrors only) into its leading decodes, requests of
    query length <= `decode_threshold` (with `require_uniform`: also equal to the first's, for
    uniform-batch kernels), and the prefills after them.

    Returns:
        `(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`.
    """
    num_reqs = common_attn_metadata.num_reqs
    num_tokens = common_attn_metadata.num_actual_tokens
    if num_reqs == 0:
        return 0, 0, 0, 0
    query_lens = common_attn_metadata.query_lens_cpu
    if require_uniform:
        is_decode = (query_lens == query_lens[0]) & (query_lens <= decode_threshold)
    else:
        is_decode = query_lens <= decode_threshold
    # The first non-decode request ends the decode run.
    not_decode = (~is_decode).nonzero()
    num_decodes = num_reqs if not_decode.numel() == 0 else int(not_decode[0, 0])
    num_decode_tokens = int(common_attn_metadata.query_start_loc_cpu[num_decodes])
    return num_decodes, num_reqs - num_decodes, num_decode_tokens, num_tokens - num_decode_tokens


def reorder_batch_to_split_decodes_and_prefills(
    query_lens: Sequence[int], decode_threshold: int = 1
) -> list[tuple[int, int]]:
    """The fewest swaps `[(i, j), ...]` (for `apply_swaps`, in order) that move every decode
    (query length <= threshold) before the prefills: each trades the leftmost misplaced
    prefill for the rightmost misplaced decode, fixing two positions."""
    lens = list(query_lens)
    is_decode = [n <= decode_threshold for n in lens]
    swaps: list[tuple[int, int]] = []
    left, right = 0, len(lens) - 1
    while True:
        while left < right and is_decode[left]:
            left += 1
        while left < right and not is_decode[right]:
            right -= 1
        if left >= right:
            return swaps
        swaps.append((left, right))
        is_decode[left], is_decode[right] = True, False
        left += 1
        right -= 1


def apply_swaps(items: list, swaps: Sequence[tuple[int, int]]) -> list:
    """Apply `reorder_batch_to_split_decodes_and_prefills` swaps to a list, in place."""
    for i, j in swaps:
        items[i], items[j] = items[j], items[i]
    return items
