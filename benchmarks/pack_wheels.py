"""Pack wheels for a GPU machine that has no package index, in as few transfers as fit.

Each bundle is a group of wheels unpacked together into one xz-compressed tar (FlashInfer's
62 MB wheel becomes 16 MB: most of it is CUDA source text). The bundles' bytes are then laid
end to end, in the order given, and cut into folders `.gpu-wheels/t1`, `t2`, ... of at most
`--mib` MiB each, one folder per transfer, each with a `manifest.json` naming every bundle's
parts and sha256. `benchmarks/unpack_wheels.py` on the GPU machine unpacks each bundle once all
its parts have arrived, so the first bundle given is usable after the fewest transfers.

    python3 benchmarks/pack_wheels.py --mib 58 \
        --bundle flashinfer=DIR/flashinfer_python-*.whl,DIR/apache_tvm_ffi-*.whl \
        --bundle fa4=DIR/flash_attn_4-*.whl,DIR/nvidia_cutlass_dsl*.whl,...
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path


def _bundle(wheels: list[Path]) -> bytes:
    """The wheels' files in one tar, xz-compressed."""
    with tempfile.TemporaryDirectory() as tmp:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(tmp)
        packed = io.BytesIO()  # compressed as the tar is written: no uncompressed copy held
        with tarfile.open(fileobj=packed, mode="w:xz", preset=9) as tar:
            tar.add(tmp, arcname=".")
        return packed.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, required=True, help="largest transfer, MiB")
    parser.add_argument("--bundle", action="append", required=True, help="NAME=WHEEL,WHEEL,...")
    parser.add_argument("--out", type=Path, default=Path(".gpu-wheels"))
    args = parser.parse_args()
    budget = int(args.mib * 2**20)
    if budget < 1:
        raise SystemExit(f"pack_wheels: --mib must be positive (got {args.mib})")
    shutil.rmtree(args.out, ignore_errors=True)
    manifest, folder, used = {}, 1, 0
    for spec in args.bundle:
        name, _, patterns = spec.partition("=")
        wheels = [Path(p) for pattern in patterns.split(",") for p in sorted(glob.glob(pattern))]
        if not wheels:
            raise SystemExit(f"pack_wheels: bundle {name!r} matches no wheel")
        data, archive = _bundle(wheels), f"{name}.tar.xz"
        manifest[archive] = {"sha256": hashlib.sha256(data).hexdigest(), "parts": []}
        while data:
            if used == budget:
                folder, used = folder + 1, 0
            part = f"{archive}.part{len(manifest[archive]['parts']):02d}"
            target = args.out / f"t{folder}"
            target.mkdir(parents=True, exist_ok=True)
            piece, data = data[: budget - used], data[budget - used :]
            (target / part).write_bytes(piece)
            used += len(piece)
            manifest[archive]["parts"].append(part)
        print(f"{archive}: {len(manifest[archive]['parts'])} part(s), {len(wheels)} wheel(s)")
    for target in sorted(args.out.glob("t*")):
        (target / "manifest.json").write_text(json.dumps(manifest, indent=1))
        size = sum(p.stat().st_size for p in target.iterdir()) / 2**20
        print(f"{target}: {size:.1f} MiB")


if __name__ == "__main__":
    main()
