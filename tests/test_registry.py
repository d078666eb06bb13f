"""anyattn.registry: built-in names, overrides, added names, entry-point plugins."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from anyattn import registry, selector
from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig
from anyattn.registry import (
    ENTRY_POINT_GROUP,
    AttentionBackendEnum,
    backend_names,
    get_backend_class,
    get_backend_path,
    register_backend,
    unregister_backend,
)
from anyattn.types import DeviceInfo

PLUGIN_PKG = Path(__file__).parent / "plugin_pkg"
TORCH_PATH = "anyattn.backends.torch_attn:TorchAttentionBackend"


def test_builtin_members():
    assert AttentionBackendEnum.TORCH.value == TORCH_PATH
    assert backend_names()[0] == "TORCH"
    assert get_backend_path("TORCH") == TORCH_PATH
    assert get_backend_path("torch") == TORCH_PATH
    assert get_backend_path(AttentionBackendEnum.TORCH) == TORCH_PATH


def test_builtin_torch_class_imports():
    cls = get_backend_class("TORCH")
    assert cls.__name__ == "TorchAttentionBackend" and cls.get_name() == "TORCH"
    assert issubclass(cls, AttentionBackend)
    assert AttentionBackendEnum.TORCH.get_class() is cls
    assert get_backend_class("torch") is cls


def test_override_a_member(make_backend):
    fake = make_backend("TORCH")
    try:
        assert register_backend("TORCH", fake) is fake
        assert get_backend_class("TORCH") is fake
        assert AttentionBackendEnum.TORCH.get_path() is fake
        assert AttentionBackendEnum.TORCH.get_class() is fake
        assert backend_names().count("TORCH") == 1
    finally:
        unregister_backend("TORCH")
    assert AttentionBackendEnum.TORCH.get_path() == TORCH_PATH
    assert get_backend_class("TORCH") is not fake


def test_add_names_by_call(register):
    register("torch_alias", TORCH_PATH)
    register("DOTTED_ALIAS", "anyattn.backends.torch_attn.TorchAttentionBackend")
    names = backend_names()
    # Built-ins first, then added names in the order they were added, upper-cased.
    assert names[0] == "TORCH"
    assert names.index("TORCH_ALIAS") < names.index("DOTTED_ALIAS")
    torch_cls = get_backend_class("TORCH")
    assert get_backend_class("torch_alias") is torch_cls
    assert get_backend_class("DOTTED_ALIAS") is torch_cls


def test_add_name_by_decorator(make_backend):
    fake = make_backend("DECORATED")
    try:
        decorated = register_backend("decorated")(fake)
        assert decorated is fake
        assert "DECORATED" in backend_names()
        assert get_backend_class("Decorated") is fake
    finally:
        unregister_backend("DECORATED")
    assert "DECORATED" not in backend_names()


def test_registering_clears_the_selection_cache(make_backend, register):
    config = AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    before = selector.explain(config, DeviceInfo.cpu())
    assert selector.explain(config, DeviceInfo.cpu()) is before
    register("CACHE_PROBE", make_backend("CACHE_PROBE"))
    after = selector.explain(config, DeviceInfo.cpu())
    assert after is not before
    assert "CACHE_PROBE" in [v.name for v in after.verdicts]
    unregister_backend("CACHE_PROBE")
    assert "CACHE_PROBE" not in [v.name for v in selector.explain(config).verdicts]


def test_unknown_name_lists_valid_ones(register, make_backend):
    register("EXTRA", make_backend("EXTRA"))
    with pytest.raises(ValueError) as raised:
        get_backend_class("NOPE")
    message = str(raised.value)
    assert message.startswith("backend: unknown backend name (got 'NOPE', expected one of TORCH, ")
    assert "EXTRA" in message
    assert f"'{ENTRY_POINT_GROUP}' entry-point group" in message


@pytest.mark.parametrize("name", ["", None, 3])
def test_bad_names(name):
    with pytest.raises(TypeError, match=r"backend name must be a non-empty str \(got"):
        get_backend_class(name)
    with pytest.raises(TypeError, match="register_backend: backend name must be a non-empty str"):
        register_backend(name, TORCH_PATH)


def test_bad_targets():
    with pytest.raises(ValueError, match=r"target must be 'module:Class' or a class \(got 'x'\)"):
        register_backend("BAD", "x")
    with pytest.raises(TypeError, match=r"target must be 'module:Class' or a class \(got int\)"):
        register_backend("BAD", 42)
    assert "BAD" not in backend_names()


def test_unimportable_and_wrong_classes(register):
    register("MISSING", "anyattn_no_such_module:Backend")
    with pytest.raises(ImportError) as raised:
        get_backend_class("MISSING")
    assert str(raised.value).startswith(
        "backend MISSING: cannot import its class (got path 'anyattn_no_such_module:Backend': "
    )
    register("NO_ATTR", "anyattn.backend:NoSuchBackend")
    with pytest.raises(ImportError, match="backend NO_ATTR: cannot import its class"):
        get_backend_class("NO_ATTR")
    register("NOT_A_BACKEND", "anyattn.config:BatchLimits")
    with pytest.raises(TypeError) as raised:
        get_backend_class("NOT_A_BACKEND")
    assert str(raised.value) == (
        "backend NOT_A_BACKEND: registered class is not an AttentionBackend "
        "(got anyattn.config.BatchLimits)."
    )


# --- entry-point plugins ---------------------------------------------------------------------


def _plugin_project() -> dict:
    return tomllib.loads((PLUGIN_PKG / "pyproject.toml").read_text())["project"]


@pytest.fixture
def plugin_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A directory laid out as `pip install --target` lays out tests/plugin_pkg, on sys.path.

    The entry points are copied from the plugin's pyproject, so the test checks the
    declaration a real plugin would ship.
    """
    project = _plugin_project()
    entry_points = project["entry-points"][ENTRY_POINT_GROUP]
    shutil.copytree(PLUGIN_PKG / "anyattn_example_plugin", tmp_path / "anyattn_example_plugin")
    dist_info = tmp_path / f"anyattn_example_plugin-{project['version']}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    with _on_sys_path(tmp_path, monkeypatch):
        yield tmp_path


@contextlib.contextmanager
def _on_sys_path(site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Put an installed plugin on sys.path; forget its registrations and module afterwards."""
    monkeypatch.syspath_prepend(str(site))  # also invalidates the import caches
    try:
        yield site
    finally:
        for name in _plugin_project()["entry-points"][ENTRY_POINT_GROUP]:
            unregister_backend(name)
        sys.modules.pop("anyattn_example_plugin", None)


def test_plugin_found_by_reload(plugin_site):
    assert "EXAMPLE_PLUGIN" not in backend_names()
    registry.reload_plugins()
    assert backend_names()[-1] == "EXAMPLE_PLUGIN"
    assert get_backend_path("example_plugin") == "anyattn_example_plugin:ExamplePluginBackend"
    cls = get_backend_class("EXAMPLE_PLUGIN")
    assert cls.__name__ == "ExamplePluginBackend" and cls.get_name() == "EXAMPLE_PLUGIN"
    # The plugin takes part in selection at the rank it declares for the CPU (after the built-in
    # ones there), and can be requested.
    config = AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    verdicts = selector.explain(config, DeviceInfo.cpu()).verdicts
    names = [v.name for v in verdicts]
    assert names[:3] == ["TORCH", "FLEX_ATTENTION", "EXAMPLE_PLUGIN"]
    assert verdicts[2].fits and verdicts[2].not_automatic is None
    assert selector.select_backend(config, DeviceInfo.cpu(), backend="example_plugin") is cls
    with pytest.raises(selector.NoBackendError, match="dtype bfloat16 not supported"):
        selector.select_backend(config.replace(dtype="bfloat16"), backend="EXAMPLE_PLUGIN")


def test_reload_clears_the_selection_cache(plugin_site):
    config = AttentionSelectorConfig(head_size=64, dtype=torch.float32)
    before = selector.explain(config, DeviceInfo.cpu())
    registry.reload_plugins()
    after = selector.explain(config, DeviceInfo.cpu())
    assert after is not before
    assert "EXAMPLE_PLUGIN" not in [v.name for v in before.verdicts]
    assert "EXAMPLE_PLUGIN" in [v.name for v in after.verdicts]


def test_explicit_registration_wins_over_plugin(plugin_site, make_backend):
    mine = make_backend("EXAMPLE_PLUGIN")
    register_backend("EXAMPLE_PLUGIN", mine)
    registry.reload_plugins()
    assert get_backend_class("EXAMPLE_PLUGIN") is mine


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools")
def test_plugin_installed_by_pip(tmp_path, monkeypatch):
    """The real thing: pip builds and installs the plugin package into a --target directory."""
    source = tmp_path / "src"
    site = tmp_path / "site"
    # Build from a copy so that pip's build files stay out of the source tree.
    shutil.copytree(PLUGIN_PKG, source)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    command += ["--no-build-isolation", "--target", str(site), str(source)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    with _on_sys_path(site, monkeypatch):
        registry.reload_plugins()
        assert get_backend_class("EXAMPLE_PLUGIN").__name__ == "ExamplePluginBackend"
