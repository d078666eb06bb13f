"""Pick the backend for a layer, and say why every other backend was not picked.

`select_backend` orders the registered backends by the rank each declares for the platform
(`AttentionBackend.priority`; one that declares none there comes last and is only taken on
explicit request), skips those whose `chosen_automatically(config, device)` is False, and
returns the first whose declarations accept the config and which is installed here. An explicitly
requested backend (argument, then the `ANYATTN_BACKEND` environment variable) that does not fit
is an error, never a silent fallback. `explain` returns the whole verdict table as data.

Capability reasons are judged for the given device (which may be hypothetical, e.g. an sm90
asked about from a laptop); availability reasons (a missing package) for this machine.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from anyattn.config import AttentionSelectorConfig
from anyattn.declarations import AttentionBackend, platform_key
from anyattn.registry import (
    AttentionBackendEnum,
    backend_names,
    generation,
    get_backend_class,
    get_backend_path,
)
from anyattn.types import DeviceInfo

__all__ = [
    "ENV_VAR",
    "BackendVerdict",
    "Explanation",
    "NoBackendError",
    "clear_cache",
    "explain",
    "priority_list",
    "select_backend",
]

ENV_VAR = "ANYATTN_BACKEND"

# Prefix of the availability reason of a backend whose class cannot be imported.
_LOAD_FAILED = "cannot be loaded: "


class NoBackendError(ValueError):
    """No backend fits, or the requested one does not; the message lists every reason."""

    def __init__(self, message: str, explanation: Explanation) -> None:
        super().__init__(message)
        self.explanation = explanation


@dataclass(frozen=True)
class BackendVerdict:
    """One backend's verdict for one config.

    Attributes:
        name: registry name.
        priority: position in the platform's order (0 first).
        reasons: capability reasons (judged for the requested device).
        unavailable: why it cannot run on this machine (missing package), or None.
        not_automatic: why the selector does not take it without an explicit request (no
            rank for the platform, or `chosen_automatically` False for the config), or None.
    """

    name: str
    priority: int
    reasons: tuple[str, ...]
    unavailable: str | None
    not_automatic: str | None = None

    @property
    def fits(self) -> bool:
        return not self.reasons and self.unavailable is None

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "priority": self.priority,
            "fits": self.fits,
            "reasons": list(self.reasons),
            "unavailable": self.unavailable,
            "not_automatic": self.not_automatic,
        }


@dataclass(frozen=True)
class Explanation:
    """The selector's whole verdict for one config on one device.

    Attributes:
        chosen: the selected backend's name, or None when nothing fits.
        requested: the explicitly requested name, if any.
        requested_by: "argument" or the environment variable's name.
        verdicts: every registered backend, in priority order.
        hints: settings that would make a backend fit (when nothing does).
    """

    config: AttentionSelectorConfig
    device: DeviceInfo
    chosen: str | None
    requested: str | None
    requested_by: str | None
    verdicts: tuple[BackendVerdict, ...]
    hints: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, object]:
        config = {
            name: getattr(self.config, name)
            for name in AttentionSelectorConfig.__dataclass_fields__
        }
        config["dtype"] = str(config["dtype"]).removeprefix("torch.")
        config["attn_type"] = self.config.attn_type.value
        return {
            "device": str(self.device),
            "config": config,
            "chosen": self.chosen,
            "requested": self.requested,
            "requested_by": self.requested_by,
            "backends": [v.to_dict() for v in self.verdicts],
            "hints": list(self.hints),
        }

    def format_reasons(self) -> str:
        """One line per backend with its reasons, for error messages and logs."""
        lines = []
        for v in self.verdicts:
            why = list(v.reasons)
            if v.unavailable:
                why.append(f"not available here: {v.unavailable}")
            verdict = "; ".join(why) if why else "fits"
            if v.fits and v.not_automatic:
                verdict += f", taken only on request ({v.not_automatic})"
            lines.append(f"  {v.name}: {verdict}")
        return "\n".join(lines)


def _ranked(
    device: DeviceInfo, use_mla: bool = False
) -> list[tuple[str, type[AttentionBackend] | str]]:
    """Every registered backend (its class, or why it cannot be loaded) in the order tried on
    `device`: those with a rank for the platform first, and among them the backends of the
    config's kind (MLA or not) before the others, each by declared rank; then those without a
    rank. Ties keep registration order."""
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
        declared = cls.priority.get(key)
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
    if key not in cls.priority:
        not_automatic = f"declares no priority for {key}"
    elif not cls.chosen_automatically(config, device):
        not_automatic = "not chosen automatically for this config"
    return BackendVerdict(
        name,
        position,
        tuple(cls.validate_configuration(config, device)),
        cls.get_unavailable_reason(),
        not_automatic,
    )


def _verdicts(config: AttentionSelectorConfig, device: DeviceInfo) -> tuple[BackendVerdict, ...]:
    return tuple(
        _judge(name, cls, i, config, device)
        for i, (name, cls) in enumerate(_ranked(device, config.use_mla))
    )


def _hints(
    config: AttentionSelectorConfig, device: DeviceInfo, verdicts: tuple[BackendVerdict, ...]
) -> tuple[str, ...]:
    """Single changes to the request that would make some backend fit."""
    hints: list[str] = []
    for v in verdicts:
        if v.fits and v.not_automatic:
            hints.append(f"{v.name} fits this config when requested explicitly ({v.not_automatic})")
        # A backend that cannot be imported has no declarations to judge: it may not fit.
        if not v.reasons and v.unavailable and not v.unavailable.startswith(_LOAD_FAILED):
            hints.append(f"{v.name} fits this config but is not available here: {v.unavailable}")
    variations: list[tuple[str, dict[str, object]]] = []
    if config.kv_cache_dtype != "auto":
        variations.append(("kv_cache_dtype='auto'", {"kv_cache_dtype": "auto"}))
    if config.use_per_head_quant_scales and config.kv_cache_dtype in (
        "auto",
        "float16",
        "bfloat16",
    ):
        variations.append(("kv_cache_dtype='fp8'", {"kv_cache_dtype": "fp8"}))
    if config.block_size is not None:
        variations.append(("block_size=None (the backend's preferred size)", {"block_size": None}))
    for dtype_name in ("bfloat16", "float16", "float32"):
        if str(config.dtype) != f"torch.{dtype_name}":
            variations.append((f"dtype={dtype_name}", {"dtype": dtype_name}))
    for flag in (
        "has_sink", "has_sliding_window", "has_alibi", "has_logits_soft_cap", "use_non_causal",
        "use_per_head_quant_scales", "use_batch_invariant", "needs_lse", "use_sparse", "use_mla",
    ):  # fmt: skip
        if getattr(config, flag):
            variations.append((f"{flag}=False", {flag: False}))
    for label, change in variations:
        try:
            variant = config.replace(**change)
        except ValueError:
            continue
        fitting = [v.name for v in _verdicts(variant, device) if v.fits and not v.not_automatic]
        if fitting:
            hints.append(f"with {label}, {fitting[0]} would fit")
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
    if isinstance(backend, AttentionBackendEnum):
        return backend.name, "argument"
    if backend is not None:
        return backend, "argument"
    from_env = os.environ.get(ENV_VAR, "").strip()
    return (from_env, ENV_VAR) if from_env else (None, None)


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
    hints = () if chosen is not None else _hints(config, device, verdicts)
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
            defaults to this machine's first GPU, else the CPU.
        backend: an explicitly requested backend name (else `ANYATTN_BACKEND`, if set).

    Raises:
        ValueError: `backend` names no registered backend (the message lists them).
    """
    if not isinstance(config, AttentionSelectorConfig):
        raise TypeError(
            f"explain: config must be an AttentionSelectorConfig (got {type(config).__name__})."
        )
    return _explain_cached(config, _device_info(device), *_requested_name(backend), generation())


def select_backend(
    config: AttentionSelectorConfig,
    device: DeviceInfo | str | torch.device | None = None,
    backend: str | AttentionBackendEnum | None = None,
) -> type:
    """The backend class to use for `config` on `device`.

    Args:
        config: what the layer needs.
        device: where it will run (`DeviceInfo`, `torch.device`, or "cpu" / "cuda" / "sm90");
            defaults to this machine's first GPU, else the CPU.
        backend: a backend name to use instead of the platform's order (else
            `ANYATTN_BACKEND`).

    Returns:
        The `AttentionBackend` subclass.

    Raises:
        NoBackendError: nothing fits, or the requested backend does not fit; the message lists
            every backend with its reasons, and hints at a setting that would make one fit.
        ValueError: the requested name is unknown (the message lists the valid ones).
    """
    result = explain(config, device, backend)
    if result.chosen is not None:
        return get_backend_class(result.chosen)
    if result.requested is not None:
        verdict = next(v for v in result.verdicts if v.name == result.requested)
        why = list(verdict.reasons) + (
            [f"not available here: {verdict.unavailable}"] if verdict.unavailable else []
        )
        message = (
            f"select_backend: requested backend {result.requested} (from {result.requested_by}) "
            f"cannot serve this config on {result.device}: {'; '.join(why)}. Remove the request "
            f"to let the selector choose, or change the config.\nAll backends:\n"
            f"{result.format_reasons()}"
        )
    else:
        message = (
            f"select_backend: no backend fits this config on {result.device}.\n"
            f"{result.format_reasons()}\nHints:\n" + "\n".join(f"  {h}" for h in result.hints)
        )
    raise NoBackendError(message, result)


def clear_cache() -> None:
    """Forget cached selections (after registering backends or installing packages)."""
    _explain_cached.cache_clear()
