"""Which FlashAttention versions are installed, and which one serves a layer.

`detect` imports each generation's module (newest first, where `FlashAttnVersion.modules`
names them) and describes each entry point by its signature (`flash_attn_entry_point`);
`installed_interfaces` keeps those that can run paged varlen attention, and
`declared_interfaces` is what the FLASH_ATTN backend declares: those, else FA4 as its pinned
extra installs it. `choose_interface` picks the newest version that serves a
`FlashAttnRequest`.

FA4 is declared from its public varlen call but run through the forward that call wraps
(`flash_attn.cute.interface._flash_attn_fwd`) when that takes `out`: the kernel then writes the
layer's output rows directly, where the public call would return a new tensor to copy.

Nothing here imports a FlashAttention module until `detect()` is first called; the result is
cached for the process (tests replace that function).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from anyattn.backends.flash_attn_entry_point import (
    PIP_COMMAND,
    FlashAttnInterface,
    FlashAttnRequest,
    FlashAttnVersion,
    interface_from_function,
    reference_fa4_interface,
)

__all__ = [
    "Detection",
    "choose_interface",
    "declared_interfaces",
    "detect",
    "fa4_forward_interface",
    "installed_interfaces",
    "unavailable_reason",
]


@dataclass(frozen=True, slots=True)
class Detection:
    """What importing each FlashAttention found.

    Attributes:
        interfaces: one per importable version, newest first (usable or not).
        errors: `"<module>: <why not importable>"` for the versions not found.
    """

    interfaces: tuple[FlashAttnInterface, ...]
    errors: tuple[str, ...]


def _detect_version(version: FlashAttnVersion) -> FlashAttnInterface | str:
    problems = []
    for module_name in version.modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            problems.append(f"{module_name}: not installed")
            continue
        except Exception as error:  # CUDA extensions fail in many ways (OSError, RuntimeError)
            problems.append(f"{module_name}: {type(error).__name__}: {error}")
            continue
        found = [
            interface_from_function(version, module_name, entry, getattr(module, entry))
            for entry in version.entries
            if callable(getattr(module, entry, None))
        ]
        if not found:
            problems.append(f"{module_name} has no {' / '.join(version.entries)}")
            continue
        chosen = next((i for i in found if not i.missing_essentials()), found[0])
        if version is FlashAttnVersion.FA4 and not chosen.missing_essentials():
            chosen = _fa4_writing_out(chosen)
        return chosen
    return "; ".join(problems)


# FA4's public varlen call allocates its output (it has no `out`), which cost a copy into the
# layer's output per call: 1.18x the direct call at prefill 16 x 1024 on the H200. The forward
# it runs, `flash_attn.cute.interface._flash_attn_fwd` (private, pinned by the extra), takes
# `out`. These are the arguments FLASH_ATTN passes to it.
_FA4_FORWARD = ("flash_attn.cute.interface", "_flash_attn_fwd")
_FA4_FORWARD_NEEDS = frozenset(
    "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_k page_table "
    "softmax_scale causal window_size_left window_size_right learnable_sink softcap "
    "return_lse out".split()
)


def _fa4_writing_out(public: FlashAttnInterface) -> FlashAttnInterface:
    """`public` (FA4's varlen call), run through FA4's forward so that it writes `out` in place;
    `public` itself when that forward is missing or takes other arguments."""
    module_name, entry = _FA4_FORWARD
    try:
        forward = getattr(importlib.import_module(module_name), entry)
        params = frozenset(inspect.signature(forward).parameters)
    except Exception:  # not there, or not introspectable: keep the public call
        return public
    if not _FA4_FORWARD_NEEDS <= params:
        return public
    return fa4_forward_interface(public, forward)


def fa4_forward_interface(
    public: FlashAttnInterface, forward: Callable[..., Any]
) -> FlashAttnInterface:
    """FA4 declared from its public varlen call (`public`), called through its forward
    (`_flash_attn_fwd`, which names the window's sides apart and also takes `out`)."""

    def varlen_into_out(*, window_size: tuple[Any, Any] = (None, None), **kwargs: Any):
        result = forward(
            window_size_left=window_size[0], window_size_right=window_size[1], **kwargs
        )
        return result[0], result[1]

    module_name, entry = _FA4_FORWARD
    return FlashAttnInterface(
        public.version, module_name, entry, public.params | {"out"}, varlen_into_out
    )


@functools.cache
def detect() -> Detection:
    """Import each FlashAttention once and describe what it offers (cached)."""
    interfaces, errors = [], []
    for version in sorted(FlashAttnVersion, reverse=True):
        found = _detect_version(version)
        (errors if isinstance(found, str) else interfaces).append(found)
    return Detection(tuple(interfaces), tuple(errors))


def installed_interfaces() -> tuple[FlashAttnInterface, ...]:
    """The installed entry points that can run paged varlen attention, newest first."""
    return tuple(i for i in detect().interfaces if not i.missing_essentials())


def declared_interfaces(
    installed: Iterable[FlashAttnInterface] | None = None,
) -> tuple[FlashAttnInterface, ...]:
    """What the backend declares: the usable installed versions, else FA4 as its pinned extra
    installs it (so that one can ask what FLASH_ATTN would do before installing it)."""
    usable = tuple(installed_interfaces() if installed is None else installed)
    return usable or (reference_fa4_interface(),)


def unavailable_reason(installed: Iterable[FlashAttnInterface] | None = None) -> str | None:
    """Why no FlashAttention can run here (with the pip command), or None."""
    if tuple(installed_interfaces() if installed is None else installed):
        return None
    detection = detect()
    found = [f"{i.label}: {', '.join(i.missing_essentials())}" for i in detection.interfaces]
    problems = [p for error in detection.errors for p in error.split("; ")]
    missing = [p.removesuffix(": not installed") for p in problems if p.endswith("not installed")]
    others = [p for p in problems if not p.endswith("not installed")]
    if missing:
        others.append(f"{', '.join(missing)}: not installed")
    details = "; ".join([*found, *others]) or "nothing found"
    return f"no usable FlashAttention here ({details}). Install it with: {PIP_COMMAND}"


def choose_interface(
    interfaces: Iterable[FlashAttnInterface], request: FlashAttnRequest
) -> tuple[FlashAttnInterface | None, list[str]]:
    """The newest version that serves `request`, or None and `"<label>: <reasons>"` per version."""
    why = []
    for interface in sorted(interfaces, key=lambda i: -i.version):
        reasons = interface.reasons(request)
        if not reasons:
            return interface, []
        why.append(f"{interface.label}: {', '.join(reasons)}")
    return None, why
