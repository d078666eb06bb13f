"""Packaging: the package's dependencies are ranges a user's own torch satisfies, and the exact
versions this project's machines install live in constraints.txt, one pin per dependency."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    return [*project["dependencies"], *(r for extra in extras for r in extra)]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[]", requirement, maxsplit=1)[0].lower()


def test_dependencies_are_ranges_not_pins():
    pinned = [r for r in _requirements() if "==" in r]
    assert not pinned, f"pin these in constraints.txt instead: {pinned}"


@pytest.mark.parametrize(
    ("name", "version"),
    [("torch", "2.11.0"), ("torch", "2.13.0"), ("numpy", "2.5.2"), ("numpy", "2.4.6"),
     ("transformers", "5.17.0"), ("transformers", "5.24.0"), ("triton", "3.6.0")],
)  # fmt: skip
def test_the_ranges_admit_the_versions_the_project_runs_on(name, version):
    # the H200 machine: torch 2.11, numpy 2.5.2, transformers 5.17; CPU: the constraints
    ranges = {_name(r): r for r in _requirements()}
    specifier = SpecifierSet(ranges[name][len(name) :])
    assert specifier.contains(version, prereleases=True), (ranges[name], version)


def test_constraints_pin_every_dependency_exactly():
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    missing = sorted(
        {_name(r) for r in _requirements()} - set(pins) - {"flashinfer-python", "flash-attn-4"}
    )
    assert not missing, f"constraints.txt lacks pins for {missing}"
    assert pins["torch"] == "2.13.0"
