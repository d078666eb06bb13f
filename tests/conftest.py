"""Shared test set-up: the `gpu` marker skip, a clean selector for every test, a temporary
measured-selection cache for every test, fake backends.

Fixtures:
    make_backend: build a fake `AttentionBackend` class from a few declarations (no kernels).
    register: register a backend name for the current test only.
    register_mla_variant: register a TORCH_MLA subclass with another impl under a test name.
    cpu_backend_pair: TORCH's code registered again as TORCH_TWIN and FLEX_ATTENTION made
        unavailable, for per-phase pairs and measurements on the CPU without compiling.
    triton_interpreter: run a test file as a script under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from anyattn import registry, selector
from anyattn.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from anyattn.types import AttentionCGSupport, MultipleOf

# Capabilities a fake backend can declare through `features=`; each maps to `supports_<name>`.
FEATURES = (
    "sink",
    "sliding_window",
    "alibi",
    "logits_soft_cap",
    "non_causal",
    "per_head_quant_scales",
    "batch_invariance",
    "lse",
    "cascade",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        # Not `"gpu" in item.keywords`: keywords include parameter ids such as [gpu].
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _measure_cache_in_tmp(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Measured selections cache into a fresh temporary folder, never the user's home (the
    variables reach subprocesses too)."""
    monkeypatch.setenv("ANYATTN_CACHE_DIR", str(tmp_path_factory.mktemp("anyattn_cache")))
    monkeypatch.delenv("ANYATTN_NO_MEASURE_CACHE", raising=False)


@pytest.fixture(autouse=True)
def _clean_selector(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no cached selections and no ANYATTN_BACKEND override."""
    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    selector.clear_cache()
    yield
    selector.clear_cache()


class FakeImpl(AttentionImpl[None]):
    """An impl that only records its arguments; fake backends never run."""

    def __init__(self, num_heads: int, head_size: int, scale: float, **kwargs: object) -> None:
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        return output


class FakeBuilder(AttentionMetadataBuilder[None]):
    def build(self, common_prefix_len, common_attn_metadata) -> None:
        return None


def make_fake_backend(
    name: str = "FAKE",
    *,
    devices: Sequence[str] = ("cpu", "cuda"),
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16),
    kv_cache_dtypes: Sequence[str] = ("auto", "float16", "bfloat16"),
    head_sizes: Sequence[int] = (),
    block_sizes: Sequence[int | MultipleOf] = (MultipleOf(1),),
    features: Sequence[str] = (),
    min_compute_capability: tuple[int, int] | None = None,
    unavailable: str | None = None,
    mla: bool = False,
    sparse: bool = False,
    cudagraph: AttentionCGSupport = AttentionCGSupport.NEVER,
    combination: Callable[..., str | None] | None = None,
    priority: dict[str, int] | None = None,
    **class_attrs: object,
) -> type[AttentionBackend]:
    """A fake backend class declaring exactly what is passed (defaults: the plain decoder case).

    `features` is its `supported_features` (names from `FEATURES`);
    `unavailable` is its `get_unavailable_reason()`; `combination(config, device)` its
    `supports_combination`; `priority` its rank per platform (default: after every built-in
    backend on every platform).
    """
    unknown = set(features) - set(FEATURES)
    assert not unknown, f"unknown fake features {unknown}"
    builder = type(f"{name}Builder", (FakeBuilder,), {"_cudagraph_support": cudagraph})
    namespace: dict[str, object] = {
        "get_name": staticmethod(lambda: name),
        "get_impl_cls": staticmethod(lambda: FakeImpl),
        "get_builder_cls": staticmethod(lambda: builder),
        "supported_device_types": tuple(devices),
        "supported_dtypes": tuple(dtypes),
        "supported_kv_cache_dtypes": tuple(kv_cache_dtypes),
        "min_compute_capability": min_compute_capability,
        "get_supported_head_sizes": classmethod(lambda cls: list(head_sizes)),
        "get_supported_kernel_block_sizes": classmethod(lambda cls: list(block_sizes)),
        "get_unavailable_reason": classmethod(lambda cls: unavailable),
        "is_mla": classmethod(lambda cls: mla),
        "is_sparse": classmethod(lambda cls: sparse),
        "priority": {"cpu": 100, "cuda": 100, "blackwell": 100} if priority is None else priority,
        "supported_features": tuple(features),
        **class_attrs,
    }
    if combination is not None:
        namespace["supports_combination"] = classmethod(
            lambda cls, config, device: combination(config, device)
        )
    return type(f"Fake{name.title().replace('_', '')}Backend", (AttentionBackend,), namespace)


@pytest.fixture
def make_backend() -> Callable[..., type[AttentionBackend]]:
    """The `make_fake_backend` factory."""
    return make_fake_backend


@pytest.fixture
def register() -> Iterator[Callable[[str, str | type], str | type]]:
    """`register(name, cls_or_path)`: a backend registration undone when the test ends."""
    names: list[str] = []

    def _register(name: str, target: str | type) -> str | type:
        names.append(name)
        return registry.register_backend(name, target)

    yield _register
    for name in names:
        registry.unregister_backend(name)


@pytest.fixture
def register_mla_variant(register) -> Callable[..., type[AttentionBackend]]:
    """`register_mla_variant(name, impl_cls, **attrs) -> backend`: a subclass of TORCH_MLA
    named `name` whose impl is `impl_cls` (a `TorchMLAImpl` subclass, whose `backend` is set
    to it), with class attributes `attrs` (e.g. `priority`), registered for this test."""
    from anyattn.backends.torch_mla import TorchMLABackend

    def make(name: str, impl_cls: type, **attrs: object) -> type[AttentionBackend]:
        namespace = {
            "get_name": staticmethod(lambda: name),
            "get_impl_cls": staticmethod(lambda: impl_cls),
            **attrs,
        }
        backend = type(f"{name.title().replace('_', '')}Backend", (TorchMLABackend,), namespace)
        impl_cls.backend = backend
        register(name, backend)
        return backend

    return make


@pytest.fixture
def cpu_backend_pair(register, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """("TORCH", "TORCH_TWIN"): a second CPU backend, TORCH's impl and builder under another
    name, registered for this test, and FLEX_ATTENTION unavailable, so that a measurement on the
    CPU times these two and a per-phase pair runs without FLEX_ATTENTION's compilation (tens of
    seconds). The two share any cache TORCH takes."""
    from anyattn.backends.flex_attention import FlexAttentionBackend
    from anyattn.backends.torch_attn import (
        TorchAttentionBackend,
        TorchAttentionImpl,
        TorchAttentionMetadataBuilder,
    )

    class TwinImpl(TorchAttentionImpl):
        pass

    class TwinBuilder(TorchAttentionMetadataBuilder):
        pass

    class TorchTwinBackend(TorchAttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "TORCH_TWIN"

        @staticmethod
        def get_impl_cls() -> type[TorchAttentionImpl]:
            return TwinImpl

        @staticmethod
        def get_builder_cls() -> type[TorchAttentionMetadataBuilder]:
            return TwinBuilder

    TwinImpl.backend = TorchTwinBackend
    TwinBuilder.backend = TorchTwinBackend
    register("TORCH_TWIN", TorchTwinBackend)
    monkeypatch.setattr(
        FlexAttentionBackend,
        "get_unavailable_reason",
        classmethod(lambda cls: "made unavailable by the cpu_backend_pair fixture"),
    )
    selector.clear_cache()
    return "TORCH", "TORCH_TWIN"


@pytest.fixture
def triton_interpreter() -> Callable[..., str]:
    """`run(path, timeout=300)`: run the test file `path` as a script with `TRITON_INTERPRET=1`
    and return its stdout; the test fails with the script's output if it exits non-zero.

    A fresh process because Triton reads the variable when it is imported, and this pytest
    process has imported it already. Skips when triton (or numpy, which the interpreter needs)
    is missing.
    """
    pytest.importorskip("triton")
    pytest.importorskip("numpy")

    def run(path: str, timeout: int = 300) -> str:
        result = subprocess.run(
            [sys.executable, "-W", "ignore", path],
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert result.returncode == 0, (result.stdout + result.stderr)[-8000:]
        return result.stdout

    return run
