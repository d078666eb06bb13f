"""Which backends exist and where their classes live, imported only when asked for.

Built-in backends are members of `AttentionBackendEnum`, whose values are lazy class paths
("module:Class"). `register_backend` overrides a member or adds a name; packages add backends
through the `anyattn.backends` entry-point group (name = backend name, value = "module:Class").
The override table is the only module-level mutable state in anyattn; `generation()` counts
its changes, so that caches of selections can tell when they are stale.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
from collections.abc import Callable
from typing import overload

from anyattn.declarations import AttentionBackend

__all__ = [
    "ENTRY_POINT_GROUP",
    "AttentionBackendEnum",
    "backend_names",
    "generation",
    "get_backend_class",
    "get_backend_path",
    "register_backend",
    "unregister_backend",
]

ENTRY_POINT_GROUP = "anyattn.backends"


class AttentionBackendEnum(enum.Enum):
    """Built-in backends and the class path of each (imported lazily)."""

    TORCH = "anyattn.backends.torch_attn:TorchAttentionBackend"
    FLEX_ATTENTION = "anyattn.backends.flex_attention:FlexAttentionBackend"
    TRITON = "anyattn.backends.triton_attn:TritonAttentionBackend"
    FLASHINFER = "anyattn.backends.flashinfer:FlashInferBackend"
    FLASH_ATTN = "anyattn.backends.flash_attn:FlashAttentionBackend"
    TORCH_MLA = "anyattn.backends.torch_mla:TorchMLABackend"
    TRITON_MLA = "anyattn.backends.triton_mla:TritonMLABackend"
    FLASHINFER_MLA = "anyattn.backends.flashinfer_mla:FlashInferMLABackend"

    def get_path(self) -> str:
        """The class path in use: a registered override, else the built-in one."""
        return _overrides.get(self.name, self.value)

    def get_class(self) -> type[AttentionBackend]:
        return get_backend_class(self.name)


# name -> "module:Class" or a class; overrides of members and names added at run time.
_overrides: dict[str, str | type] = {}
_plugins_loaded = False
_generation = 0


def generation() -> int:
    """A number that changes whenever the registered backends may have changed."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1


def _load_plugins() -> None:
    """Read the `anyattn.backends` entry points once; explicit registrations win over them."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            _overrides.setdefault(entry_point.name.upper(), entry_point.value)


def reload_plugins() -> None:
    """Read the entry points again (after installing a plugin package at run time)."""
    global _plugins_loaded
    _plugins_loaded = False
    _load_plugins()
    _changed()


def backend_names() -> list[str]:
    """Every backend name: the built-in members in order, then added names in order."""
    _load_plugins()
    builtin = [member.name for member in AttentionBackendEnum]
    return builtin + [name for name in _overrides if name not in builtin]


def _check_name(name: object, api: str) -> str:
    if isinstance(name, AttentionBackendEnum):
        return name.name
    if not isinstance(name, str) or not name:
        raise TypeError(f"{api}: backend name must be a non-empty str (got {name!r}).")
    return name.upper()


def get_backend_path(name: str | AttentionBackendEnum) -> str | type:
    """The class path (or class) registered for `name`.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    key = _check_name(name, "get_backend_path")
    _load_plugins()
    if key in _overrides:
        return _overrides[key]
    if key in AttentionBackendEnum.__members__:
        return AttentionBackendEnum[key].value
    raise ValueError(
        f"backend: unknown backend name (got {name!r}, expected one of "
        f"{', '.join(backend_names())}). Register new backends with "
        f"anyattn.registry.register_backend or the '{ENTRY_POINT_GROUP}' entry-point group."
    )


def _import_class(path: str, name: str) -> type:
    module_name, sep, qualname = path.partition(":")
    if not sep:
        module_name, _, qualname = path.rpartition(".")
    try:
        obj: object = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as error:  # a plugin's import may fail in any way; report, never crash
        raise ImportError(
            f"backend {name}: cannot import its class (got path {path!r}: "
            f"{type(error).__name__}: {error})."
        ) from error
    if not isinstance(obj, type):
        raise TypeError(f"backend {name}: {path!r} is not a class (got {type(obj).__name__}).")
    return obj


def get_backend_class(name: str | AttentionBackendEnum) -> type[AttentionBackend]:
    """Import and return the backend class registered for `name` (case-insensitive)."""
    key = _check_name(name, "get_backend_class")
    target = get_backend_path(key)
    cls = target if isinstance(target, type) else _import_class(target, key)
    if not issubclass(cls, AttentionBackend):
        raise TypeError(
            f"backend {key}: registered class is not an AttentionBackend (got "
            f"{cls.__module__}.{cls.__qualname__})."
        )
    return cls


@overload
def register_backend(name: str | AttentionBackendEnum, target: str | type) -> str | type: ...
@overload
def register_backend(
    name: str | AttentionBackendEnum, target: None = None
) -> Callable[[type], type]: ...
def register_backend(name, target=None):
    """Point a backend name at a class: override a built-in member or add a new name.

    Use as a call, `register_backend("TORCH", "my.module:MyBackend")`, or as a decorator,
    `@register_backend("MY_BACKEND")` on an `AttentionBackend` subclass. Selection caches
    are invalidated. Names are case-insensitive and stored upper-case.
    """
    key = _check_name(name, "register_backend")
    _load_plugins()

    def register(cls_or_path: str | type) -> str | type:
        if isinstance(cls_or_path, str):
            if ":" not in cls_or_path and "." not in cls_or_path:
                raise ValueError(
                    f"register_backend: target must be 'module:Class' or a class (got "
                    f"{cls_or_path!r})."
                )
        elif not isinstance(cls_or_path, type):
            raise TypeError(
                f"register_backend: target must be 'module:Class' or a class (got "
                f"{type(cls_or_path).__name__})."
            )
        _overrides[key] = cls_or_path
        _changed()
        return cls_or_path

    return register if target is None else register(target)


def unregister_backend(name: str | AttentionBackendEnum) -> None:
    """Drop an override or an added name; a built-in member returns to its own class."""
    key = _check_name(name, "unregister_backend")
    _overrides.pop(key, None)
    _changed()
