"""The result of a measured selection: steps, times, choices per phase, and whether the phase
choices could share one KV cache.

`Measurement` is what `anyattn.selector.measure_backends` returns and what the cache stores
(`to_dict` / `from_dict`; choices are recomputed from the stored times on load, so a cached
file cannot carry a choice its times do not support).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig
from anyattn.layer_params import LayerParams
from anyattn.measure.policy import OVERALL, PhaseChoice, choose
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
        kv_cache_shared: whether the phase choices can share one KV cache (same shape, kernel
            block size, layout and cache dtype), so an engine may run them on one cache.
        kv_cache_note: why, or why not.
        timing_s: wall seconds of checking and timing (0 when read from the cache).
        from_cache: whether this came from the on-disk cache.
        cache_note: what the cache did ("used <path>", "saved to <path>", "cache off", ...).
    """

    device: str
    order: tuple[str, ...]
    steps: tuple[MeasureStep, ...]
    timings: Mapping[str, Mapping[str, StepTiming]]
    rejected: Mapping[str, str]
    kv_cache_shared: bool
    kv_cache_note: str
    timing_s: float = 0.0
    from_cache: bool = False
    cache_note: str = ""
    choices: Mapping[str, PhaseChoice] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", choose(self.steps, self.order, self.timings))

    def choice(self, phase: Phase | str) -> str | None:
        """The backend chosen for `phase` ("decode", "prefill", "mixed", "overall")."""
        label = phase.value if isinstance(phase, Phase) else phase
        found = self.choices.get(label)
        return None if found is None else found.backend

    @property
    def overall(self) -> str | None:
        """The single best backend over every step."""
        return self.choice(OVERALL)

    def first_calls_s(self, backend: str) -> float:
        """Seconds of `backend`'s first calls beyond their steady state, summed over the
        steps: compilation, autotuning and plan caches, paid once."""
        return (
            sum(
                max(t.first_call_us - t.median_us, 0.0)
                for t in self.timings.get(backend, {}).values()
            )
            / 1e6
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "device": self.device,
            "order": list(self.order),
            "steps": [s.to_dict() for s in self.steps],
            "timings": {
                b: [t.to_dict() for t in per_step.values()] for b, per_step in self.timings.items()
            },
            "rejected": dict(self.rejected),
            "choices": {k: c.to_dict() for k, c in self.choices.items()},
            "first_calls_s": {b: self.first_calls_s(b) for b in self.timings},
            "kv_cache_shared": self.kv_cache_shared,
            "kv_cache_note": self.kv_cache_note,
            "timing_s": self.timing_s,
            "from_cache": self.from_cache,
            "cache_note": self.cache_note,
        }

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
        return Measurement(
            device=str(data["device"]),
            order=tuple(str(b) for b in data["order"]),  # type: ignore[attr-defined]
            steps=tuple(MeasureStep.from_dict(s) for s in data["steps"]),  # type: ignore[attr-defined]
            timings=timings,
            rejected={str(k): str(v) for k, v in data["rejected"].items()},  # type: ignore[attr-defined]
            kv_cache_shared=bool(data["kv_cache_shared"]),
            kv_cache_note=str(data["kv_cache_note"]),
            from_cache=True,
            cache_note=cache_note,
        )


def kv_cache_compatibility(
    backends: list[type[AttentionBackend]],
    config: AttentionSelectorConfig,
    layer: LayerParams,
) -> tuple[bool, str]:
    """Whether `backends` can run on one KV cache for `config`: the same logical shape, kernel
    block size, preferred physical layout (stride order) and cache dtype."""
    unique = list(dict.fromkeys(backends))
    if len(unique) < 2:
        return True, "one backend for every phase"
    block_size = config.block_size or unique[0].get_preferred_block_size(16)
    heads = 1 if config.use_mla else layer.num_kv_heads

    def layout_of(backend: type[AttentionBackend]) -> tuple[object, ...]:
        kernel = backend.get_kernel_block_size(block_size)
        shape = backend.get_kv_cache_shape(8, kernel, heads, layer.head_size, config.kv_cache_dtype)
        order = backend.get_kv_cache_stride_order(backend.supported_kv_cache_layouts()[0])
        return kernel, tuple(shape), tuple(order), config.cache_dtype

    first = layout_of(unique[0])
    for other in unique[1:]:
        theirs = layout_of(other)
        if theirs != first:
            fields = ("kernel block size", "shape", "layout", "cache dtype")
            differs = [f for f, a, b in zip(fields, first, theirs, strict=True) if a != b]
            return False, (
                f"{unique[0].get_name()} and {other.get_name()} differ in {', '.join(differs)}"
            )
    names = " and ".join(b.get_name() for b in unique)
    return True, f"{names} share the cache shape, kernel block size, layout and dtype"
