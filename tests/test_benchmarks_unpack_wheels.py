"""`benchmarks/unpack_wheels.py`: wheels staged as parts over several folders are unpacked once
all their parts have arrived, in any order, and a corrupt wheel is refused; bundles packed by
`benchmarks/pack_wheels.py` unpack to the wheels' files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "unpack_wheels.py"
PACK = SCRIPT.with_name("pack_wheels.py")


@pytest.fixture
def unpack(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("unpack_wheels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "STAGED", tmp_path / "staged")
    monkeypatch.setattr(module, "PARTS", tmp_path / "parts")
    monkeypatch.setattr(module, "SITE", tmp_path / "site")
    return module


def _stage(tmp_path: Path, name: str, files: dict[str, bytes], folders: list[str]) -> dict:
    """A wheel holding `files`, cut into one part per folder of `folders`; its manifest entry."""
    wheel = tmp_path / name
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    data = wheel.read_bytes()
    size = -(-len(data) // len(folders))
    parts = []
    for k, folder in enumerate(folders):
        part = f"{name}.part{k:02d}"
        target = tmp_path / "staged" / folder
        target.mkdir(parents=True, exist_ok=True)
        (target / part).write_bytes(data[k * size : (k + 1) * size])
        parts.append(part)
    return {name: {"sha256": hashlib.sha256(data).hexdigest(), "parts": parts}}


def test_a_wheel_is_unpacked_once_all_its_parts_have_come(unpack, tmp_path):
    manifest = _stage(tmp_path, "a-1.0-py3-none-any.whl", {"a/__init__.py": b"A = 1\n"}, ["p2"])
    manifest |= _stage(
        tmp_path, "b-1.0-py3-none-any.whl", {"b/x.py": b"B = 2\n" * 50}, ["p1", "p2"]
    )
    (tmp_path / "staged" / "p2" / "manifest.json").write_text(json.dumps(manifest))
    first = tmp_path / "staged" / "p1"
    held = tmp_path / "held"
    first.rename(held)  # the first transfer brings p2 only
    unpack.main()
    assert (tmp_path / "site" / "a" / "__init__.py").read_bytes() == b"A = 1\n"
    assert not (tmp_path / "site" / "b").exists()
    (tmp_path / "staged" / "p2").rename(tmp_path / "p2-gone")  # the next brings p1 alone
    held.rename(first)
    unpack.main()
    assert (tmp_path / "site" / "b" / "x.py").read_bytes() == b"B = 2\n" * 50


def test_a_corrupt_wheel_is_refused(unpack, tmp_path):
    manifest = _stage(tmp_path, "c-1.0-py3-none-any.whl", {"c.py": b"C = 3\n"}, ["p1"])
    manifest["c-1.0-py3-none-any.whl"]["sha256"] = "0" * 64
    (tmp_path / "staged" / "p1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match="corrupt"):
        unpack.main()
    assert not (tmp_path / "site" / "c.py").exists()


def test_packed_bundles_unpack_across_transfers(unpack, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = {"big/data.bin": random.Random(0).randbytes(8000), "big/__init__.py": b"X = 1\n"}
    for name, files in [
        ("big-1.0-py3-none-any.whl", payload),
        ("d-1.0-py3-none-any.whl", {"d.py": b"D = 4\n"}),
    ]:
        with zipfile.ZipFile(wheels / name, "w") as archive:
            for path, data in files.items():
                archive.writestr(path, data)
    subprocess.run(
        [sys.executable, str(PACK), "--mib", "0.004", "--out", str(tmp_path / "staged"),
         "--bundle", f"first={wheels}/big-*.whl", "--bundle", f"second={wheels}/d-*.whl"],
        check=True, capture_output=True,
    )  # fmt: skip
    folders = sorted((tmp_path / "staged").iterdir())
    assert len(folders) >= 2
    for folder in folders:
        assert sum(p.stat().st_size for p in folder.iterdir() if p.suffix != ".json") <= 4194
    unpack.main()
    assert (tmp_path / "site" / "big" / "data.bin").read_bytes() == payload["big/data.bin"]
    assert (tmp_path / "site" / "d.py").read_bytes() == b"D = 4\n"
