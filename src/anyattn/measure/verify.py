"""Check a backend against the float64 oracle of `anyattn.testing` before it is timed, so that
a backend that computes the wrong thing fast is never chosen: one quick "mixed" step of the
conformance kit with the layer's own settings, a `Case` through `run_case`, or for MLA an
`MLACase` judged per phase (docs/measured_selection.md, "Check before timing").
"""

from __future__ import annotations

import math

import torch

from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig
from anyattn.layer_params import LayerParams, MLALayerParams
from anyattn.testing import (
    Case,
    CaseResult,
    MLACase,
    MLAShape,
    get_spec,
    judge_mla_step,
    run_case,
    run_mla_step,
)
from anyattn.types import AttentionType

__all__ = ["check_against_oracle"]

# The kit's small values for features whose size a config does not carry.
_SAMPLE_WINDOW = 7
_SAMPLE_SOFT_CAP = 2.0
_MLA_CASE_NAME = "measure/mla"


def _standard_case(
    backend: type[AttentionBackend], config: AttentionSelectorConfig, layer: LayerParams
) -> Case:
    return Case(
        name="measure/mixed", feature="mixed", spec=get_spec("mixed", quick=True),
        num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
        block_size=config.block_size or backend.get_preferred_block_size(16),
        layout=backend.supported_kv_cache_layouts()[0], kv_cache_dtype=config.kv_cache_dtype,
        per_head_scales=config.use_per_head_quant_scales, attn_type=AttentionType.DECODER,
        causal=not config.use_non_causal,
        sliding_window=_SAMPLE_WINDOW if layer.sliding_window else None,
        logits_soft_cap=_SAMPLE_SOFT_CAP if layer.logits_soft_cap else None,
        use_alibi=layer.has_alibi, use_sinks=layer.has_sinks, check_lse=config.needs_lse,
    )  # fmt: skip


def _mla_case(
    backend: type[AttentionBackend], config: AttentionSelectorConfig, layer: MLALayerParams
) -> MLACase:
    rope, nope = layer.qk_rope_head_dim, layer.qk_nope_head_dim
    shape = MLAShape(layer.kv_lora_rank, rope, nope, layer.v_head_dim)
    # MLACase.scale is scale_factor / sqrt(P + R): this gives the layer's own scale.
    scale_factor = layer.scale * math.sqrt(nope + rope)
    return MLACase(
        name=_MLA_CASE_NAME, feature="mixed", spec=get_spec("mixed", quick=True), shape=shape,
        num_heads=layer.num_heads,
        block_size=config.block_size or backend.get_preferred_block_size(16),
        kv_cache_dtype=config.kv_cache_dtype, check_lse=config.needs_lse,
        workspace_tokens=layer.workspace_tokens, scale_factor=scale_factor,
    )  # fmt: skip


def _describe(result: CaseResult) -> str:
    """ "<part>: max error E above the bound B of the float64 oracle", or the kit's detail."""
    part = result.name.removeprefix(f"{_MLA_CASE_NAME}.")
    if result.max_error <= result.bound:  # an exact check failed
        return f"{part}: {result.detail}"
    shown = "NaN" if math.isnan(result.max_error) else f"{result.max_error:.3g}"
    return f"{part}: max error {shown} above the bound {result.bound:.3g} of the float64 oracle"


def check_against_oracle(
    backend: type[AttentionBackend], config: AttentionSelectorConfig, layer: LayerParams,
    device: torch.device,
) -> str | None:  # fmt: skip
    """Run `backend` on a sample step of `layer` and compare it with the float64 oracle.

    Returns:
        None when the results are within the kit's tolerance, else why not (an exception the
        backend raised is reported, never propagated).
    """
    try:
        if isinstance(layer, MLALayerParams):
            mla_case = _mla_case(backend, config, layer)
            step = run_mla_step(backend, mla_case, device, config.dtype, seed=1)
            results = judge_mla_step(mla_case, *step, config.dtype, by_phase=True)
            return "; ".join(_describe(r) for r in results if not r.passed) or None
        case = _standard_case(backend, config, layer)
        failed = [r for r in run_case(backend, case, device, config.dtype) if not r.passed]
    except Exception as error:  # a candidate may fail in any way; it is then not timed
        return f"sample step raised {type(error).__name__}: {error}"
    return "; ".join(f"{r.name}: {r.detail}" for r in failed) or None
