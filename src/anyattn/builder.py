"""`AttentionMetadataBuilder`: turns a step's `CommonAttentionMetadata` into one backend's
metadata.

Constructed once per KV-cache group as `Builder(kv_cache_spec, layers, limits, device)`, where
`layers` maps each layer name to its record (`impl.layer_params()`). `build` returns frozen
metadata holding every plan the step's layers need, the step's `slot_mapping` and the
builder's `layer_names` as a frozenset (`anyattn.validation.check_layer_planned`). `build`
never synchronises with the device: it reads the `*_cpu` mirrors, never `.item()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import numpy as np
import torch

from anyattn.layer_params import LayerParams
from anyattn.types import AttentionCGSupport

if TYPE_CHECKING:
    from anyattn.config import AttentionSpec, BatchLimits
    from anyattn.declarations import AttentionBackend
    from anyattn.metadata import CommonAttentionMetadata

__all__ = ["AttentionMetadataBuilder"]

M = TypeVar("M")


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Builds one backend's metadata for every step of one KV-cache group.

    Attributes:
        kv_cache_spec: the group's KV-cache spec.
        layers: layer name -> its `LayerParams` (a dict, in the order given).
        layer_names: the names of `layers`, in order.
        limits: the engine's batch limits.
        device: where the metadata's tensors live.
    """

    # The backend whose declarations the spec is checked against at construction (set in the
    # backend's module once both classes exist); None: no check.
    backend: ClassVar[type[AttentionBackend] | None] = None
    # Use get_cudagraph_support(), which may refine this per spec.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Query length at or below which a request counts as a decode and is moved to the front
    # of the batch; None: this builder does not ask for reordering.
    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layers: Mapping[str, LayerParams],
        limits: BatchLimits,
        device: torch.device,
    ) -> None:
        """Keep the arguments.

        Raises:
            TypeError: `layers` is not a mapping of layer names to `LayerParams`.
            ValueError: a layer's KV heads or head size differ from `kv_cache_spec`'s, or
                `backend`'s kernels do not take the spec (`check_kv_cache_spec`).
        """
        api = type(self).__name__
        if not isinstance(layers, Mapping):
            raise TypeError(
                f"{api}: layers must map layer names to LayerParams (got "
                f"{type(layers).__name__}). Pass {{name: impl.layer_params()}}."
            )
        for name, params in layers.items():
            if not isinstance(name, str) or not isinstance(params, LayerParams):
                raise TypeError(
                    f"{api}: layers must map layer names to LayerParams (got {name!r}: "
                    f"{type(params).__name__}). Pass {{name: impl.layer_params()}}."
                )
            for field_name in ("num_kv_heads", "head_size"):
                got, spec = getattr(params, field_name), getattr(kv_cache_spec, field_name)
                if got != spec:
                    raise ValueError(
                        f"{api}: layer {name!r} has {field_name}={got}, but the KV-cache spec "
                        f"says {spec}. A builder serves the layers of one KV-cache group."
                    )
        if self.backend is not None:
            self.backend.check_kv_cache_spec(kv_cache_spec, api)
        self.kv_cache_spec = kv_cache_spec
        self.layers: dict[str, LayerParams] = dict(layers)
        self.layer_names: list[str] = list(self.layers)
        self.limits = limits
        self.device = torch.device(device)

    @classmethod
    def get_cudagraph_support(
        cls, kv_cache_spec: AttentionSpec | None = None, limits: BatchLimits | None = None
    ) -> AttentionCGSupport:
        """How much of a step this builder's metadata lets the engine capture in a graph."""
        return cls._cudagraph_support

    def _init_reorder_batch_threshold(
        self, reorder_batch_threshold: int | None = 1, supports_spec_as_decode: bool = False
    ) -> None:
        """Set the decode threshold; with speculative decoding and kernels that treat a
        request's 1 + k verification tokens as a decode, widen it to 1 + k."""
        self.reorder_batch_threshold = reorder_batch_threshold
        if reorder_batch_threshold is not None and supports_spec_as_decode:
            spec_len = 1 + self.limits.num_speculative_tokens
            self.reorder_batch_threshold = max(reorder_batch_threshold, spec_len)

    @abstractmethod
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Build this backend's frozen metadata for one step.

        Args:
            common_prefix_len: tokens at the start of every request that share the same
                KV blocks (0: no cascade); only non-zero when `use_cascade_attention` said yes.
            common_attn_metadata: the step's batch description.
        """

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> M:
        """Metadata for capturing a CUDA graph; defaults to `build` without a common prefix."""
        return self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)

    def use_cascade_attention(
        self, common_prefix_len: int, query_lens: np.ndarray, num_query_heads: int,
        num_kv_heads: int, use_alibi: bool, use_sliding_window: bool, num_sms: int,
    ) -> bool:  # fmt: skip
        """Whether running the shared prefix once (cascade) pays off for this step."""
        return False
