"""Pick the backend for a layer, and say why every other backend was not picked.

`select_backend` tries the registered backends in the order of the rank each declares for the
platform (`AttentionBackend.priority`; none there: only on explicit request), skips those not
`chosen_automatically`, and returns the first that fits and is installed here. A requested
backend (argument, else `ANYATTN_BACKEND`) that does not fit is an error, never a silent
fallback. `explain` returns the whole verdict table as data. With `policy="fastest"` (or the
name "fastest") every fitting backend is timed here instead (`measure_backends`;
docs/measured_selection.md). Capability is judged for the given device, which may be
hypothetical (an sm90 asked about from a laptop); availability for this machine.
"""

from __future__ import annotations

import functools
import os

import torch

from anyattn.config import AttentionSelectorConfig, BatchLimits
from anyattn.declarations import CONFIG_FEATURES, AttentionBackend, platform_key, rank_on
from anyattn.explanation import BackendVerdict, Explanation, NoBackendError
from anyattn.layer_params import LayerParams
from anyattn.measure.result import Measurement
from anyattn.measure.run import Checker, measure_candidates
from anyattn.measure.timing import Timer
from anyattn.registry import (
    AttentionBackendEnum,
    backend_names,
    generation,
    get_backend_class,
    get_backend_path,
)
from anyattn.types import DeviceInfo, is_fp8_cache

__all__ = [
    "ENV_VAR",
    "FASTEST",
    "POLICIES",
    "BackendVerdict",
    "Explanation",
    "NoBackendError",
    "clear_cache",
    "explain",
    "measure_backends",
    "priority_list",
    "select_backend",
]

ENV_VAR = "ANYATTN_BACKEND"
# The backend "name" (argument or ANYATTN_BACKEND) that asks for measured selection.
FASTEST = "fastest"
POLICIES = ("priority", FASTEST)

# Prefix of the availability reason of a backend whose class cannot be imported.
_LOAD_FAILED = "cannot be loaded: "


def _ranked(
    device: DeviceInfo, use_mla: bool = False
) -> list[tuple[str, type[AttentionBackend] | str]]:
    """Every registered backend (its class, or why it cannot be loaded) in the order tried on
    `device`: ranked ones first, those of the config's kind (MLA or not) before the others,
    each by rank; then the unranked. Ties keep registration order."""
    key = platform_key(device)
    loaded: list[tuple[str, type[AttentionBackend] | str]] = []
    for name in backend_names():
        try:
            loaded.append((name, get_backend_class(name)))
        except (ImportError, TypeError) as error:
            loaded.append((name, f"{_LOAD_FAILED}{error}"))

    def rank(item: tuple[str, type[AttentionBackend] | str]) -> tuple[bool, bool, int]:
        cls = item[1]
        if isinstance(cls, str):
            return (True, False, 0)
        declared = rank_on(cls.priority, key)
        # MLA backends compete only with MLA backends, standard ones with standard ones.
        other_kind = cls.is_mla() != use_mla
        return (declared is None, other_kind, 0 if declared is None else declared)

    return sorted(loaded, key=rank)  # stable: registration order within a rank


def priority_list(device: DeviceInfo, use_mla: bool = False) -> list[str]:
    """Registered backend names in the order tried on `device` for standard layers, or with
    `use_mla` for MLA layers (the MLA order: MLA backends first, by their rank); backends that
    declare no rank for its platform (and those that cannot be loaded) come last."""
    return [name for name, _ in _ranked(device, use_mla)]


def _judge(
    name: str,
    cls: type[AttentionBackend] | str,
    position: int,
    config: AttentionSelectorConfig,
    device: DeviceInfo,
) -> BackendVerdict:
    if isinstance(cls, str):
        return BackendVerdict(name, position, (), cls)
    key = platform_key(device)
    not_automatic = None
    if rank_on(cls.priority, key) is None:
        not_automatic = f"declares no priority for {key}"
    elif not cls.chosen_automatically(config, device):
        not_automatic = "not chosen automatically for this config"
    reasons = tuple(cls.validate_configuration(config, device))
    return BackendVerdict(name, position, reasons, cls.get_unavailable_reason(), not_automatic)


def _verdicts(config: AttentionSelectorConfig, device: DeviceInfo) -> tuple[BackendVerdict, ...]:
    return tuple(
        _judge(name, cls, i, config, device)
        for i, (name, cls) in enumerate(_ranked(device, config.use_mla))
    )


def _hints(
    config: AttentionSelectorConfig,
    device: DeviceInfo,
    verdicts: tuple[BackendVerdict, ...],
    requested: str | None,
) -> tuple[str, ...]:
    """Single changes to the request that would make some backend fit, each with the first
    backend it makes fit (the requested one where it does). A backend that fits as given (when
    another was requested) is named as such, never as fitting after a change."""
    hints: list[str] = []
    as_given = [v.name for v in verdicts if v.fits and not v.not_automatic]
    if as_given:
        hints.append(
            f"{as_given[0]} fits this config as given (the selector's choice when {requested} "
            "is not requested)"
        )
    for v in verdicts:
        if v.fits and v.not_automatic:
            hints.append(f"{v.name} fits this config when requested explicitly ({v.not_automatic})")
        # A backend that cannot be imported has no declarations to judge: it may not fit.
        if not v.reasons and v.unavailable and not v.unavailable.startswith(_LOAD_FAILED):
            hints.append(f"{v.name} fits this config but is not available here: {v.unavailable}")
    variations: list[tuple[str, dict[str, object]]] = []
    if config.kv_cache_dtype != "auto":
        variations.append(("kv_cache_dtype='auto'", {"kv_cache_dtype": "auto"}))
    if config.use_per_head_quant_scales and not is_fp8_cache(config.kv_cache_dtype):
        variations.append(("kv_cache_dtype='fp8'", {"kv_cache_dtype": "fp8"}))
    if config.block_size is not None:
        variations.append(("block_size=None (the backend's preferred size)", {"block_size": None}))
    for dtype_name in ("bfloat16", "float16", "float32"):
        if str(config.dtype) != f"torch.{dtype_name}":
            variations.append((f"dtype={dtype_name}", {"dtype": dtype_name}))
    for flag in (*(flag for _, flag, _ in CONFIG_FEATURES), "use_sparse", "use_mla"):
        if getattr(config, flag):
            variations.append((f"{flag}=False", {flag: False}))
    for label, change in variations:
        try:
            variant = config.replace(**change)
        except ValueError:
            continue
        fitting = [
            v.name
            for v in _verdicts(variant, device)
            if v.fits and not v.not_automatic and v.name not in as_given
        ]
        if fitting:
            name = requested if requested in fitting else fitting[0]
            hints.append(f"with {label}, {name} would fit")
    if not hints:
        hints.append("no single setting change makes a backend fit; see the reasons above")
    return tuple(hints)


def _device_info(device: DeviceInfo | str | torch.device | None) -> DeviceInfo:
    """Accept a DeviceInfo, a torch.device, or text such as "cpu", "cuda", "sm90"."""
    if device is None:
        return DeviceInfo.current()
    if isinstance(device, DeviceInfo):
        return device
    if isinstance(device, torch.device):
        return DeviceInfo.current(device)
    if isinstance(device, str):
        return DeviceInfo.parse(device)
    raise TypeError(
        f"device: expected a DeviceInfo, torch.device or str such as 'cpu' or 'sm90' (got "
        f"{type(device).__name__})."
    )


def _requested_name(backend: str | AttentionBackendEnum | None) -> tuple[str | None, str | None]:
    """The explicitly requested backend and its source; "fastest" is a policy, not a name."""
    if isinstance(backend, AttentionBackendEnum):
        return backend.name, "argument"
    if backend is not None:
        return (None, None) if _is_fastest(backend) else (backend, "argument")
    from_env = os.environ.get(ENV_VAR, "").strip()
    if not from_env or _is_fastest(from_env):
        return None, None
    return from_env, ENV_VAR


def _is_fastest(name: object) -> bool:
    return isinstance(name, str) and name.strip().lower() == FASTEST


@functools.lru_cache(maxsize=256)
def _explain_cached(
    config: AttentionSelectorConfig,
    device: DeviceInfo,
    requested: str | None,
    requested_by: str | None,
    registry_generation: int,
) -> Explanation:
    if requested is not None:
        get_backend_path(requested)  # raises for an unknown name, listing the valid ones
        requested = requested.upper()
    verdicts = _verdicts(config, device)
    if requested is not None:
        verdict = next(v for v in verdicts if v.name == requested)
        chosen = requested if verdict.fits else None
    else:
        chosen = next((v.name for v in verdicts if v.fits and not v.not_automatic), None)
    hints = () if chosen is not None else _hints(config, device, verdicts, requested)
    return Explanation(config, device, chosen, requested, requested_by, verdicts, hints)


def explain(
    config: AttentionSelectorConfig,
    device: DeviceInfo | str | torch.device | None = None,
    backend: str | AttentionBackendEnum | None = None,
) -> Explanation:
    """The selector's verdict on every registered backend, as data (cached on the config).

    Args:
        config: what the layer needs.
        device: where it will run (`DeviceInfo`, `torch.device`, or "cpu" / "cuda" / "sm90");
            default: this machine's first GPU, else the CPU.
        backend: an explicitly requested backend name (else `ANYATTN_BACKEND`, if set).

    Raises:
        ValueError: `backend` names no registered backend (the message lists them).
    """
    if not isinstance(config, AttentionSelectorConfig):
        raise TypeError(
            f"explain: config must be an AttentionSelectorConfig (got {type(config).__name__})."
        )
    return _explain_cached(config, _device_info(device), *_requested_name(backend), generation())


def _timing_device(device: DeviceInfo | str | torch.device | None) -> torch.device:
    """The real device to time on; a hypothetical one (e.g. "sm90" on another GPU) is refused."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str) and device.strip().lower().startswith(("cpu", "cuda")):
        return torch.device(device.strip().lower())
    info = DeviceInfo.parse(device) if isinstance(device, str) else device
    if not isinstance(info, DeviceInfo):
        raise TypeError(
            f"device: expected a DeviceInfo, torch.device or str such as 'cpu' or 'cuda' (got "
            f"{type(device).__name__})."
        )
    here = None
    if info.type == "cpu" or torch.cuda.is_available():
        here = DeviceInfo.current(torch.device(info.type))
    if here is None or here.capability != info.capability:
        raise ValueError(
            f"measure_backends: device must be this machine's, where backends can be timed "
            f"(got {info}, this machine has {DeviceInfo.current()}). Measure on the target "
            f"machine, or use policy='priority' to judge a device you do not have."
        )
    return torch.device(info.type)


def measure_backends(
    config: AttentionSelectorConfig,
    limits: BatchLimits,
    device: DeviceInfo | str | torch.device | None = None,
    *,
    layer_params: LayerParams | None = None,
    use_cache: bool = True,
    progress: bool = False,
    timer: Timer | None = None,
    checker: Checker | None = None,
    layers_per_step: int | None = None,
) -> Measurement:
    """Time every backend the selector would take automatically for `config` on this machine,
    each after an oracle check, and choose per phase and overall (docs/measured_selection.md).

    Args:
        config: decoder attention (standard or MLA), with `num_heads` (and `num_kv_heads`)
            unless `layer_params` gives them.
        limits: the engine's limits; the timed steps come from them.
        device: this machine's device to time on (default: its first GPU, else the CPU).
        layer_params: the layer's record (`impl.layer_params()`), for what a config omits
            (window, soft cap, MLA sizes); default: `anyattn.measure.layer_shape`.
        use_cache: read and write the on-disk cache (`ANYATTN_NO_MEASURE_CACHE=1`: off).
        progress: show a progress bar on stderr.
        timer, checker: replace the timing and the oracle check (tests).
        layers_per_step: layer calls that share one metadata `build` per step, each charged
            that share of the build time; None: layer calls are compared alone.

    Returns:
        The `Measurement` (`.overall`, `.choice("decode")`, the times, the rejections).

    Raises:
        NoBackendError: no backend fits the config here.
        TypeError: limits that are not `BatchLimits`.
        ValueError: a device other than this machine's, a config without `num_heads`, or one
            measured selection does not cover (encoder or cross attention).
    """
    if not isinstance(limits, BatchLimits):
        raise TypeError(
            f"measure_backends: limits must be a BatchLimits (got {type(limits).__name__}). "
            "Pass the engine's limits: BatchLimits(max_num_reqs, max_num_tokens, max_model_len)."
        )
    torch_device = _timing_device(device)
    result = explain(config, torch_device, None)
    candidates = [
        get_backend_class(v.name) for v in result.verdicts if v.fits and not v.not_automatic
    ]
    if not candidates:
        raise NoBackendError(_no_backend_message(result), result)
    return measure_candidates(
        config, limits, candidates, torch_device, layer_params=layer_params, timer=timer,
        checker=checker, use_cache=use_cache, progress=progress, layers_per_step=layers_per_step,
    )  # fmt: skip


def _no_backend_message(result: Explanation) -> str:
    if result.requested is not None:
        verdict = next(v for v in result.verdicts if v.name == result.requested)
        why = verdict.why_not()
        return (
            f"select_backend: requested backend {result.requested} (from {result.requested_by}) "
            f"cannot serve this config on {result.device}: {'; '.join(why)}. Remove the request "
            f"to let the selector choose, or change the config.\nAll backends:\n"
            f"{result.format_reasons()}"
        )
    return (
        f"select_backend: no backend fits this config on {result.device}.\n"
        f"{result.format_reasons()}\nHints:\n" + "\n".join(f"  {h}" for h in result.hints)
    )


def select_backend(
    config: AttentionSelectorConfig,
    device: DeviceInfo | str | torch.device | None = None,
    backend: str | AttentionBackendEnum | None = None,
    *,
    policy: str = "priority",
    limits: BatchLimits | None = None,
    layer_params: LayerParams | None = None,
    progress: bool = False,
) -> type:
    """The backend class to use for `config` on `device`.

    Args:
        config, device: as for `explain`.
        backend: a backend name to use instead of the platform's order (else
            `ANYATTN_BACKEND`); "fastest" means `policy="fastest"` (from `ANYATTN_BACKEND`
            only when `limits` are given).
        policy: "priority" (the platform's static order) or "fastest" (time every backend
            that fits here and take the fastest overall; see `measure_backends`).
        limits, layer_params, progress: for "fastest" (`limits` required), as for
            `measure_backends`.

    Returns:
        The `AttentionBackend` subclass.

    Raises:
        NoBackendError: nothing fits, or the requested backend does not fit; the message lists
            every backend with its reasons and hints at a setting that would make one fit.
        ValueError: an unknown backend name (the message lists the valid ones) or policy,
            "fastest" without `limits` or with another backend requested, or no candidate
            passed the oracle check.
    """
    if policy not in POLICIES:
        raise ValueError(
            f"select_backend: unknown policy (got {policy!r}, expected one of "
            f"{', '.join(repr(p) for p in POLICIES)})."
        )
    from_env = os.environ.get(ENV_VAR, "").strip()
    # ANYATTN_BACKEND=fastest applies where the caller knows the limits (the engine does);
    # elsewhere (a layer built on its own) the static order applies.
    from_env_fastest = backend is None and limits is not None and _is_fastest(from_env)
    wants_fastest = policy == FASTEST or _is_fastest(backend) or from_env_fastest
    if wants_fastest:
        if backend is not None and not _is_fastest(backend):
            raise ValueError(
                f"select_backend: policy='fastest' chooses the backend itself (got backend="
                f"{backend!r} too). Pass one or the other."
            )
        if limits is None:
            raise ValueError(
                "select_backend: policy='fastest' needs limits (got None, expected the "
                "engine's BatchLimits): the timed steps come from them."
            )
        measured = measure_backends(
            config, limits, device, layer_params=layer_params, progress=progress
        )
        if measured.overall is None:
            rejected = "; ".join(f"{b}: {why}" for b, why in measured.rejected.items())
            raise ValueError(
                f"select_backend: no backend passed the oracle check and timing on this "
                f"machine ({rejected})."
            )
        return get_backend_class(measured.overall)
    result = explain(config, device, backend)
    if result.chosen is not None:
        return get_backend_class(result.chosen)
    raise NoBackendError(_no_backend_message(result), result)


def clear_cache() -> None:
    """Forget cached selections (after registering backends or installing packages)."""
    _explain_cached.cache_clear()
