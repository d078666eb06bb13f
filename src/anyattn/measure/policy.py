"""Choose a backend per phase from measured step times; no backend is named here.

A phase's backend minimises its summed step cost (`step_cost_us`); a backend within the
tolerance `max(2% of the fastest sum, spread(fastest) + spread(b))` of the fastest is tied with
it, and the static order decides among tied backends (docs/measured_selection.md, "The policy").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from anyattn.measure.steps import MeasureStep, Phase
from anyattn.measure.timing import StepTiming

__all__ = [
    "OVERALL", "RELATIVE_TOLERANCE", "PhaseChoice", "choose", "choose_phase", "step_cost_us",
    "within_tolerance",
]  # fmt: skip

OVERALL = "overall"
RELATIVE_TOLERANCE = 0.02


@dataclass(frozen=True, slots=True)
class PhaseChoice:
    """The verdict for one phase ("decode", "prefill", "mixed" or "overall"): the chosen
    `backend`, the `fastest` (lowest sum; another may be chosen within a tie), each timed
    backend's summed step cost `totals_us`, and the backends `tied` with the fastest within the
    tolerance, in static order."""

    phase: str
    backend: str
    fastest: str
    totals_us: Mapping[str, float]
    tied: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self) | {
            "totals_us": dict(self.totals_us),
            "tied": list(self.tied),
        }


def step_cost_us(timing: StepTiming, layers_per_step: int | None) -> float:
    """One layer call's cost on a step: its median time, plus its share of the step's `build`
    when `layers_per_step` layer calls share that build (None: the build is not counted)."""
    if layers_per_step is None:
        return timing.median_us
    return timing.median_us + timing.build_us / layers_per_step


def within_tolerance(total: float, best: float, spread: float) -> bool:
    """Whether `total` is tied with `best`: within 2% of it or within the two sums' measured
    spread (`spread`: both backends' spreads added)."""
    return total - best <= max(RELATIVE_TOLERANCE * best, spread)


def choose_phase(
    phase: str, step_names: Sequence[str], order: Sequence[str],
    timings: Mapping[str, Mapping[str, StepTiming]], layers_per_step: int | None = None,
) -> PhaseChoice | None:  # fmt: skip
    """The backend for the phase labelled `phase` over its steps `step_names`, among `order`
    (static order: earlier wins a tie); `timings` is backend -> step name -> timing, and a
    backend missing any of the steps (rejected, or failed while timed) takes no part. None when
    the phase has no step or no backend has timed all of them."""
    if not step_names:
        return None
    totals: dict[str, float] = {}
    spreads: dict[str, float] = {}
    for name in order:
        timed = timings.get(name, {})
        if all(step in timed for step in step_names):
            totals[name] = sum(step_cost_us(timed[step], layers_per_step) for step in step_names)
            spreads[name] = sum(timed[step].spread_us for step in step_names)
    if not totals:
        return None
    fastest = min(totals, key=lambda name: (totals[name], order.index(name)))
    best = totals[fastest]
    tied = tuple(
        name
        for name in totals
        if within_tolerance(totals[name], best, spreads[fastest] + spreads[name])
    )
    return PhaseChoice(phase, tied[0], fastest, totals, tied)


def choose(
    steps: Sequence[MeasureStep], order: Sequence[str],
    timings: Mapping[str, Mapping[str, StepTiming]], layers_per_step: int | None = None,
) -> dict[str, PhaseChoice]:  # fmt: skip
    """The choice of each phase that has steps ("decode", "prefill", "mixed") and "overall"."""
    choices: dict[str, PhaseChoice] = {}
    groups = [(p.value, [s.name for s in steps if s.phase is p]) for p in Phase]
    for label, names in [*groups, (OVERALL, [s.name for s in steps])]:
        choice = choose_phase(label, names, order, timings, layers_per_step)
        if choice is not None:
            choices[label] = choice
    return choices
