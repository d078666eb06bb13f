"""Unpack staged wheels into /tmp/gpusite on a GPU machine with no package index.

What arrives is wheels, or bundles of unpacked wheels in one xz-compressed tar (`<name>.tar.xz`,
made by `benchmarks/pack_wheels.py`). Either may be too large for one transfer: it arrives as
parts (`<name>.partNN`) spread over the folders `.gpu-wheels/*/`, one folder per transfer, each
with a `manifest.json` naming every wheel's or bundle's parts and sha256. Each run copies the
parts present here into /tmp/gw (kept between transfers while the machine stays up) and unpacks
every wheel or bundle whose parts have all arrived and whose sha256 matches; those already
unpacked are skipped. So transfers can come in any order, and a
command can use what has arrived so far (FlashInfer before FlashAttention-4, say).

Run from the repository root: `python3 benchmarks/unpack_wheels.py` (prints what it did).
`benchmarks/gpu_sweep.sh` and `benchmarks/measured_selection_gpu.sh` run it when `.gpu-wheels`
exists, and put /tmp/gpusite on PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import zipfile
from pathlib import Path

STAGED, PARTS, SITE = Path(".gpu-wheels"), Path("/tmp/gw"), Path("/tmp/gpusite")


def _publish(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: runs started side by side (benchmarks/gpu_verify.sh)
    never read a half-written part or manifest."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, path)


def main() -> None:
    PARTS.mkdir(exist_ok=True)
    SITE.mkdir(exist_ok=True)
    manifest: dict[str, dict] = {}
    for folder in sorted(p for p in STAGED.glob("*") if p.is_dir()):
        for path in folder.iterdir():
            if path.name == "manifest.json":
                manifest.update(json.loads(path.read_text()))
            elif not (PARTS / path.name).exists():
                _publish(PARTS / path.name, path.read_bytes())
    known = PARTS / "manifest.json"
    if known.exists():
        manifest = {**json.loads(known.read_text()), **manifest}
    _publish(known, json.dumps(manifest).encode())
    for wheel, meta in sorted(manifest.items()):
        done = SITE / f".unpacked-{wheel}"
        parts = [PARTS / name for name in meta["parts"]]
        if done.exists():
            continue
        if not all(p.exists() for p in parts):
            print(f"waiting for parts of {wheel}")
            continue
        data = b"".join(p.read_bytes() for p in parts)
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise SystemExit(f"unpack_wheels: {wheel} is corrupt (sha256 mismatch)")
        (PARTS / wheel).write_bytes(data)
        if wheel.endswith(".tar.xz"):
            with tarfile.open(PARTS / wheel, "r:xz") as archive:
                # the "data" filter (Python 3.11.4+) refuses members that would land outside SITE
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                archive.extractall(SITE, **safe)
        else:
            with zipfile.ZipFile(PARTS / wheel) as archive:
                archive.extractall(SITE)
        done.touch()
        print(f"unpacked {wheel}")


if __name__ == "__main__":
    main()
