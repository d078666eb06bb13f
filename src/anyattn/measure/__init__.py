"""Measured backend selection: time every backend that fits a layer config on this device and
choose per phase (decode, prefill, mixed) and overall (docs/measured_selection.md, which names
each module's part). The entry points are in the selector (`select_backend(config,
policy="fastest", limits=...)`, `measure_backends`).
"""

from anyattn.measure.cache import CACHE_DIR_ENV, NO_CACHE_ENV, cache_dir
from anyattn.measure.policy import OVERALL, RELATIVE_TOLERANCE, PhaseChoice, choose
from anyattn.measure.result import Measurement
from anyattn.measure.run import Checker, measure_candidates
from anyattn.measure.steps import MeasureStep, Phase, measurement_steps
from anyattn.measure.timing import StepTiming, Timer

__all__ = [
    "CACHE_DIR_ENV", "NO_CACHE_ENV", "OVERALL", "RELATIVE_TOLERANCE", "Checker", "MeasureStep",
    "Measurement", "Phase", "PhaseChoice", "StepTiming", "Timer", "cache_dir", "choose",
    "measure_candidates", "measurement_steps",
]  # fmt: skip
