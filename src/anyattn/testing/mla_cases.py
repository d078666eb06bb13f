"""Which cases the kit runs for an MLA backend (`backend.is_mla()`), from what it declares: the
standard catalogue's batches at every latent split of `MLA_SHAPES` the backend declares (its
`validate_configuration` on the config a model layer would send), then the other features of
`MLA_FEATURES` (docs/mla.md, "Conformance"). What it does not declare is listed, never excused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig
from anyattn.testing import declared
from anyattn.testing.batch_spec import BatchSpec, get_spec
from anyattn.types import DeviceInfo, check_positive_int, is_fp8_cache

__all__ = [
    "MLA_FEATURES", "MLA_SHAPES", "MLACase", "MLAShape", "context_chunks_spec", "plan_mla_cases",
]  # fmt: skip

MLA_FEATURES: Mapping[str, str] = MappingProxyType(
    {
        "decode": "one decode, and decodes of lengths 1 to 200, at every declared latent split",
        "prefill": "one fresh prefill (1025 tokens) at every declared latent split",
        "mixed": "decodes, fresh prefills and a chunk interleaved, at every declared split",
        "chunked": "prefill chunks on top of long contexts, at every declared split",
        "odd_lengths": "sequence lengths 1, 7, 97, 1025, at every declared split",
        "num_heads": "1 and 16 query heads",
        "head_dims": "v_head_dim equal to qk_nope_head_dim + qk_rope_head_dim",
        "block_sizes": "engine block sizes 16 and 32 (and 5 when declared)",
        "padding": "5 padding rows past the real tokens: slot -1, never written",
        "context_chunks": "a workspace smaller than the contexts: three or more context chunks",
        "fp8": "every declared fp8 cache dtype, one per-layer scale",
        "lse": "output_lse (natural log) of the decodes of a mixed batch",
    }
)
"""Feature names accepted by `check_backend(features=...)` for MLA backends."""

_SPLIT_FEATURES = ("decode", "prefill", "mixed", "chunked", "odd_lengths")
# A per-layer fp8 scale exactly representable in bf16/fp16, so that only fp8 rounding shows.
_FP8_SCALE = 0.375


@dataclass(frozen=True, slots=True)
class MLAShape:
    """The sizes of an MLA layer (docs/mla.md): latent rank L, rope R, no-rope P, value Vd."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            check_positive_int("MLAShape", name, getattr(self, name))

    @property
    def name(self) -> str:
        """The latent split, "L+R" ("512+64")."""
        return f"{self.kv_lora_rank}+{self.qk_rope_head_dim}"

    @property
    def head_size(self) -> int:
        """The cache row, `L + R`."""
        return self.kv_lora_rank + self.qk_rope_head_dim


MLA_SHAPES: tuple[MLAShape, ...] = (
    MLAShape(512, 64, 128, 128),
    MLAShape(320, 64, 128, 128),
    MLAShape(64, 16, 32, 24),
)
"""The latent splits the kit runs, most important first: DeepSeek's 512+64 (P = Vd = 128),
a non-power-of-two rank, and a small split for quick runs. In all three `P + R != Vd`; the
small one also has `P != Vd`."""


def context_chunks_spec(workspace_tokens: int) -> BatchSpec:
    """Two prefill chunks over contexts of `3w + 4` and `2w + 6` tokens (w =
    `workspace_tokens`), a decode between them: every prefill context is longer than the
    workspace and together they need at least three workspace-sized chunks, however the
    workspace is shared between the requests."""
    w = workspace_tokens
    return BatchSpec("context_chunks", (40, 1, 37), (40 + 3 * w + 4, 21, 37 + 2 * w + 6))


@dataclass(frozen=True, slots=True)
class MLACase:
    """One MLA configuration to run: a batch and the layer's settings.

    `scale` is `scale_factor / sqrt(P + R)`; the factor is not 1 so that an impl ignoring its
    `scale` argument fails. `workspace_tokens` None leaves the builder's context workspace at
    the layer's default; `min_context_chunks` > 0 makes the kit check, from the layer's
    `up_project` calls, that the context was read in at least that many chunks.
    """

    name: str
    feature: str
    spec: BatchSpec
    shape: MLAShape = MLA_SHAPES[0]
    num_heads: int = 4
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    check_lse: bool = False
    num_padding_tokens: int = 0
    workspace_tokens: int | None = None
    min_context_chunks: int = 0
    scale_factor: float = 1.25

    @property
    def scale(self) -> float:
        return self.scale_factor / math.sqrt(
            self.shape.qk_nope_head_dim + self.shape.qk_rope_head_dim
        )

    @property
    def head_size(self) -> int:
        return self.shape.head_size

    def k_scale(self) -> torch.Tensor:
        """The float32 per-layer cache scale `[]` (1 unless the cache is fp8)."""
        return torch.tensor(_FP8_SCALE if is_fp8_cache(self.kv_cache_dtype) else 1.0)

    def selector_config(self, dtype: torch.dtype) -> AttentionSelectorConfig:
        """What an MLA model layer with these settings would ask the selector."""
        shape = self.shape
        return AttentionSelectorConfig(
            head_size=shape.head_size, qk_rope_head_dim=shape.qk_rope_head_dim,
            qk_nope_head_dim=shape.qk_nope_head_dim, v_head_dim=shape.v_head_dim, dtype=dtype,
            kv_cache_dtype=self.kv_cache_dtype,  # type: ignore[arg-type]
            block_size=self.block_size, num_heads=self.num_heads, num_kv_heads=1, use_mla=True,
            needs_lse=self.check_lse,
        )  # fmt: skip


def _not_declared(backend: type[AttentionBackend], feature: str) -> str | None:
    if feature == "fp8" and not declared.declared_fp8(backend):
        return "no fp8 kv_cache_dtype in supported_kv_cache_dtypes"
    if feature == "lse" and not backend.supports_lse():
        return "supports_lse() is False"
    return None


def _feature_cases(
    backend: type[AttentionBackend], feature: str, base: MLACase, shapes: list[MLAShape],
    quick: bool,
) -> tuple[list[MLACase], list[str]]:  # fmt: skip
    """The cases of one feature, and the parts of it the backend does not declare."""

    def case(name: str, spec_name: str = "mixed", **changes: object) -> MLACase:
        spec = get_spec(spec_name, quick)
        return replace(base, name=name, feature=feature, spec=spec, **changes)

    if feature in _SPLIT_FEATURES:
        renamed = {"decode": ("single_decode", "many_decodes"), "prefill": ("long_prefill",),
                   "chunked": ("chunked_prefill",)}  # fmt: skip
        names = renamed.get(feature, (feature,))
        return [case(f"{s.name}/{n}", n, shape=s) for s in shapes for n in names], []
    if feature == "num_heads":
        return [case(f"num_heads{h}", num_heads=h) for h in (1, 16)], []
    if feature == "head_dims":
        s = base.shape
        equal = replace(s, v_head_dim=s.qk_nope_head_dim + s.qk_rope_head_dim)
        head_dims = getattr(backend, "get_mla_head_dims_reason", None)
        refused = head_dims and head_dims(
            equal.qk_nope_head_dim, equal.qk_rope_head_dim, equal.v_head_dim
        )
        if refused:
            return [], [f"v_head_dim {equal.v_head_dim}: {refused}"]
        return [case(f"v_head_dim{equal.v_head_dim}", "chunked_prefill", shape=equal)], []
    if feature == "block_sizes":
        return declared.block_size_cases(
            backend, base.block_size, lambda b: case(f"block_size{b}", "odd_lengths", block_size=b)
        )
    if feature == "padding":
        return [case("padding", num_padding_tokens=5)], []
    if feature == "context_chunks":
        # Two blocks per chunk at least, so that a workspace shared by two requests still
        # holds whole blocks of each.
        workspace = 2 * max(16, base.block_size)
        chunked = replace(
            base, name="context_chunks", feature=feature, spec=context_chunks_spec(workspace),
            workspace_tokens=workspace, min_context_chunks=3,
        )  # fmt: skip
        return [chunked], []
    if feature == "fp8":
        fp8 = declared.declared_fp8(backend)
        missing = [f"kv_cache_dtype {d}" for d in declared.FP8_CACHE_DTYPES if d not in fp8]
        return [case(f"fp8/{d}", "chunked_prefill", kv_cache_dtype=d) for d in fp8], missing
    if feature == "lse":
        return [case("mixed_lse", check_lse=True)], []
    raise AssertionError(f"MLA feature {feature} has no cases")


def plan_mla_cases(
    backend: type[AttentionBackend], device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32, features: Iterable[str] | None = None, quick: bool = False,
) -> tuple[list[MLACase], list[str]]:  # fmt: skip
    """`plan_cases` for an MLA backend (`features` from `MLA_FEATURES`). The base case of every
    feature but the split ones uses the first declared split of `MLA_SHAPES`, 4 query heads
    and the backend's preferred block size."""
    names = declared.feature_names("plan_mla_cases: unknown MLA feature", MLA_FEATURES, features)
    info = DeviceInfo.current(device)
    reasons = declared.global_reasons(backend, info, dtype)
    if reasons:
        return [], [f"backend: {r}" for r in reasons]
    block_size = backend.get_preferred_block_size(16)
    probe = MLACase("", "", get_spec("mixed", quick), block_size=block_size)
    shapes, not_declared = [], []
    for shape in MLA_SHAPES:
        split_reasons = backend.validate_configuration(
            replace(probe, shape=shape).selector_config(dtype), info
        )
        if split_reasons:
            not_declared.append(f"split {shape.name}: {'; '.join(split_reasons)}")
        else:
            shapes.append(shape)
    if not shapes:
        return [], not_declared
    base = replace(probe, shape=shapes[0])
    cases, skipped = declared.plan_features(
        backend, names, lambda feature: _not_declared(backend, feature),
        lambda feature: _feature_cases(backend, feature, base, shapes, quick), info, dtype,
    )  # fmt: skip
    return cases, not_declared + skipped
