"""Measure the candidate backends of one layer config and choose per phase (or read the cache):
each candidate is checked against the oracle (`verify`), rejected if it fails, else timed on
every step (`timing`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig, BatchLimits
from anyattn.layer_params import LayerParams
from anyattn.measure.cache import (
    NO_CACHE_ENV,
    cache_dir,
    device_identity,
    load_entry,
    make_key,
    store_entry,
)
from anyattn.measure.inputs import prepare_step
from anyattn.measure.layer_shape import resolve_layer
from anyattn.measure.result import Measurement, kv_cache_compatibility
from anyattn.measure.steps import MeasureStep, measurement_steps
from anyattn.measure.timing import StepTiming, Timer, time_prepared
from anyattn.measure.verify import check_against_oracle

__all__ = ["TIMING_BUDGET_S", "Checker", "measure_candidates"]

Checker = Callable[[type[AttentionBackend]], str | None]
"""`checker(backend) -> None` when the backend's results agree with the oracle, else why not."""

# Seconds of timed calls in all; on a GPU the hold kernel that precedes each batch of calls
# adds up to 1.5 times as much, and first calls and oracle checks come on top: about a minute.
TIMING_BUDGET_S = 20.0


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return str(value)  # dtypes, enums


def _default_timer(
    config: AttentionSelectorConfig, layer: LayerParams, limits: BatchLimits, device: torch.device,
    budget_s: float,
) -> Timer:  # fmt: skip
    def timer(backend: type[AttentionBackend], step: MeasureStep) -> StepTiming:
        prepared = prepare_step(backend, config, layer, step, limits, device)
        try:
            return time_prepared(prepared, step.name, device, budget_s=budget_s)
        finally:
            del prepared
            if device.type == "cuda":
                torch.cuda.empty_cache()

    return timer


def _measure(
    candidates: Sequence[type[AttentionBackend]], steps: tuple[MeasureStep, ...], timer: Timer,
    checker: Checker, progress: bool,
) -> tuple[dict[str, dict[str, StepTiming]], dict[str, str], float]:  # fmt: skip
    """Check then time each candidate; returns (timings, rejected, seconds of checks)."""
    timings: dict[str, dict[str, StepTiming]] = {}
    rejected: dict[str, str] = {}
    check_s = 0.0
    bar = Progress(
        TextColumn("measuring {task.description}"), BarColumn(),
        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
        console=Console(stderr=True, markup=False, emoji=False, highlight=False), transient=True,
        disable=not progress,
    )  # fmt: skip
    with bar:
        task = bar.add_task("", total=len(candidates) * (len(steps) + 1))
        for backend in candidates:
            name = backend.get_name()
            bar.update(task, description=f"{name}: oracle check")
            start = time.perf_counter()
            reason = checker(backend)
            check_s += time.perf_counter() - start
            bar.advance(task)
            if reason is not None:
                rejected[name] = f"oracle check failed: {reason}"
                bar.advance(task, len(steps))
                continue
            timed: dict[str, StepTiming] = {}
            for step in steps:
                bar.update(task, description=f"{name}: {step.name}")
                try:
                    timed[step.name] = timer(backend, step)
                except Exception as error:  # a backend may fail on a large step in any way
                    rejected[name] = f"{step.name} raised {type(error).__name__}: {error}"
                    break
                finally:
                    bar.advance(task)
            if name not in rejected:
                timings[name] = timed
    return timings, rejected, check_s


def measure_candidates(
    config: AttentionSelectorConfig, limits: BatchLimits,
    candidates: Sequence[type[AttentionBackend]], device: torch.device, *,
    layer_params: LayerParams | None = None, timer: Timer | None = None,
    checker: Checker | None = None, use_cache: bool = True, progress: bool = False,
    layers_per_step: int | None = None,
) -> Measurement:  # fmt: skip
    """Check, time and choose among `candidates` (backend classes that fit `config` here, in
    the selector's order) for `config` on `device`, or read the result from the cache; the
    arguments are `anyattn.selector.measure_backends`'s.

    Raises:
        ValueError: no candidates, missing heads, or a config measured selection does not
            cover (encoder or cross attention).
    """
    if not candidates:
        raise ValueError("measure: no candidate backend (got none, expected at least one).")
    count = layers_per_step
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"measure: layers_per_step must be None or an int >= 1 (got {count!r}).")
    layer = resolve_layer(config, layer_params)
    steps = measurement_steps(config, limits)

    def with_sharing(measured: Measurement) -> Measurement:
        # Judged for the choices made now: this call's `layers_per_step` may choose other
        # backends than a stored call's.
        measured = dataclasses.replace(measured, layers_per_step=layers_per_step)
        shared, why = kv_cache_compatibility(measured.choices, candidates, config, layer)
        return dataclasses.replace(measured, kv_cache_shared=shared, kv_cache_note=why)

    # `layers_per_step` only weighs the stored times, so it is not part of the key.
    key = make_key(device, list(candidates), _jsonable(config), _jsonable(layer), _jsonable(limits))  # type: ignore[arg-type]
    if not use_cache:
        note = "cache not used (use_cache=False)"
    elif cache_dir() is None:
        use_cache, note = False, f"cache off ({NO_CACHE_ENV} is set)"
    else:
        stored, note = load_entry(key)
        if stored is not None:
            try:
                return with_sharing(Measurement.from_dict(stored, cache_note=note))
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                note = f"{note.removeprefix('used ')} is not a valid measurement ({error}); "
                note += "measured again"
    per_step_s = min(0.2, TIMING_BUDGET_S / (len(candidates) * len(steps)))
    timer = timer or _default_timer(config, layer, limits, device, per_step_s)
    checker = checker or (lambda backend: check_against_oracle(backend, config, layer, device))
    start = time.perf_counter()
    timings, rejected, check_s = _measure(candidates, steps, timer, checker, progress)
    result = with_sharing(Measurement(
        device=str(device_identity(device)["name"]), order=tuple(b.get_name() for b in candidates),
        steps=steps, timings=timings, rejected=rejected, is_mla=config.use_mla, check_s=check_s,
        timing_s=time.perf_counter() - start - check_s,
    ))  # fmt: skip
    if use_cache:
        note = f"{note}; {store_entry(key, result.to_dict())[1]}"
    return dataclasses.replace(result, cache_note=note)
