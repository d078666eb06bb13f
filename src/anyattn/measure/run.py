"""Measure the candidate backends of one layer config and choose per phase (or read the cache):
each candidate is checked against the oracle (`verify`), rejected if it fails, else timed on
every step (`timing`). The candidates and their static order come from the selector.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

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
from anyattn.measure.policy import PhaseChoice, choose
from anyattn.measure.result import Measurement, kv_cache_compatibility
from anyattn.measure.steps import MeasureStep, Phase, measurement_steps
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
    config: AttentionSelectorConfig,
    layer: LayerParams,
    limits: BatchLimits,
    device: torch.device,
    budget_s: float,
) -> Timer:
    def timer(backend: type[AttentionBackend], step: MeasureStep) -> StepTiming:
        prepared = prepare_step(backend, config, layer, step, limits, device)
        try:
            return time_prepared(prepared, step.name, device, budget_s=budget_s)
        finally:
            del prepared
            if device.type == "cuda":
                torch.cuda.empty_cache()

    return timer


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("measuring {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True, markup=False, emoji=False, highlight=False),
        transient=True,
        disable=not enabled,
    )


def _measure(
    candidates: Sequence[type[AttentionBackend]],
    steps: tuple[MeasureStep, ...],
    timer: Timer,
    checker: Checker,
    progress: bool,
) -> tuple[dict[str, dict[str, StepTiming]], dict[str, str], float]:
    """Check then time each candidate; returns (timings, rejected, seconds of checks)."""
    timings: dict[str, dict[str, StepTiming]] = {}
    check_s = 0.0
    rejected: dict[str, str] = {}
    with _progress(progress) as bar:
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


def _cache_sharing(
    choices: Mapping[str, PhaseChoice],
    candidates: Sequence[type[AttentionBackend]],
    config: AttentionSelectorConfig,
    layer: LayerParams,
) -> tuple[bool, str]:
    """Whether the pair an engine would run (decodes on the decode choice, prefills on the
    prefill's) can share one KV cache, and why (`kv_cache_compatibility`)."""
    by_name = {b.get_name(): b for b in candidates}
    phases = [p.value for p in (Phase.DECODE, Phase.PREFILL) if p.value in choices]
    return kv_cache_compatibility([by_name[choices[p].backend] for p in phases], config, layer)


def measure_candidates(
    config: AttentionSelectorConfig,
    limits: BatchLimits,
    candidates: Sequence[type[AttentionBackend]],
    device: torch.device,
    *,
    layer_params: LayerParams | None = None,
    timer: Timer | None = None,
    checker: Checker | None = None,
    use_cache: bool = True,
    progress: bool = False,
    layers_per_step: int | None = None,
) -> Measurement:
    """Check, time and choose among `candidates` (in static order) for `config` on `device`.

    Args:
        config: the layer's selector config (decoder attention, standard or MLA).
        limits: the engine's limits; they set the steps.
        candidates: backend classes that fit `config` here, in the selector's order.
        device: the real device to time on.
        layer_params: the layer's record, when known (`anyattn.measure.layer_shape`).
        timer: replaces the real timing (tests); default: the backends' builders and impls.
        checker: replaces the oracle check (tests); default: `check_against_oracle`.
        use_cache: read and write the on-disk cache (`anyattn.measure.cache`).
        progress: show a progress bar on stderr.
        layers_per_step: layer calls sharing one `build` per step (an engine's layers of this
            config): each step's build is then weighed into its cost (`Measurement`).

    Raises:
        ValueError: no candidates, missing heads, or a config measured selection does not
            cover (encoder or cross attention).
    """
    if not candidates:
        raise ValueError("measure: no candidate backend (got none, expected at least one).")
    if layers_per_step is not None and (
        not isinstance(layers_per_step, int) or isinstance(layers_per_step, bool)
        or layers_per_step < 1
    ):  # fmt: skip
        raise ValueError(
            f"measure: layers_per_step must be None or an int >= 1 (got {layers_per_step!r})."
        )
    layer = resolve_layer(config, layer_params)
    steps = measurement_steps(config, limits)
    # `layers_per_step` only weighs the stored times, so it is not part of the key.
    key = make_key(device, list(candidates), _jsonable(config), _jsonable(layer), _jsonable(limits))  # type: ignore[arg-type]
    if use_cache and cache_dir() is None:
        use_cache, note = False, f"cache off ({NO_CACHE_ENV} is set)"
    else:
        note = "" if use_cache else "cache not used (use_cache=False)"
    if use_cache:
        stored, note = load_entry(key)
        if stored is not None:
            try:
                found = Measurement.from_dict(stored, cache_note=note)
                # This call's `layers_per_step` may choose other backends than the stored
                # call's: whether they share a cache is judged for the choices made now.
                found = dataclasses.replace(found, layers_per_step=layers_per_step)
                shared, why = _cache_sharing(found.choices, candidates, config, layer)
                return dataclasses.replace(found, kv_cache_shared=shared, kv_cache_note=why)
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                note = f"{note.removeprefix('used ')} is not a valid measurement ({error}); "
                note += "measured again"
    per_step_s = min(0.2, TIMING_BUDGET_S / (len(candidates) * len(steps)))
    timer = timer or _default_timer(config, layer, limits, device, per_step_s)
    checker = checker or (lambda backend: check_against_oracle(backend, config, layer, device))
    start = time.perf_counter()
    timings, rejected, check_s = _measure(candidates, steps, timer, checker, progress)
    timing_s = time.perf_counter() - start - check_s
    order = tuple(b.get_name() for b in candidates)
    choices = choose(steps, order, timings, layers_per_step)
    shared, why = _cache_sharing(choices, candidates, config, layer)
    result = Measurement(
        device=str(device_identity(device)["name"]), order=order, steps=steps, timings=timings,
        rejected=rejected, kv_cache_shared=shared, kv_cache_note=why, is_mla=config.use_mla,
        layers_per_step=layers_per_step, check_s=check_s, timing_s=timing_s,
    )  # fmt: skip
    if use_cache:
        _, stored_note = store_entry(key, result.to_dict())
        note = f"{note}; {stored_note}" if note else stored_note
    return dataclasses.replace(result, cache_note=note)
