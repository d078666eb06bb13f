"""The on-disk cache of measured selections: one readable JSON file per measured layer, used
only when its whole key (device, driver, package versions, a hash of anyattn's source, the
config, its record and the limits) equals the current one; any other file is measured again
and overwritten, never trusted (docs/measured_selection.md, "The cache").
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import torch

import anyattn
from anyattn.backend import AttentionBackend

__all__ = [
    "CACHE_DIR_ENV", "FORMAT", "NO_CACHE_ENV", "cache_dir", "cache_file", "device_identity",
    "load_entry", "make_key", "source_hash", "store_entry",
]  # fmt: skip

CACHE_DIR_ENV = "ANYATTN_CACHE_DIR"
NO_CACHE_ENV = "ANYATTN_NO_MEASURE_CACHE"
FORMAT = 1
_PACKAGES = (
    "anyattn", "torch", "triton", "flashinfer-python", "flash-attn", "flash-attn-4",
    "nvidia-cutlass-dsl",
)  # fmt: skip


def cache_dir() -> Path | None:
    """The cache's root folder, or None when `ANYATTN_NO_MEASURE_CACHE` is set (not 0/empty)."""
    if os.environ.get(NO_CACHE_ENV, "").strip() not in ("", "0"):
        return None
    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "anyattn"


def _first_line(path: str, prefix: str = "") -> str | None:
    """The first line of `path` that starts with `prefix`, stripped (after its ":" when there is
    a prefix); None where the file cannot be read or has no such line."""
    try:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                if line.startswith(prefix):
                    return (line.partition(":")[2] if prefix else line).strip() or None
    except OSError:
        pass
    return None


def device_identity(device: torch.device) -> dict[str, object]:
    """What identifies the hardware and its software: name, capability, driver, CUDA."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {
            "type": "cuda",
            "name": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
            "driver": _first_line("/proc/driver/nvidia/version"),
            "cuda": torch.version.cuda,
        }
    name = _first_line("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    return {"type": device.type, "name": name, "threads": torch.get_num_threads()}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def source_hash() -> str:
    """sha256 over every source file of the installed `anyattn` package, by relative path (the
    package's source does not change while a process runs)."""
    root = Path(anyattn.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def make_key(
    device: torch.device, backends: list[type[AttentionBackend]], config: dict[str, object],
    layer: dict[str, object], limits: dict[str, object],
) -> dict[str, object]:  # fmt: skip
    """The whole key of a measurement (JSON-ready)."""
    return {
        "format": FORMAT, "device": device_identity(device),
        "versions": {package: _version(package) for package in _PACKAGES},
        "backends": [b.get_name() for b in backends], "source_sha256": source_hash(),
        "config": config, "layer": layer, "limits": limits,
    }  # fmt: skip


def cache_file(key: dict[str, object]) -> Path | None:
    """Where the entry for `key` lives, or None when the cache is off."""
    root = cache_dir()
    if root is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return root / "measure" / f"{digest}.json"


def load_entry(key: dict[str, object]) -> tuple[dict[str, object] | None, str]:
    """The stored result for `key`, or None and why none is used ("no entry", "corrupt", ...).
    Never raises for a bad file."""
    path = cache_file(key)
    if path is None:
        return None, f"cache off ({NO_CACHE_ENV} is set)"
    if not path.exists():
        return None, f"no entry in {path.parent}"
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"{path} is unreadable or not JSON ({type(error).__name__}); measured again"
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None, f"{path} has another format; measured again"
    if entry.get("key") != key:
        stored = entry.get("key")
        differs = sorted(k for k in key if not isinstance(stored, dict) or stored.get(k) != key[k])
        return None, f"{path} was measured with another {', '.join(differs)}; measured again"
    result = entry.get("result")
    if not isinstance(result, dict):
        return None, f"{path} holds no result; measured again"
    return result, f"used {path}"


def store_entry(key: dict[str, object], result: dict[str, object]) -> tuple[Path | None, str]:
    """Write the entry atomically; returns its path (None when off or unwritable) and a note."""
    path = cache_file(key)
    if path is None:
        return None, f"cache off ({NO_CACHE_ENV} is set)"
    entry = {"format": FORMAT, "key": key, "result": result}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entry, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(partial, path)
    except OSError as error:
        return None, f"not saved: cannot write {path} ({error.strerror or error})"
    return path, f"saved to {path}"
