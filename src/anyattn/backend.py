"""The backend contract's public surface (docs/contract.md). Three roles, as in vLLM v1:

- `AttentionBackend` (`anyattn.declarations`): declarations only (impl and builder classes,
  KV-cache shape and stride orders, capabilities, rank per platform).
- `AttentionMetadataBuilder` (`anyattn.builder`): one per KV-cache group; `build` turns a
  step's `CommonAttentionMetadata` into frozen metadata holding every plan the layers need.
- `AttentionImpl` (`anyattn.impl`): one per layer; `forward` runs from the metadata and never
  plans. `MLAAttentionImpl` and `MLAAttentionBackend` are the MLA variants.
"""

from anyattn.builder import AttentionMetadataBuilder
from anyattn.declarations import PLATFORMS, AttentionBackend, platform_key
from anyattn.impl import AttentionImpl, AttentionImplBase, AttentionLayer
from anyattn.layer_params import LayerParams, MLALayerParams
from anyattn.mla_backend import MLAAttentionBackend
from anyattn.mla_impl import MLAAttentionImpl, MLALayer
from anyattn.validation import check_layer_planned

__all__ = [
    "PLATFORMS",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionImplBase",
    "AttentionLayer",
    "AttentionMetadataBuilder",
    "LayerParams",
    "MLAAttentionBackend",
    "MLAAttentionImpl",
    "MLALayer",
    "MLALayerParams",
    "check_layer_planned",
    "platform_key",
]
