"""Page-locked buffers for FlashInfer's planners that stay safe when builds run ahead of the GPU.

Every FlashInfer `plan()` (and `replan_decode`) writes the schedule it computes into the
wrapper's page-locked host buffer, then enqueues one asynchronous copy of that buffer to the
device on the current stream of the wrapper's device, and returns without waiting for it. A copy
enqueued behind other work runs when the stream reaches it. An engine that builds step N+1 while
the device has not yet reached step N's copy (asynchronous scheduling: the host runs a step
ahead) has the next plan rewrite the buffer before that copy has read it, and step N's kernels
then run on step N+1's schedule with step N's plan: wrong outputs, or reads past a request's
pages. (The same hazard was reported against FlashInfer's users, e.g. mini-sglang pull request
103; FlashInfer 0.7.2's scheduler issues the copy and never synchronises. On an H200 a build
made behind a stalled stream gave a wrong output with FlashInfer's one buffer per wrapper and
the right one with this pool: tests/backends/test_flashinfer_staging.py, benchmarks/RESULTS.md.)

`PlannerStaging` hands each plan a buffer whose last copy the device has finished (a CUDA
event query, which never waits) and records an event after the plan, so the buffer goes back to
the pool once the copy that reads it has run. A synchronous engine loop reuses the buffers the
wrappers were made with; an engine k steps ahead holds about k times as many (8 MiB each, the
size of FlashInfer's integer workspace), up to `MAX_BUFFERS` of a size: past that a plan waits
for the oldest copy instead of pinning more memory (a host that many plans ahead is not
overlapping work any more, it is queueing it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MAX_BUFFERS", "PlannerStaging"]

# Page-locked buffers of one size the pool makes at most (16 x 8 MiB = 128 MiB).
MAX_BUFFERS = 16


class PlannerStaging:
    """A pool of page-locked planner buffers (uint8 `[int-workspace bytes]`, the size of each
    wrapper's `_int_workspace_buffer`), each reused only after the device has run the copy its
    last plan enqueued.

    Use: `adopt(wrapper)` once when a wrapper is made (its own buffer joins the pool); around
    every `plan()` of it, `acquire(wrapper)` before and `release(wrapper)` after. Between
    plans a wrapper holds no buffer (its attribute is None), so a plan made without `acquire`
    fails instead of rewriting a buffer another wrapper's copy may still read.

    Args:
        event_factory: makes the events recorded after each plan (`torch.cuda.Event`); None on
            a device without asynchronous copies (the CPU), where the pool does nothing.
        plan_stream: the stream FlashInfer enqueues a plan's copy on: the current stream of
            the wrappers' device (`torch.cuda.current_stream(device)`, which is not the
            current device's when another device is current).
        pin_memory: whether buffers the pool adds are page-locked.
        max_buffers: buffers of one size, adopted ones included, before a plan waits.
    """

    def __init__(
        self,
        event_factory: Callable[[], Any] | None,
        plan_stream: Callable[[], Any] = lambda: None,
        pin_memory: bool = True,
        max_buffers: int = MAX_BUFFERS,
    ) -> None:
        self._event_factory = event_factory
        self._plan_stream = plan_stream
        self._pin_memory = pin_memory
        self._max_buffers = max_buffers
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}  # bytes -> (buffer, event)
        self._busy: deque[tuple[torch.Tensor, Any]] = deque()  # in the order they were recorded
        self._held: dict[int, tuple[torch.Tensor, Any]] = {}  # id(wrapper) -> its plan's buffer
        self._count: dict[int, int] = {}  # bytes -> buffers of that size
        self.buffers_made = 0  # buffers added beyond the adopted ones (for tests)
        self.waits = 0  # plans that waited for a copy, the pool being full (for tests)

    @property
    def is_enabled(self) -> bool:
        return self._event_factory is not None

    def adopt(self, wrapper: Any) -> None:
        """Put `wrapper`'s own page-locked buffer, not yet used by any plan, into the pool."""
        if self.is_enabled:
            buffer = wrapper._pin_memory_int_workspace_buffer
            self._free.setdefault(buffer.numel(), []).append((buffer, self._event_factory()))
            self._count[buffer.numel()] = self._count.get(buffer.numel(), 0) + 1
            wrapper._pin_memory_int_workspace_buffer = None

    def acquire(self, wrapper: Any) -> None:
        """Give `wrapper` (`_pin_memory_int_workspace_buffer`) a buffer whose last copy has run,
        for the plan about to be made: a free one, else a new one, else (`max_buffers` made)
        the oldest in flight once its copy has run (the only case that waits)."""
        if not self.is_enabled:
            return
        busy = self._busy
        while busy and busy[0][1].query():  # events of one stream complete in order
            buffer, event = busy.popleft()
            self._free.setdefault(buffer.numel(), []).append((buffer, event))
        nbytes = wrapper._int_workspace_buffer.numel()
        free = self._free.get(nbytes)
        if free:
            entry = free.pop()
        elif self._count.get(nbytes, 0) < self._max_buffers:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin_memory)
            entry = (buffer, self._event_factory())
            self._count[nbytes] = self._count.get(nbytes, 0) + 1
            self.buffers_made += 1
        else:
            entry = next(e for e in busy if e[0].numel() == nbytes)
            busy.remove(entry)
            entry[1].synchronize()
            self.waits += 1
        self._held[id(wrapper)] = entry
        wrapper._pin_memory_int_workspace_buffer = entry[0]

    def release(self, wrapper: Any) -> None:
        """Take back the buffer `acquire` gave `wrapper`, busy until the copy its plan
        enqueued has run."""
        entry = self._held.pop(id(wrapper), None)
        if entry is not None:
            entry[1].record(self._plan_stream())
            self._busy.append(entry)
            wrapper._pin_memory_int_workspace_buffer = None
