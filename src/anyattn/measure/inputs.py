"""One step of one layer set up for a backend as an engine would: its own builder and impl, a
paged cache of random values over shuffled blocks (block 0 the null block), the step's inputs.
`prepare_step` sets up; `PreparedStep.build()` and `.run(metadata)` are what is timed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits, MLAAttentionSpec
from anyattn.kv_cache import allocate_kv_cache
from anyattn.layer_params import LayerParams, MLALayerParams
from anyattn.measure.steps import MeasureStep
from anyattn.metadata import CommonAttentionMetadata, make_common_attn_metadata
from anyattn.testing.blocks import assign_blocks
from anyattn.testing.cases import geometric_alibi_slopes

__all__ = ["LAYER_NAME", "MeasureLayer", "PreparedStep", "prepare_step"]

LAYER_NAME = "layer.0"


@dataclass
class MeasureLayer:
    """The `layer` argument passed to the impl (an `MLALayer` when `kv_b` is set).

    Attributes:
        layer_name: the builder's one layer.
        k_scale, v_scale: float32 `[]` or `[num_kv_heads]` (1.0: random values fit fp8).
        kv_b: MLA only, `[H, P + Vd, L]`, the up-projection of each head.
        v_head_dim: MLA only, Vd (the last rows of each head's `kv_b`).
    """

    layer_name: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    kv_b: torch.Tensor | None = None
    v_head_dim: int = 0

    def up_project(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`c_kv [N, L]` -> `(k_nope [N, H, P], v [N, H, Vd])`, as `MLAAttention` does it."""
        assert self.kv_b is not None, "up_project is for MLA layers"
        num_heads, rows, rank = self.kv_b.shape
        kv = (c_kv @ self.kv_b.reshape(num_heads * rows, rank).T).view(-1, num_heads, rows)
        nope = rows - self.v_head_dim
        return kv[..., :nope], kv[..., nope:]


@dataclass
class PreparedStep:
    """A step ready to build and run; tensors on the timing device.

    Attributes:
        layer: what the impl reads from the layer; common: the step's common metadata.
        kv_cache: the layer's cache (the step's write lands in it on every run).
        inputs: standard: query, key, value `[T, H(_kv), D]`; MLA: q_latent `[T, H, L]`,
            q_pe `[T, H, R]`, q `[T, H, P + R]`, kv_c `[T, L]`, k_pe `[T, R]` (each entry point
            takes its rows).
        output: standard `[T, H, D]`; MLA `[T, H, L]` for decode rows and `[T, H, Vd]` under
            the key "output_mha" for prefill rows.
        output_lse: float32 `[H, T]` when the config needs the LSE, else None.
    """

    backend: type[AttentionBackend]
    impl: object
    builder: object
    layer: MeasureLayer
    common: CommonAttentionMetadata
    kv_cache: torch.Tensor
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    output_lse: torch.Tensor | None
    is_mla: bool

    def build(self) -> object:
        """The backend's metadata for the step (its builder's `build`)."""
        return self.builder.build(0, self.common)  # type: ignore[attr-defined]

    def run(self, attn_metadata: object) -> None:
        """The write and the forward(s) of one layer."""
        if self.is_mla:
            self._run_mla(attn_metadata)
            return
        x, impl = self.inputs, self.impl
        if not self.backend.forward_includes_kv_cache_update:
            impl.do_kv_cache_update(  # type: ignore[attr-defined]
                self.layer, x["key"], x["value"], self.kv_cache, self.common.slot_mapping,
                attn_metadata,
            )  # fmt: skip
        impl.forward(  # type: ignore[attr-defined]
            self.layer, x["query"], x["key"], x["value"], self.kv_cache, attn_metadata,
            self.outputs["output"], output_lse=self.output_lse,
        )  # fmt: skip

    def _run_mla(self, md: object) -> None:
        x, impl = self.inputs, self.impl
        impl.do_kv_cache_update(  # type: ignore[attr-defined]
            self.layer, x["kv_c"], x["k_pe"], self.kv_cache, self.common.slot_mapping, md
        )
        decode = md.num_decode_tokens  # type: ignore[attr-defined]
        total = md.num_actual_tokens  # type: ignore[attr-defined]
        if decode:
            impl.forward_mqa(  # type: ignore[attr-defined]
                self.layer, x["q_latent"][:decode], x["q_pe"][:decode], self.kv_cache, md,
                self.outputs["output"][:decode], self.output_lse,
            )  # fmt: skip
        if total > decode:
            impl.forward_mha(  # type: ignore[attr-defined]
                self.layer, x["q"][decode:total], x["kv_c"][decode:total],
                x["k_pe"][decode:total], self.kv_cache, md,
                self.outputs["output_mha"][decode:total],
            )  # fmt: skip


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=torch.float32).to(dtype)


def _make_impl(backend: type[AttentionBackend], layer: LayerParams, device: torch.device) -> object:
    impl_cls = backend.get_impl_cls()
    if isinstance(layer, MLALayerParams):
        return impl_cls(  # type: ignore[call-arg]
            layer.num_heads, layer.scale, kv_lora_rank=layer.kv_lora_rank,
            qk_rope_head_dim=layer.qk_rope_head_dim, qk_nope_head_dim=layer.qk_nope_head_dim,
            v_head_dim=layer.v_head_dim, kv_cache_dtype=layer.kv_cache_dtype,
            workspace_tokens=layer.workspace_tokens,
        )  # fmt: skip
    sinks = torch.zeros(layer.num_heads, device=device) if layer.has_sinks else None
    return impl_cls(
        layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads,
        geometric_alibi_slopes(layer.num_heads) if layer.has_alibi else None, layer.sliding_window,
        layer.kv_cache_dtype, layer.logits_soft_cap, layer.attn_type, None, sinks,
    )  # fmt: skip


def prepare_step(
    backend: type[AttentionBackend], config: AttentionSelectorConfig, layer: LayerParams,
    step: MeasureStep, limits: BatchLimits, device: torch.device, seed: int = 0,
) -> PreparedStep:  # fmt: skip
    """Set up `step` for `backend` (impl, builder, cache, inputs; nothing is run), for the layer
    `layer` (`resolve_layer`; an `MLALayerParams` for MLA backends) of `config`, with the
    engine's `limits` given to the builder."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    dtype = config.dtype
    block_size = config.block_size or backend.get_preferred_block_size(16)
    kernel_block_size = backend.get_kernel_block_size(block_size)
    table, num_blocks = assign_blocks(
        step.seq_lens, kernel_block_size, generator=generator, spare_blocks=False
    )
    impl = _make_impl(backend, layer, device)
    is_mla = isinstance(layer, MLALayerParams)
    kv_cache = allocate_kv_cache(
        backend, num_blocks, kernel_block_size, 1 if is_mla else layer.num_kv_heads,
        layer.head_size, dtype, config.kv_cache_dtype, None, device,
    )  # fmt: skip
    kv_cache.copy_(_randn(tuple(kv_cache.shape), dtype, device))
    scale_shape = (layer.num_kv_heads,) if config.use_per_head_quant_scales else ()
    one = torch.ones(scale_shape, dtype=torch.float32, device=device)
    t, h = step.num_tokens, layer.num_heads
    if isinstance(layer, MLALayerParams):
        spec: AttentionSpec = MLAAttentionSpec(
            block_size=kernel_block_size, dtype=dtype, kv_lora_rank=layer.kv_lora_rank,
            qk_rope_head_dim=layer.qk_rope_head_dim, qk_nope_head_dim=layer.qk_nope_head_dim,
            v_head_dim=layer.v_head_dim, kv_cache_dtype=config.kv_cache_dtype,
        )  # fmt: skip
        rank, rope, nope = layer.kv_lora_rank, layer.qk_rope_head_dim, layer.qk_nope_head_dim
        kv_b = _randn((h, nope + layer.v_head_dim, rank), dtype, device) / math.sqrt(rank)
        measure_layer = MeasureLayer(LAYER_NAME, one, one.clone(), kv_b, layer.v_head_dim)
        shapes = {"q_latent": (t, h, rank), "q_pe": (t, h, rope), "q": (t, h, nope + rope),
                  "kv_c": (t, rank), "k_pe": (t, rope)}  # fmt: skip
        inputs = {name: _randn(shape, dtype, device) for name, shape in shapes.items()}
        outputs = {
            "output": torch.empty((t, h, rank), dtype=dtype, device=device),
            "output_mha": torch.empty((t, h, layer.v_head_dim), dtype=dtype, device=device),
        }
    else:
        spec = AttentionSpec(
            kernel_block_size, layer.num_kv_heads, layer.head_size, dtype,
            config.kv_cache_dtype, layer.sliding_window,
        )  # fmt: skip
        measure_layer = MeasureLayer(LAYER_NAME, one, one.clone())
        kv_shape = (t, layer.num_kv_heads, layer.head_size)
        shapes = {"query": (t, h, layer.head_size), "key": kv_shape, "value": kv_shape}
        inputs = {name: _randn(shape, dtype, device) for name, shape in shapes.items()}
        outputs = {"output": torch.empty_like(inputs["query"])}
    output_lse = None
    if config.needs_lse:
        output_lse = torch.empty((h, t), dtype=torch.float32, device=device)
    common = make_common_attn_metadata(
        step.query_lens, step.seq_lens, table, kernel_block_size, device,
        causal=not config.use_non_causal,
    )  # fmt: skip
    records = {LAYER_NAME: impl.layer_params()}  # type: ignore[attr-defined]
    builder = backend.get_builder_cls()(spec, records, limits, device)
    return PreparedStep(
        backend, impl, builder, measure_layer, common, kv_cache, inputs, outputs, output_lse,
        is_mla,
    )  # fmt: skip
