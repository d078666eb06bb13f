"""The layer a measured selection times: the config's shape plus the values a config omits.

An `AttentionSelectorConfig` says whether a layer has a sliding window, a soft cap or sinks, not
their values, nor for MLA the no-rope and value sizes. A caller that knows the layer passes its
`LayerParams` (`MLALayerParams` for MLA); otherwise the `DEFAULT_*` values below stand in (common
values of current models), and the scale is `head_size ** -0.5` (MLA: `(P + R) ** -0.5`).
"""

from __future__ import annotations

from anyattn.config import AttentionSelectorConfig
from anyattn.layer_params import LayerParams, MLALayerParams

__all__ = [
    "DEFAULT_LOGITS_SOFT_CAP", "DEFAULT_MLA_NOPE_DIM", "DEFAULT_MLA_ROPE_DIM", "DEFAULT_MLA_V_DIM",
    "DEFAULT_SLIDING_WINDOW", "resolve_layer",
]  # fmt: skip

DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_LOGITS_SOFT_CAP = 50.0
DEFAULT_MLA_ROPE_DIM = 64
DEFAULT_MLA_NOPE_DIM = 128
DEFAULT_MLA_V_DIM = 128


def _mla_layer(config: AttentionSelectorConfig, num_heads: int) -> MLALayerParams:
    rope = config.qk_rope_head_dim or DEFAULT_MLA_ROPE_DIM
    nope = config.qk_nope_head_dim or DEFAULT_MLA_NOPE_DIM
    if rope >= config.head_size:
        raise ValueError(
            f"measure: head_size {config.head_size} leaves no latent rank next to the default "
            f"qk_rope_head_dim {rope} (expected head_size > {rope}). Set qk_rope_head_dim."
        )
    return MLALayerParams(
        num_heads=num_heads, num_kv_heads=1, head_size=config.head_size,
        scale=(nope + rope) ** -0.5, kv_cache_dtype=config.kv_cache_dtype,
        kv_lora_rank=config.head_size - rope, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
        v_head_dim=config.v_head_dim or DEFAULT_MLA_V_DIM,
    )  # fmt: skip


def resolve_layer(
    config: AttentionSelectorConfig, params: LayerParams | None = None
) -> LayerParams:
    """The layer record the timing and the oracle check use for `config`: `params` (the real
    layer's, when known; it must agree with `config`), else a `LayerParams` (`MLALayerParams`
    for MLA) with the module's defaults, for which `config` must set `num_heads` (and, for
    standard attention, `num_kv_heads`); else a ValueError."""
    if params is not None:
        want_mla = isinstance(params, MLALayerParams)
        if want_mla != config.use_mla or params.head_size != config.head_size:
            raise ValueError(
                f"measure: layer_params do not match the config (got "
                f"{type(params).__name__} with head_size {params.head_size}, expected "
                f"{'MLALayerParams' if config.use_mla else 'LayerParams'} with head_size "
                f"{config.head_size})."
            )
        return params
    if config.num_heads is None:
        raise ValueError(
            "measure: config.num_heads must be set to time a layer (got None, expected the "
            "layer's query heads). Pass num_heads (and num_kv_heads) or layer_params."
        )
    if config.use_mla:
        return _mla_layer(config, config.num_heads)
    if config.num_kv_heads is None:
        raise ValueError(
            "measure: config.num_kv_heads must be set to time a layer (got None, expected the "
            "layer's KV heads). Pass num_kv_heads or layer_params."
        )
    return LayerParams(
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_size=config.head_size, scale=config.head_size**-0.5, attn_type=config.attn_type,
        kv_cache_dtype=config.kv_cache_dtype,
        sliding_window=DEFAULT_SLIDING_WINDOW if config.has_sliding_window else None,
        logits_soft_cap=DEFAULT_LOGITS_SOFT_CAP if config.has_logits_soft_cap else None,
        has_alibi=config.has_alibi, has_sinks=config.has_sink,
    )  # fmt: skip
