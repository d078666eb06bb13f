"""The per-step batch description every builder reads, and helpers around it.

`CommonAttentionMetadata` carries device tensors together with CPU mirrors so that builders
and the checks never synchronise with the device; it checks its mirrors once, when it is made
(docs/design.md, "Validation"). The helpers split a batch into decodes and prefills, reorder
a batch so decodes come first (fewest swaps), compute slot mappings from block tables, and
expand block tables when the kernel block size is smaller than the engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

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
    mirrors must hold the device tensors' values (the engine fills both from one source): every
    check reads the mirrors, never the device. Making one checks the mirrors (`host_batch` holds
    the result); the slots and block ids are checked against a cache's size by
    `anyattn.validation` at the first layer call with that cache.

    Attributes:
        query_start_loc: int32 `[num_reqs + 1]` (device): offsets of each request's new tokens.
        query_start_loc_cpu: the same, on the CPU.
        seq_lens: int32 `[num_reqs]` (device): context + new tokens per request.
        seq_lens_cpu: the same, on the CPU.
        num_computed_tokens_cpu: int32 `[num_reqs]` (CPU): context before this step.
        num_reqs: real requests.
        num_actual_tokens: real tokens; output rows past it are left untouched.
        max_query_len: longest query (new tokens) among the real requests.
        max_seq_len: longest sequence among the real requests.
        block_table_tensor: int32 `[>= num_reqs, max_blocks]` (device): physical block ids in
            kernel-block units. Entries past a request's keys and rows past `num_reqs` are
            never read, nor checked (the engine leaves them 0: the null block, never allocated).
        slot_mapping: int64 `[num_tokens]` (device): cache slot of each new token's K/V (for
            cross attention: of the encoder tokens written this step), `block_id * block_size
            + offset`; -1 marks padding that is never written.
        causal: False for bidirectional attention.
        encoder_seq_lens: int32 `[num_reqs]` (device) for cross-attention, else None.
        encoder_seq_lens_cpu: the same, on the CPU.
        block_table_cpu: `block_table_tensor` on the CPU (int32, same shape); may be left None
            when `block_table_tensor` is a CPU tensor (it is then its own mirror).
        slot_mapping_cpu: `slot_mapping` on the CPU (int64, same shape); likewise.
        host_batch: the checked mirrors (`HostBatch`), made with the metadata.
        checks: what `anyattn.validation` has checked of this step since (`StepChecks`).

    Raises:
        ValueError: when made, for mirrors that are not CPU integer tensors of the expected
            shapes, or whose values contradict each other, or a slot below -1 or used twice.
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
        """Check shapes, dtypes and the lengths' mirrors (CPU tensors only: no device
        synchronisation); returns them as numpy arrays (`HostBatch`), for builders' planning."""
        num_reqs = self.num_reqs
        # The checks run on numpy views of the CPU mirrors, in as few calls as they allow: this
        # runs in every build, where a torch op or attribute on a small CPU tensor costs a
        # microsecond or a fraction of one and its numpy twin a tenth of that.
        try:
            loc = self.query_start_loc_cpu.numpy()
            seq_lens = self.seq_lens_cpu.numpy()
            context = self.num_computed_tokens_cpu.numpy()
        except TypeError as error:  # (what `numpy()` raises for a device or bfloat16 tensor)
            for name, tensor, _ in self._mirrors():
                if not tensor.is_cpu:
                    raise ValueError(
                        f"{api}: {name} must be a CPU tensor (got {tensor.device})."
                    ) from None
            self._refuse_non_integer_mirrors(api)
            raise error
        # (numpy kinds "i" and "u": signed and unsigned integers, taken in int64 below; the
        # tuple test first, the usual case, makes no set)
        kinds = (loc.dtype.kind, seq_lens.dtype.kind, context.dtype.kind)
        if kinds != ("i", "i", "i") and not set(kinds) <= {"i", "u"}:
            self._refuse_non_integer_mirrors(api)
        if (
            loc.ndim != 1
            or loc.shape[0] <= num_reqs
            or seq_lens.ndim != 1
            or seq_lens.shape[0] < num_reqs
            or context.ndim != 1
            or context.shape[0] < num_reqs
        ):
            for name, tensor, min_len in self._mirrors():
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
        # Values are taken in int64 so that no mirror dtype wraps around (`loc` and `context`
        # are int64, so every sum with them is).
        loc = loc[: num_reqs + 1].astype(np.int64)
        query_lens = loc[1:] - loc[:-1]
        seq_lens = seq_lens[:num_reqs]
        context = context[:num_reqs].astype(np.int64)
        # context + query lens is what seq_lens must hold: compared with the mirror, it is the
        # int64 copy of it the builders get, at no extra numpy call.
        expected = context + query_lens
        # One test for every rule on the values (offsets from 0 that never decrease, context
        # not negative, seq_lens = context + query lens, num_actual_tokens the offsets' last);
        # which one failed is worked out only on the way to the error.
        if num_reqs:
            lows = np.minimum(query_lens, context)
            if (
                loc[0] != 0
                or lows[lows.argmin()] < 0
                or np.count_nonzero(expected != seq_lens)
                or loc[-1] != self.num_actual_tokens
            ):
                self._refuse_values(api, loc, query_lens, seq_lens, context)
            longest_query = int(query_lens[query_lens.argmax()])
            longest_seq = int(expected[expected.argmax()])
            if self.max_query_len < longest_query or self.max_seq_len < longest_seq:
                raise ValueError(
                    f"{api}: max_query_len / max_seq_len below the mirrors' longest (got "
                    f"{self.max_query_len} / {self.max_seq_len}, expected >= {longest_query} / "
                    f"{longest_seq})."
                )
        else:
            if loc[-1] != self.num_actual_tokens:
                self._refuse_values(api, loc, query_lens, seq_lens, context)
            longest_query = longest_seq = 0
        return HostBatch(loc, query_lens, expected, context, longest_query, longest_seq)

    def _refuse_values(
        self,
        api: str,
        loc: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        context: np.ndarray,
    ) -> None:
        """Raises for the first rule on the mirrors' values that `validate` found broken (in
        int64: `loc` `[num_reqs + 1]`, the others `[num_reqs]`)."""
        if query_lens.size and (loc[0] != 0 or query_lens.min() < 0):
            raise ValueError(f"{api}: query_start_loc must start at 0 and never decrease.")
        num_tokens = int(loc[-1])
        if num_tokens != self.num_actual_tokens:
            raise ValueError(
                f"{api}: num_actual_tokens disagrees with query_start_loc (got "
                f"{self.num_actual_tokens}, expected {num_tokens})."
            )
        if (seq_lens - query_lens).min() < 0:
            raise ValueError(f"{api}: a request has seq_len shorter than its query length.")
        raise ValueError(
            f"{api}: num_computed_tokens_cpu must equal seq_lens - query lens per request."
        )

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

    def _mirrors(self) -> tuple[tuple[str, torch.Tensor, int], ...]:
        """(name, tensor, least length) of each 1-D CPU mirror, for `validate`'s errors."""
        return (
            ("query_start_loc_cpu", self.query_start_loc_cpu, self.num_reqs + 1),
            ("seq_lens_cpu", self.seq_lens_cpu, self.num_reqs),
            ("num_computed_tokens_cpu", self.num_computed_tokens_cpu, self.num_reqs),
        )

    def _refuse_non_integer_mirrors(self, api: str) -> None:
        """Raises for the first float, bool or complex mirror."""
        for name, tensor, _ in self._mirrors():
            dtype = tensor.dtype
            if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
                message = f"{api}: {name} must be an integer tensor (got {dtype})."
                raise ValueError(message) from None  # (not numpy's TypeError as its cause)


@dataclass(slots=True)
class StepChecks:
    """What `anyattn.validation` has checked of one step since its metadata was made: a
    record the library keeps on its own object, never on the caller's tensors.

    Attributes:
        caches: `(num_blocks, block_size)` of every cache the step's slots and block ids were
            checked against.
        call: the arguments of the layer call last checked in full (`check_layer_call`), by
            identity, until that call's `forward` takes it; else None.
    """

    caches: set[tuple[int, int]] = field(default_factory=set)
    call: tuple[object, ...] | None = None


@dataclass(slots=True)  # not frozen: a frozen dataclass is slower to make
class HostBatch:
    """A checked step's CPU mirrors as numpy arrays (`CommonAttentionMetadata.host_batch`),
    real requests only, so that a builder plans from them without converting again. Every
    array is a copy (no view of a mirror, which the engine may refill for the next step), all
    int64, read-only: every builder of the step shares them.

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
    """`tensor[:num_rows]`, or `tensor` itself when it has just that many rows: builders take
    a step's leading rows every step, and a slice costs the host about a microsecond."""
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
        query_lens: new tokens per request.
        seq_lens: context + new tokens per request (>= query_lens).
        block_table: int32 `[num_reqs, max_blocks]` physical block ids (any device).
        block_size: tokens per (kernel) block.
        device: where the device tensors live.
        causal: False for bidirectional attention.
        encoder_seq_lens: encoder tokens per request for cross-attention.
        num_padded_tokens: pad the slot mapping with -1 up to this many tokens.
        slot_mapping: int64 CPU slots of the K/V the step writes, when they are not its new
            tokens' (cross attention: the encoder tokens of first-step requests); default:
            the new tokens' slots, from `block_table`.
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
    enc_cpu = (
        None
        if encoder_seq_lens is None
        else torch.tensor(list(encoder_seq_lens), dtype=torch.int32)
    )
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
    """Split a decodes-first batch into its leading decodes and the prefills after them.

    A request is a decode when its query length is at most `decode_threshold`. The batch must
    already be reordered (decodes first); reads only the CPU mirrors.

    Args:
        require_uniform: count as decodes only the leading requests whose query length equals
            the first request's (uniform-batch kernels).

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
    """The fewest swaps that move every decode (query length <= threshold) before the prefills.

    Each swap trades the leftmost misplaced prefill for the rightmost misplaced decode, so every
    swap fixes two positions and no request is moved that is already in its part.

    Returns:
        `[(i, j), ...]`: swap requests i and j, in order (see `apply_swaps`).
    """
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
        block_table: int32 `[num_reqs, max_blocks]`.
        query_start_loc: int32 `[num_reqs + 1]`, on the same device as block_table.
        seq_lens: int32 `[num_reqs]`, context + new tokens.
        block_size: tokens per block of `block_table`.
        num_tokens: length of the result (>= the real tokens); defaults to the real tokens.

    Returns:
        int64 `[num_tokens]`.

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
    """Split each engine block into `block_size // kernel_block_size` kernel blocks.

    Engine block b becomes kernel blocks `b*k ... b*k + k - 1` (k = block_size / kernel size);
    the cache tensor is viewed with the smaller block size. Unused entries (the null block 0)
    become kernel blocks 0 ... k - 1, which belong to the null block too.

    Args:
        block_table: int32 `[num_reqs, max_blocks]`.

    Returns:
        int32 `[num_reqs, max_blocks * k]`.
    """
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
