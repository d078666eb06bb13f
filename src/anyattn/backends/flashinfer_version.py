"""Which FlashInfer the FLASHINFER backend runs on: the supported release range and the import.

FLASHINFER is tested on the releases `SUPPORTED_VERSIONS` names (the conformance kit on both
ends). Another release is used as it is, with a `FlashInferVersionWarning` at the first import.
`installed_flashinfer` reads package metadata only, so declarations work without CUDA.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
import warnings
from types import ModuleType

__all__ = [
    "PIP_COMMAND",
    "SUPPORTED_VERSIONS",
    "FlashInferVersionWarning",
    "import_flashinfer",
    "installed_flashinfer",
    "is_supported_version",
]

# The oldest and newest releases the conformance kit has run on (inclusive).
SUPPORTED_VERSIONS = ("0.7.2.post1", "0.7.4")
PIP_COMMAND = "pip install 'anyattn[flashinfer]'"
_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?$")


class FlashInferVersionWarning(UserWarning):
    """The installed FlashInfer is outside `SUPPORTED_VERSIONS`."""


def installed_flashinfer() -> tuple[bool, str | None]:
    """Whether `flashinfer` is importable here, and its distribution's version (None when it
    has no package metadata, e.g. a source tree), without importing it."""
    if importlib.util.find_spec("flashinfer") is None:
        return False, None
    try:
        return True, importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return True, None


def _release(version: str) -> tuple[int, int, int, int] | None:
    """`major.minor.patch[.postN]` (a local tag such as `+cu128` ignored) as a tuple that
    orders releases; None for anything else (a pre-release or dev build)."""
    match = _RELEASE.match(version.split("+", 1)[0])
    if match is None:
        return None
    major, minor, patch, post = match.groups()
    return int(major), int(minor), int(patch), int(post or 0)


def is_supported_version(version: str | None) -> bool:
    """Whether `version` is a release within `SUPPORTED_VERSIONS` (None: unknown, False)."""
    release = None if version is None else _release(version)
    if release is None:
        return False
    low, high = (_release(v) for v in SUPPORTED_VERSIONS)
    return low <= release <= high


@functools.cache
def import_flashinfer() -> ModuleType:
    """`import flashinfer`, warning once (`FlashInferVersionWarning`) when the installed
    release is outside `SUPPORTED_VERSIONS`.

    Raises:
        ImportError: FlashInfer is not installed (the message says how to install it).
    """
    importable, version = installed_flashinfer()
    if not importable:
        raise ImportError(f"FLASHINFER: flashinfer is not installed; {PIP_COMMAND}")
    import flashinfer  # optional and CUDA-only: imported when a builder first needs it

    if not is_supported_version(version):
        low, high = SUPPORTED_VERSIONS
        got = "an unknown version" if version is None else f"flashinfer-python {version}"
        warnings.warn(
            f"FLASHINFER is tested on flashinfer-python {low} to {high} (got {got}); using it "
            f"anyway. Run anyattn's conformance kit on it, or {PIP_COMMAND}.",
            FlashInferVersionWarning,
            stacklevel=2,
        )
    return flashinfer
