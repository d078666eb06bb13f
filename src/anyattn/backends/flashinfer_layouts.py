"""Where FLASHINFER's decode layouts are made: device memory the builder keeps, so that a step's
layout costs one kernel launch and nothing else.

The decode wrapper's kernel reads a batch of single-token decodes as page offsets, last-page
lengths and a flat page list (`DecodeLayout`), which `ops.paged_kv_layout` makes on the device
from the step's `seq_lens` and block table. Allocating them and cutting them into three tensors
would cost the host more than the launch (a CUDA allocation and three views, microseconds each),
so every layout is made into memory `DecodeLayouts` keeps, its views and device addresses made
once:

- a CUDA-graph step into the fixed index buffers of its captured size, which every layer
  signature's graph decode wrapper of that size reads;
- an eager step into one of `RING` buffers, taken in turn, each with its views per batch size
  (grown, never shrunk, when a batch needs more pages than it holds).

A layout is current while its memory holds it: the next step made into the same buffers (the
next build of a captured size; the build `RING` eager steps later) makes it stale, and the
builder then makes it again for a forward on the older metadata (`is_current`; an eager one
into memory of its own). Each write is a launch on the current stream, after every forward
launched before it: a step whose forward was launched before a later build reused its memory
has read its own layout. (Builds and forwards share one stream, as everywhere in FLASHINFER.)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from anyattn.ops.paged_kv_layout import PagedKvLayoutLaunch

__all__ = ["RING", "DecodeLayout", "DecodeLayouts"]

# Eager layouts kept at once: a build may run this many steps ahead of the forwards of an older
# step before that step's layout is made again.
RING = 4


@dataclass(slots=True)  # (not frozen: a frozen dataclass costs a build four times as much)
class DecodeLayout:
    """A step's single-token decodes as the decode wrapper's kernel reads them, on the device.

    Attributes:
        indptr: int32 `[B + 1]` page offsets (B: the decodes, or the CUDA-graph size they are
            padded to).
        last_page_len: int32 `[B]` tokens in each request's last page.
        indices: int32 `[>= indptr[-1]]` the pages, request by request.
        max_seq_len: the longest decode's tokens (from the CPU mirrors).
        home: which of `DecodeLayouts`' memory holds it (None: memory of its own).
        generation: the build that made it.
        num_reqs: B (None: taken from `indptr`).
    """

    indptr: torch.Tensor
    last_page_len: torch.Tensor
    indices: torch.Tensor
    max_seq_len: int
    home: Hashable | None = None
    generation: int = 0
    num_reqs: int | None = None

    def __post_init__(self) -> None:
        if self.num_reqs is None:
            self.num_reqs = self.indptr.shape[0] - 1


@dataclass(slots=True)
class _Memory:
    """One home: int32 offsets `[R + 1]`, last-page lengths `[R]` and pages `[capacity]` in
    one allocation, and per batch size its layout's views and device addresses."""

    max_reqs: int
    capacity: int
    buffer: torch.Tensor
    views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int, int]]] = field(
        default_factory=dict
    )

    @classmethod
    def make(cls, max_reqs: int, capacity: int, device: torch.device) -> _Memory:
        # (zeros and ones: what FlashInfer's planner and kernel may read of a graph buffer
        # before the first layout is made into it)
        buffer = torch.zeros(2 * max_reqs + 1 + capacity, dtype=torch.int32, device=device)
        buffer[max_reqs + 1 : 2 * max_reqs + 1] = 1
        return cls(max_reqs, capacity, buffer)

    def of(self, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """(indptr `[num_reqs + 1]`, last-page lengths `[num_reqs]`, pages, their addresses)."""
        views = self.views.get(num_reqs)
        if views is None:
            r = self.max_reqs
            indptr = self.buffer[: num_reqs + 1]
            last = self.buffer[r + 1 : r + 1 + num_reqs]
            pages = self.buffer[2 * r + 1 :]
            addresses = (indptr.data_ptr(), last.data_ptr(), pages.data_ptr())
            views = self.views[num_reqs] = (indptr, last, pages, addresses)
        return views


class DecodeLayouts:
    """Makes a builder's decode layouts (see the module docstring).

    Args:
        device: the builder's device.
        block_size: tokens per page.
        max_num_reqs: the most requests of a CUDA-graph step (`BatchLimits.max_num_reqs`);
            eager batches may be larger.
        max_pages_per_request: pages of a request of `max_model_len` tokens (what a graph
            buffer holds per request).
    """

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_num_reqs: int,
        max_pages_per_request: int,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_pages_per_request = max_pages_per_request
        self._device_index = device.index if device.type == "cuda" else -1
        if device.type == "cuda" and self._device_index is None:
            self._device_index = torch.cuda.current_device()
        self._launch = PagedKvLayoutLaunch(block_size, max_num_reqs)
        self._graphs: dict[int, _Memory] = {}
        self._ring: list[_Memory | None] = [None] * RING
        self._next = 0
        self._held: dict[Hashable, int] = {}  # home -> generation of the layout it holds

    def graph_buffers(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fixed index buffers of CUDA-graph size `size` (int32 indptr `[size + 1]`,
        last-page lengths `[size]`, pages `[size * max_pages_per_request]`), made on first
        use: what its decode wrappers are built over and its steps' layouts are made into."""
        return self._graph_memory(size).of(size)[:3]

    def _graph_memory(self, size: int) -> _Memory:
        memory = self._graphs.get(size)
        if memory is None:
            memory = _Memory.make(size, size * self.max_pages_per_request, self.device)
            self._graphs[size] = memory
        return memory

    def make(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        num_decodes: int,
        max_seq_len: int,
        generation: int,
        cudagraph_size: int | None = None,
        own_memory: bool = False,
    ) -> DecodeLayout:
        """The layout of a step's `num_decodes` leading decodes (padded to `cudagraph_size`),
        made by the build of `generation` into that size's graph buffers, the next eager ring
        buffer, or (`own_memory`) a new allocation.

        Args:
            block_table: int32 `[>= num_decodes, max_blocks]`, on the builder's device (checked
                by the caller, with its width).
            seq_lens: int32 `[>= num_decodes]`, on the builder's device (checked here).
            max_seq_len: the longest decode's tokens, from the CPU mirrors (its pages bound
                every request's: the device's `seq_lens` cannot make the kernel write past
                them).

        Raises:
            ValueError: `seq_lens` of another dtype, rank, size or device; a CUDA-graph step
                with more pages per request than its buffers hold.
        """
        api = "FlashInferMetadataBuilder.build"
        if (
            seq_lens.dtype != torch.int32
            or seq_lens.dim() != 1
            or seq_lens.shape[0] < num_decodes
            or seq_lens.get_device() != self._device_index
            or block_table.get_device() != self._device_index
        ):
            raise ValueError(
                f"{api}: seq_lens must be int32 [num_reqs], on the builder's device as the block "
                f"table (got {seq_lens.dtype} of shape {tuple(seq_lens.shape)} on "
                f"{seq_lens.device}, the table on {block_table.device}, expected {self.device})."
            )
        most = -(-max_seq_len // self.block_size)
        if cudagraph_size is not None:
            if most > self.max_pages_per_request:
                raise ValueError(
                    f"{api}: a CUDA-graph decode step needs more pages per request than "
                    f"max_model_len allows (got {most}, expected <= "
                    f"{self.max_pages_per_request}). Keep seq_lens within "
                    "BatchLimits.max_model_len."
                )
            home: Hashable | None = cudagraph_size
            memory = self._graph_memory(cudagraph_size)
            rows = cudagraph_size
        elif own_memory:
            home = None
            memory = _Memory.make(num_decodes, num_decodes * most, self.device)
            rows = num_decodes
        else:
            slot = self._next
            self._next = (slot + 1) % RING
            home, rows = ("eager", slot), num_decodes
            memory = self._ring[slot]
            if memory is None or rows > memory.max_reqs or rows * most > memory.capacity:
                # (grown to twice what is asked for: a decode batch's pages grow step by step)
                grown = 2 * max(rows * most, memory.capacity if memory is not None else 0)
                memory = _Memory.make(max(rows, self.max_num_reqs), grown, self.device)
                self._ring[slot] = memory
        indptr, last, pages, addresses = memory.of(rows)
        self._launch(block_table, seq_lens, indptr, last, pages, num_decodes, most, addresses, rows)
        if home is not None:
            self._held[home] = generation
        return DecodeLayout(indptr, last, pages, max_seq_len, home, generation, rows)

    def is_current(self, layout: DecodeLayout) -> bool:
        """Whether `layout`'s memory still holds it (no later step has been made into it)."""
        return layout.home is None or self._held.get(layout.home) == layout.generation
