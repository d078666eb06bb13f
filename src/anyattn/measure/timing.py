"""Time one backend on one step: its first call (compilation, autotuning, plan caches) apart
from its steady state, the builder's host time beside it (docs/measured_selection.md, "Timing").
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from anyattn.backend import AttentionBackend
from anyattn.measure.inputs import PreparedStep
from anyattn.measure.steps import MeasureStep

__all__ = ["StepTiming", "Timer", "time_prepared"]

# Device clock cycles per microsecond for the hold kernel (about 2 GHz on recent data-centre
# GPUs; a slower clock only lengthens the hold, which costs idle time, not accuracy).
_CYCLES_PER_US = 2_000
_MAX_HOLD_US = 200_000


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One backend on one step.

    Attributes:
        step: the step's name.
        times_us: steady-state microseconds of each timed call (write + forward).
        first_call_us: the first build + call, compilation and autotuning included.
        build_us: median host microseconds of the builder's `build` for the step.
    """

    step: str
    times_us: tuple[float, ...]
    first_call_us: float
    build_us: float

    def __post_init__(self) -> None:
        if not self.times_us:
            raise ValueError(f"StepTiming({self.step!r}): times_us is empty (expected >= 1).")

    @property
    def median_us(self) -> float:
        return statistics.median(self.times_us)

    @property
    def spread_us(self) -> float:
        """The median absolute deviation of `times_us` from their median: the run's noise,
        robust to the odd call that the OS or another process delays."""
        middle = self.median_us
        return statistics.median(abs(t - middle) for t in self.times_us)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict[str, object]) -> StepTiming:
        first, build = (float(data[k]) for k in ("first_call_us", "build_us"))  # type: ignore[arg-type]
        return StepTiming(str(data["step"]), tuple(map(float, data["times_us"])), first, build)  # type: ignore[call-overload]


Timer = Callable[[type[AttentionBackend], MeasureStep], StepTiming]
"""`timer(backend, step) -> StepTiming`: how a measured selection times a backend on a step
(injectable, so that the policy can be tested with chosen timings)."""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_times_us(
    call: Callable[[], object], reps: int, host_us: float, device: torch.device
) -> list[float]:
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e6)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    _synchronize(device)
    # Hold the device while the host queues every timed call (1.5x margin, capped: a call that
    # synchronises inside would otherwise ask for a very long hold).
    hold_us = min(1.5 * host_us * reps + 1_000, _MAX_HOLD_US)
    torch.cuda._sleep(int(hold_us * _CYCLES_PER_US))
    for i in range(reps):
        starts[i].record()
        call()
        ends[i].record()
    _synchronize(device)
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]


def time_prepared(
    prepared: PreparedStep, name: str, device: torch.device, *, budget_s: float = 0.2,
    min_reps: int = 5, max_reps: int = 50,
) -> StepTiming:  # fmt: skip
    """Time a prepared step: the first build + call alone (`first_call_us`), two more calls to
    warm up, then as many calls as fit in `budget_s` (within `[min_reps, max_reps]`)."""
    start = time.perf_counter()
    metadata = prepared.build()
    prepared.run(metadata)
    _synchronize(device)
    first_call_us = (time.perf_counter() - start) * 1e6
    for _ in range(2):
        prepared.run(metadata)
    _synchronize(device)
    start = time.perf_counter()
    prepared.run(metadata)
    _synchronize(device)
    one_us = max((time.perf_counter() - start) * 1e6, 1.0)
    reps = int(min(max(budget_s * 1e6 / one_us, min_reps), max_reps))
    builds = []
    for _ in range(min(reps, 10)):
        begin = time.perf_counter()
        metadata = prepared.build()
        builds.append((time.perf_counter() - begin) * 1e6)
    _synchronize(device)
    times = _device_times_us(lambda: prepared.run(metadata), reps, one_us, device)
    return StepTiming(name, tuple(times), first_call_us, statistics.median(builds))
