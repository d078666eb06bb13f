"""The backend contract: what a backend declares, how its metadata is built, how it runs.

Three roles, as in vLLM v1's attention layer:

- `AttentionBackend` (`anyattn.declarations`): a class of declarations (no instances, no
  device access): impl and builder classes, KV-cache shape and stride orders, capabilities,
  rank per platform (`priority`).
- `AttentionMetadataBuilder` (`anyattn.builder`): constructed once per KV-cache group with
  one `LayerParams` per layer (`anyattn.layer_params`); `build` turns the step's
  `CommonAttentionMetadata` into frozen metadata holding every plan the layers need.
- `AttentionImpl` (`anyattn.impl`): constructed once per layer, its arguments checked once in
  the base class; `forward` runs the layer's attention from the metadata and never plans.
  `MLAAttentionImpl` (`anyattn.mla_impl`) is the MLA variant (`forward_mqa` / `forward_mha`),
  `MLAAttentionBackend` (`anyattn.mla_backend`) the declarations MLA backends share.

This module is the public surface: it names the three, `LayerParams` and
`check_layer_planned` (`anyattn.validation`).
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
