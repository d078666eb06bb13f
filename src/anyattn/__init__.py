"""anyattn: attention backends for LLM inference over a paged KV cache.

One `forward` for the model, many kernels behind it, chosen by a selector that says why every
other backend was not chosen. See `select_backend`, `explain`, and `anyattn.testing`.
"""

from anyattn.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionImplBase,
    AttentionMetadataBuilder,
    LayerParams,
    MLAAttentionBackend,
    MLAAttentionImpl,
    MLALayerParams,
)
from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits, MLAAttentionSpec
from anyattn.metadata import CommonAttentionMetadata
from anyattn.mla_layer import MLAAttention
from anyattn.registry import AttentionBackendEnum, get_backend_class, register_backend
from anyattn.selector import NoBackendError, clear_cache, explain, select_backend
from anyattn.types import AttentionCGSupport, AttentionType, DeviceInfo, KVCacheLayout, MultipleOf

__version__ = "0.1.0"

__all__ = [
    "AttentionBackend",
    "AttentionBackendEnum",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionImplBase",
    "AttentionMetadataBuilder",
    "AttentionSelectorConfig",
    "AttentionSpec",
    "AttentionType",
    "BatchLimits",
    "CommonAttentionMetadata",
    "DeviceInfo",
    "KVCacheLayout",
    "LayerParams",
    "MLAAttention",
    "MLAAttentionBackend",
    "MLAAttentionImpl",
    "MLAAttentionSpec",
    "MLALayerParams",
    "MultipleOf",
    "NoBackendError",
    "clear_cache",
    "explain",
    "get_backend_class",
    "register_backend",
    "select_backend",
]
