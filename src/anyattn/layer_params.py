"""`LayerParams`: what a metadata builder knows of one layer it serves.

A builder gets `{name: impl.layer_params()}` for the layers of its KV-cache group, so that
`build` makes every plan they need and `forward` never plans. Records are frozen and hashable:
layers with equal records may share one plan. An impl whose plans need more fields subclasses
it (new fields with defaults, as MLA's latent sizes) and names it in its `params_cls`.
"""

from __future__ import annotations

from dataclasses import dataclass

from anyattn.types import AttentionType

__all__ = ["DEFAULT_WORKSPACE_TOKENS", "LayerParams", "MLALayerParams"]

# Rows of latent context an MLA prefill reads and up-projects at once, unless the layer says.
DEFAULT_WORKSPACE_TOKENS = 8192


@dataclass(frozen=True)
class LayerParams:
    """One layer's attention parameters, as its impl keeps them.

    Attributes:
        num_heads, num_kv_heads, head_size: the layer's shape (`num_heads % num_kv_heads == 0`).
        scale: the softmax scale applied to `q . k`.
        attn_type: decoder, encoder, encoder-only or encoder-decoder (cross) attention.
        kv_cache_dtype: "auto" or one of `anyattn.types.CACHE_DTYPES`.
        sliding_window: W (keys `p - W < j <= p`), or None.
        logits_soft_cap: c of `c * tanh(s / c)`, or None.
        has_alibi, has_sinks: whether the layer adds ALiBi biases / has sink logits (their
            values stay with the impl; plans depend only on their presence).
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    attn_type: AttentionType = AttentionType.DECODER
    kv_cache_dtype: str = "auto"
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    has_alibi: bool = False
    has_sinks: bool = False


@dataclass(frozen=True)
class MLALayerParams(LayerParams):
    """An MLA layer's record (docs/mla.md): `head_size = kv_lora_rank + qk_rope_head_dim`,
    `num_kv_heads = 1`, plus its latent sizes and context workspace.

    Attributes:
        kv_lora_rank: L; qk_rope_head_dim: R; qk_nope_head_dim: P; v_head_dim: Vd.
        workspace_tokens: most latent context rows a prefill reads (and up-projects) at once;
            the builder plans the context chunks with it.
    """

    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS
