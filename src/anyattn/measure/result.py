"""The result of a measured selection (`Measurement`): steps, times, choices per phase, and
whether an engine runs the decode and prefill choices as a pair (docs/measured_selection.md,
"The policy"). The cache stores `to_dict`; `from_dict` recomputes the choices from the times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig
from anyattn.kv_cache_sharing import KVCacheNotShareableError, plan_shared_kv_cache
from anyattn.layer_params import LayerParams
from anyattn.measure.policy import OVERALL, PhaseChoice, choose, step_cost_us, within_tolerance
from anyattn.measure.steps import MeasureStep, Phase
from anyattn.measure.timing import StepTiming

__all__ = ["Measurement", "kv_cache_compatibility"]


@dataclass(frozen=True)
class Measurement:
    """Which backend is fastest for one layer config on this device, per phase.

    Attributes:
        device: the device's name.
        order: the timed candidates in static order (ties go to the earlier).
        steps: the timed steps.
        timings: backend -> step name -> `StepTiming`.
        rejected: backend -> why it was not timed (oracle check failed, or it raised).
        choices: "decode", "prefill", "mixed" (those with steps) and "overall" -> `PhaseChoice`.
        kv_cache_shared, kv_cache_note: whether the decode and prefill choices can share one KV
            cache (`kv_cache_compatibility`), and why or why not.
        is_mla: the config is MLA (the engine runs MLA layers on one backend per layer).
        layers_per_step: the layer calls that share one `build` per step, which weighs each
            step's build into its cost; None: not counted.
        check_s, timing_s: wall seconds of the oracle checks (where kernels compile) and of the
            timing (first calls included, `first_calls_s`); 0 when read from the cache.
        from_cache, cache_note: whether this came from the on-disk cache, and what the cache
            did ("used <path>", "saved to <path>", "cache off", ...).
    """

    device: str
    order: tuple[str, ...]
    steps: tuple[MeasureStep, ...]
    timings: Mapping[str, Mapping[str, StepTiming]]
    rejected: Mapping[str, str]
    kv_cache_shared: bool = False
    kv_cache_note: str = ""
    is_mla: bool = False
    layers_per_step: int | None = None
    check_s: float = 0.0
    timing_s: float = 0.0
    from_cache: bool = False
    cache_note: str = ""
    choices: Mapping[str, PhaseChoice] = field(init=False)

    def __post_init__(self) -> None:
        choices = choose(self.steps, self.order, self.timings, self.layers_per_step)
        object.__setattr__(self, "choices", choices)

    def choice(self, phase: Phase | str) -> str | None:
        """The backend chosen for `phase` ("decode", "prefill", "mixed", "overall")."""
        label = phase.value if isinstance(phase, Phase) else phase
        found = self.choices.get(label)
        return None if found is None else found.backend

    @property
    def overall(self) -> str | None:
        """The single best backend over every step."""
        return self.choice(OVERALL)

    def _pair_and_overall_us(self, decode: str, prefill: str) -> tuple[float, float, float] | None:
        """Predicted summed cost of the pair and of the overall choice over every step, and
        the two sums' spread; None when a step lacks a timing they need."""
        best = self.overall
        users = {Phase.DECODE: (decode,), Phase.PREFILL: (prefill,), Phase.MIXED: (decode, prefill)}
        pair = overall = spread = 0.0
        for step in self.steps:
            pair_timings = [self.timings.get(n, {}).get(step.name) for n in users[step.phase]]
            best_timing = self.timings.get(best, {}).get(step.name) if best else None
            if best_timing is None or any(t is None for t in pair_timings):
                return None
            for timing in [*pair_timings, best_timing]:
                spread += timing.spread_us  # type: ignore[union-attr]
            pair += sum(step_cost_us(t, self.layers_per_step) for t in pair_timings)  # type: ignore[arg-type]
            overall += step_cost_us(best_timing, self.layers_per_step)
        return pair, overall, spread

    @property
    def possible_pair(self) -> tuple[str, str] | None:
        """`(decode, prefill)` when the two choices differ, can share one KV cache and the layer
        is not MLA (an engine could run them as a pair); else None."""
        decode, prefill = self.choice(Phase.DECODE), self.choice(Phase.PREFILL)
        if decode is None or prefill is None or decode == prefill:
            return None
        return None if self.is_mla or not self.kv_cache_shared else (decode, prefill)

    @property
    def phase_pair(self) -> tuple[str, str] | None:
        """`possible_pair` when the engine runs it: the pair is predicted to beat the overall
        choice (module docstring); else None (the overall choice serves every step)."""
        pair = self.possible_pair
        predicted = None if pair is None else self._pair_and_overall_us(*pair)
        if predicted is None:
            return None
        pair_us, overall_us, spread = predicted
        pays = pair_us < overall_us and not within_tolerance(overall_us, pair_us, spread)
        return pair if pays else None

    def pair_note(self) -> str:
        """What an engine runs on this measurement, and why not a per-phase pair."""
        decode, prefill = self.choice(Phase.DECODE), self.choice(Phase.PREFILL)
        pair = self.phase_pair
        if pair is not None:
            return (
                f"per-phase pair used: decodes on {pair[0]}, prefills (and the prefill rows of "
                f"mixed steps) on {pair[1]}; {self.kv_cache_note}"
            )
        one = f"one backend, {self.overall} (overall), for every step"
        if decode is None or prefill is None:
            return f"{one}: no decode or no prefill step was timed"
        if decode == prefill:
            return f"{one}: decode and prefill both chose {decode}"
        if self.is_mla:
            return f"{one}: the engine runs MLA layers on one backend for every phase"
        if not self.kv_cache_shared:
            return (
                f"{one}: {decode} (decode) and {prefill} (prefill) cannot share one KV cache "
                f"({self.kv_cache_note})"
            )
        predicted = self._pair_and_overall_us(decode, prefill)
        if predicted is None:
            names = ", ".join(dict.fromkeys(n for n in (decode, prefill, self.overall) if n))
            return f"{one}: not every step was timed on {names}"
        pair_us, overall_us, _ = predicted
        return (
            f"{one}: the pair {decode} (decode) + {prefill} (prefill) is predicted at "
            f"{pair_us:.0f} us over the steps (a mixed step counted as both backends' step) "
            f"against {overall_us:.0f} us, not a clear gain"
        )

    def first_calls_s(self, backend: str) -> float:
        """Seconds of `backend`'s first calls beyond their steady state, summed over the
        steps: compilation, autotuning and plan caches, paid once."""
        timings = self.timings.get(backend, {}).values()
        return sum(max(t.first_call_us - t.median_us, 0.0) for t in timings) / 1e6

    def to_dict(self) -> dict[str, object]:
        timings = {b: [t.to_dict() for t in steps.values()] for b, steps in self.timings.items()}
        return {
            "device": self.device, "order": list(self.order),
            "steps": [s.to_dict() for s in self.steps], "timings": timings,
            "rejected": dict(self.rejected),
            "choices": {k: c.to_dict() for k, c in self.choices.items()},
            "first_calls_s": {b: self.first_calls_s(b) for b in self.timings},
            "kv_cache_shared": self.kv_cache_shared, "kv_cache_note": self.kv_cache_note,
            "is_mla": self.is_mla, "layers_per_step": self.layers_per_step,
            "engine": self.pair_note(), "check_s": self.check_s, "timing_s": self.timing_s,
            "from_cache": self.from_cache, "cache_note": self.cache_note,
        }  # fmt: skip

    @staticmethod
    def from_dict(data: Mapping[str, object], *, cache_note: str = "") -> Measurement:
        """A measurement read back from the cache (choices recomputed from its times).

        Raises:
            KeyError, TypeError, ValueError: the data is not a measurement.
        """
        timings = {
            str(b): {t["step"]: StepTiming.from_dict(t) for t in per_step}  # type: ignore[index]
            for b, per_step in data["timings"].items()  # type: ignore[attr-defined]
        }
        layers = data["layers_per_step"]
        order = tuple(str(b) for b in data["order"])  # type: ignore[attr-defined]
        steps = tuple(MeasureStep.from_dict(s) for s in data["steps"])  # type: ignore[attr-defined]
        rejected = {str(k): str(v) for k, v in data["rejected"].items()}  # type: ignore[attr-defined]
        return Measurement(
            device=str(data["device"]), order=order, steps=steps, timings=timings,
            rejected=rejected, kv_cache_shared=bool(data["kv_cache_shared"]),
            kv_cache_note=str(data["kv_cache_note"]), is_mla=bool(data["is_mla"]),
            layers_per_step=None if layers is None else int(layers),  # type: ignore[call-overload]
            from_cache=True, cache_note=cache_note,
        )  # fmt: skip


def kv_cache_compatibility(
    choices: Mapping[str, PhaseChoice], candidates: Sequence[type[AttentionBackend]],
    config: AttentionSelectorConfig, layer: LayerParams,
) -> tuple[bool, str]:  # fmt: skip
    """Whether the decode and prefill choices among `candidates` can run on one KV cache for
    `config` (`anyattn.kv_cache_sharing.plan_shared_kv_cache` at the config's block size, else
    the decode choice's preferred one), and the plan or why not."""
    by_name = {b.get_name(): b for b in candidates}
    phases = [p.value for p in (Phase.DECODE, Phase.PREFILL) if p.value in choices]
    unique = list(dict.fromkeys(by_name[choices[p].backend] for p in phases))
    if len(unique) < 2:
        return True, "one backend for every phase"
    try:
        shared = plan_shared_kv_cache(
            unique, block_size=config.block_size or unique[0].get_preferred_block_size(16),
            num_kv_heads=1 if config.use_mla else layer.num_kv_heads, head_size=layer.head_size,
            kv_cache_dtype=config.kv_cache_dtype,
        )  # fmt: skip
    except KVCacheNotShareableError as error:
        return False, str(error)
    return True, shared.describe()
