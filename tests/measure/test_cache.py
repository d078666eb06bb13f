"""The measurement cache: used when its whole key matches; corrupt files, other devices and
other versions are measured again and never trusted; off with ANYATTN_NO_MEASURE_CACHE."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from anyattn.config import AttentionSelectorConfig, BatchLimits
from anyattn.measure import Phase, StepTiming, cache_dir
from anyattn.selector import measure_backends

CONFIG = AttentionSelectorConfig(head_size=64, dtype="float32", num_heads=4, num_kv_heads=2)
LIMITS = BatchLimits(4, 32, 64)


class CountingTimer:
    """FLEX_ATTENTION twice as fast as TORCH on every step; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, backend, step):
        self.calls += 1
        base = 50.0 if backend.get_name() == "FLEX_ATTENTION" else 100.0
        return StepTiming(step.name, (base, base + 1.0), base * 3, 2.0)


def measure(timer, **kwargs):
    return measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=lambda b: None, **kwargs)


def only_file() -> Path:
    root = cache_dir()
    assert root is not None
    files = list((root / "measure").glob("*.json"))
    assert len(files) == 1, files
    return files[0]


def test_tests_cache_in_a_temporary_folder_not_home():
    root = cache_dir()
    assert root is not None and Path.home() not in root.parents
    assert os.environ["ANYATTN_CACHE_DIR"] == str(root)


def test_default_location_follows_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("ANYATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "anyattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "anyattn"


def test_source_hash_covers_every_module_of_the_package(monkeypatch, tmp_path):
    # A kernel module no backend class lives in changes the key as much as a backend's own file.
    import anyattn
    from anyattn.measure import cache

    (tmp_path / "ops").mkdir()
    (tmp_path / "__init__.py").write_text("")
    kernel = tmp_path / "ops" / "kernel.py"
    kernel.write_text("BLOCK = 64\n")
    monkeypatch.setattr(anyattn, "__file__", str(tmp_path / "__init__.py"))
    before = cache.source_hash.__wrapped__()
    kernel.write_text("BLOCK = 128\n")
    changed = cache.source_hash.__wrapped__()
    assert changed != before
    kernel.rename(tmp_path / "ops" / "kernel2.py")  # same bytes, another module
    assert cache.source_hash.__wrapped__() not in (before, changed)


def test_second_run_uses_the_cache_and_times_nothing():
    timer = CountingTimer()
    first = measure(timer)
    assert not first.from_cache and timer.calls == 2 * len(first.steps)
    path = only_file()
    assert first.cache_note.endswith(f"saved to {path}")
    entry = json.loads(path.read_text())  # a readable JSON with its key
    assert entry["key"]["device"]["type"] == "cpu"
    assert set(entry["key"]["versions"]) >= {
        "torch", "triton", "flashinfer-python", "flash-attn", "flash-attn-4", "nvidia-cutlass-dsl"
    }  # fmt: skip
    assert entry["result"]["choices"]["overall"]["backend"] == "FLEX_ATTENTION"
    second = measure(timer)
    assert timer.calls == 2 * len(first.steps)  # nothing timed again
    assert second.from_cache and second.cache_note == f"used {path}"
    unmeasured = {"from_cache": False, "cache_note": "", "check_s": 0, "timing_s": 0}
    assert second.to_dict() | unmeasured == first.to_dict() | unmeasured
    # Other limits are another key: measured again, in a second file.
    measure_backends(CONFIG, BatchLimits(4, 16, 64), "cpu", timer=timer, checker=lambda b: None)
    assert len(list(path.parent.glob("*.json"))) == 2


@pytest.mark.parametrize(
    "damage",
    ["not json", "truncated", "other device", "other versions", "other source", "bad result"],
)
def test_a_damaged_or_foreign_entry_is_measured_again_and_replaced(damage):
    timer = CountingTimer()
    measure(timer)
    path = only_file()
    text = path.read_text()
    entry = json.loads(text)
    good_key = json.loads(text)["key"]
    if damage == "not json":
        path.write_bytes(b"\xff\x00 garbage")
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    else:
        if damage == "other device":
            entry["key"]["device"]["name"] = "Another CPU"
        elif damage == "other versions":
            entry["key"]["versions"]["torch"] = "0.0.1"
        elif damage == "other source":
            entry["key"]["source_sha256"] = "0" * 64
        else:
            entry["result"]["timings"] = {"TORCH": [{"step": "x"}]}
            # A tampered choice is never trusted either: choices come from the times.
        entry["result"]["choices"]["overall"]["backend"] = "TORCH"
        path.write_text(json.dumps(entry))
    calls = timer.calls
    again = measure(timer)
    assert timer.calls == 2 * calls  # measured again
    assert not again.from_cache and again.overall == "FLEX_ATTENTION"
    assert "measured again" in again.cache_note and f"saved to {path}" in again.cache_note
    replaced = json.loads(path.read_text())
    assert replaced["key"] == good_key
    assert replaced["result"]["choices"]["overall"]["backend"] == "FLEX_ATTENTION"
    assert measure(timer).from_cache  # the replaced entry is good


def test_the_environment_variable_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv("ANYATTN_NO_MEASURE_CACHE", "1")
    assert cache_dir() is None
    timer = CountingTimer()
    first, second = measure(timer), measure(timer)
    assert timer.calls == 2 * 2 * len(first.steps)
    assert not second.from_cache and "cache off" in second.cache_note
    monkeypatch.delenv("ANYATTN_NO_MEASURE_CACHE")
    assert not (cache_dir() / "measure").exists()


def test_an_unwritable_cache_still_returns_the_measurement(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ANYATTN_CACHE_DIR", str(blocker))  # a file where a folder must be
    measured = measure(CountingTimer())
    assert measured.choice(Phase.DECODE) == "FLEX_ATTENTION"
    assert "not saved: cannot write" in measured.cache_note
