"""Timing and table helpers for `benchmarks/kernels.py`.

GPU calls are timed one by one with CUDA events, back to back with no synchronisation in
between. Before the timed calls are queued, a sleep kernel holds the device for longer than the
host needs to queue them all, so each event pair brackets the call's device work alone (kernels
and the gaps between them), never the host's Python: GPU time, as under CUDA graphs. Host cost
is measured apart (`cpu_times_us`). A call that synchronises inside drains the queue and then
shows its host time too. On the CPU (tests) `time.perf_counter` stands in for the events.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "cpu_times_us",
    "gpu_times_us",
    "interleaved_us",
    "markdown_table",
    "median_us",
    "synchronize",
]


# Device clock cycles per microsecond for the sleep kernel (about 2 GHz on an H100/H200; a
# slower clock only makes the hold longer, which costs idle time, not accuracy).
_CYCLES_PER_US = 2_000
_MAX_HOLD_US = 200_000


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_times_us(
    run: Callable[[int], object],
    num_slots: int,
    warmup: int,
    reps: int,
    device: torch.device,
) -> list[float]:
    """Microseconds of each of `reps` calls `run(slot)`, slots cycling over `num_slots` input
    sets (so that consecutive calls read different memory), after `warmup` untimed calls."""
    for i in range(warmup):
        run(i % num_slots)
    synchronize(device)
    if device.type != "cuda":
        times = []
        for i in range(reps):
            start = time.perf_counter()
            run(i % num_slots)
            times.append((time.perf_counter() - start) * 1e6)
        return times
    start = time.perf_counter()
    run(0)
    host_us = (time.perf_counter() - start) * 1e6
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    synchronize(device)
    # Hold the device while the host queues every timed call (1.5x margin, capped: a call that
    # blocks the host, e.g. by synchronising, would otherwise ask for a very long sleep).
    hold_us = min(1.5 * host_us * reps + 1_000, _MAX_HOLD_US)
    torch.cuda._sleep(int(hold_us * _CYCLES_PER_US))
    for i in range(reps):
        starts[i].record()
        run(i % num_slots)
        ends[i].record()
    synchronize(device)
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]


def median_us(
    run: Callable[[int], object],
    num_slots: int,
    warmup: int,
    reps: int,
    device: torch.device,
) -> float:
    """The median of `gpu_times_us`."""
    return statistics.median(gpu_times_us(run, num_slots, warmup, reps, device))


def interleaved_us(
    run_a: Callable[[int], object],
    run_b: Callable[[int], object],
    num_slots: int,
    rounds: int,
    reps: int,
    device: torch.device,
) -> tuple[float, float]:
    """Median microseconds of A and B timed in alternating rounds of `reps` calls each, so that
    both see the same clocks and neighbours on a shared machine (a 3% target needs that)."""
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(rounds):
        times_a += gpu_times_us(run_a, num_slots, 2, reps, device)
        times_b += gpu_times_us(run_b, num_slots, 2, reps, device)
    return statistics.median(times_a), statistics.median(times_b)


def cpu_times_us(fn: Callable[[], object], reps: int) -> list[float]:
    """Host microseconds of each of `reps` calls of `fn` (the device is not waited for)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def _cell(value: object) -> str:
    # A "|" would split the markdown cell; newlines would end the row.
    return str(value).replace("|", "/").replace("\n", " ")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table (one line per row, no alignment padding)."""
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |"]
    lines.append("|" + "---|" * len(headers))
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
