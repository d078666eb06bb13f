"""FLASHINFER's version policy on the CPU, with the installed version faked: releases within
`SUPPORTED_VERSIONS` import silently, any other (older, newer, a dev build, no metadata) imports
with a `FlashInferVersionWarning`, never a refusal; a missing FlashInfer is an ImportError that
says how to install it."""

from __future__ import annotations

import sys
import types
import warnings

import pytest

from anyattn.backends import flashinfer_version
from anyattn.backends.flashinfer_version import (
    PIP_COMMAND,
    SUPPORTED_VERSIONS,
    FlashInferVersionWarning,
    import_flashinfer,
    is_supported_version,
)


@pytest.fixture
def installed(monkeypatch):
    """`installed(version)`: a stand-in `flashinfer` module, installed at `version`."""
    module = types.ModuleType("flashinfer")

    def install(version: str | None, importable: bool = True) -> types.ModuleType:
        monkeypatch.setitem(sys.modules, "flashinfer", module)
        monkeypatch.setattr(
            flashinfer_version, "installed_flashinfer", lambda: (importable, version)
        )
        import_flashinfer.cache_clear()
        return module

    yield install
    import_flashinfer.cache_clear()


def test_the_range_is_the_two_tested_releases():
    assert SUPPORTED_VERSIONS == ("0.7.2.post1", "0.7.4")
    inside = ["0.7.2.post1", "0.7.2.post2", "0.7.3", "0.7.4", "0.7.3+cu128"]
    outside = ["0.7.2", "0.7.1", "0.6.9", "0.7.4.post1", "0.7.5", "0.8.0", "1.0.0",
               "0.7.3.dev1", "0.7.4rc1", "garbage", None]  # fmt: skip
    assert [v for v in inside if not is_supported_version(v)] == []
    assert [v for v in outside if is_supported_version(v)] == []


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_a_supported_release_imports_silently(installed, version):
    module = installed(version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert import_flashinfer() is module


@pytest.mark.parametrize("version", ["0.7.1", "0.7.5", "0.8.0", "0.7.3.dev1", None])
def test_another_release_imports_with_a_warning(installed, version):
    module = installed(version)
    with pytest.warns(FlashInferVersionWarning) as caught:
        assert import_flashinfer() is module
    message = str(caught[0].message)
    assert "tested on flashinfer-python 0.7.2.post1 to 0.7.4" in message
    assert (f"got flashinfer-python {version}" if version else "an unknown version") in message
    assert PIP_COMMAND in message
    with warnings.catch_warnings():  # once per process, not once per builder
        warnings.simplefilter("error")
        assert import_flashinfer() is module


def test_missing_flashinfer_is_an_import_error_that_says_how_to_install(installed):
    installed(None, importable=False)
    with pytest.raises(ImportError, match=r"flashinfer is not installed; pip install"):
        import_flashinfer()
