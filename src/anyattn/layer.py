"""`Attention`: the module a model calls once per layer; the backend behind it is chosen once.

The layer builds its `AttentionSelectorConfig` from its own arguments, asks the selector for a
backend (or takes the one it is given), constructs the impl, and on every call writes the new
K/V into the paged cache (unless the backend's forward does it) and runs the impl. Metadata is
passed explicitly: there is no forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig, AttentionSpec
from anyattn.kv_cache_sharing import KVCacheNotShareableError, plan_shared_kv_cache
from anyattn.layer_phases import forward_by_phase
from anyattn.phase_metadata import PhaseSplitMetadata
from anyattn.selector import select_backend
from anyattn.types import ENCODER_TYPES, AttentionType, DeviceInfo
from anyattn.validation import check_layer_call

__all__ = ["Attention"]


class Attention(nn.Module):
    """One attention layer over a paged KV cache.

    Args:
        num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
        kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks:
            as for `AttentionImpl` (docs/design.md).
        dtype: the model dtype.
        layer_name: unique name of the layer (KV-cache groups and KV sharing refer to it).
        block_size: the engine's block size (None: let the backend prefer one).
        backend: a backend class or name to use instead of selecting one.
        device: where the layer runs: a `torch.device` (or "cpu" / "cuda"), whose scale buffers
            live there, or a `DeviceInfo` to judge selection for hardware one does not have
            (buffers then stay on the CPU); default: this machine.
        needs_lse: the engine will merge partial results and needs LSEs.

    Attributes:
        backend: the backend class in use (the decode backend of a per-phase layer); `impl`:
            its impl instance.
        prefill_backend, prefill_impl: the backend and impl of prefill rows when they differ
            (`use_backend(..., prefill_backend=...)`), else None.
        k_scale, v_scale: float32 buffers, shape `[]` or `[num_kv_heads]` (fp8 caches).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        dtype: torch.dtype | str = torch.float32,
        layer_name: str = "attn",
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: AttentionType | str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        block_size: int | None = None,
        backend: type[AttentionBackend] | str | None = None,
        device: DeviceInfo | torch.device | str | None = None,
        use_non_causal: bool = False,
        needs_lse: bool = False,
    ) -> None:
        super().__init__()
        self._device_info, buffer_device = resolve_device(device)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.layer_name = layer_name
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.config = AttentionSelectorConfig(
            head_size=head_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            has_sink=sinks is not None,
            attn_type=attn_type,
            has_sliding_window=sliding_window is not None,
            has_alibi=alibi_slopes is not None,
            has_logits_soft_cap=bool(logits_soft_cap),
            use_non_causal=use_non_causal,
            needs_lse=needs_lse,
        )
        self.attn_type = self.config.attn_type  # validated there, with a clear message
        self._impl_args = (
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks,
        )  # fmt: skip
        if not isinstance(backend, type):
            backend = select_backend(self.config, self._device_info, backend)
        self.use_backend(backend)
        one = torch.tensor(1.0, device=buffer_device)
        self.register_buffer("k_scale", one, persistent=False)
        self.register_buffer("v_scale", one.clone(), persistent=False)

    def use_backend(
        self, backend: type[AttentionBackend], prefill_backend: type[AttentionBackend] | None = None
    ) -> None:
        """Run the layer on `backend` from now on (a new impl with the layer's arguments), e.g.
        the one a measured selection chose. Call it before the engine builds its groups.

        With `prefill_backend` (another backend), steps given as `PhaseSplitMetadata` run their
        decode rows on `backend` and their prefill rows on `prefill_backend`, over one cache
        both read (`anyattn.kv_cache_sharing`; docs/per_phase.md); metadata of `backend`'s own
        builder (decode-only steps, CUDA graphs) runs on `backend` alone.

        Raises:
            ValueError: either backend cannot serve this layer (its reasons are listed), or the
                two cannot share one KV cache (why), or the layer is not decoder attention.
        """
        check_serves(f"Attention({self.layer_name})", backend, self.config, self._device_info)
        prefill_impl = None
        if prefill_backend is not None and prefill_backend is not backend:
            if self.attn_type is not AttentionType.DECODER:
                raise ValueError(
                    f"Attention({self.layer_name}): a prefill backend needs decoder attention "
                    f"(got attn_type {self.attn_type.value}, expected decoder)."
                )
            check_serves(
                f"Attention({self.layer_name})", prefill_backend, self.config, self._device_info
            )
            try:
                plan_shared_kv_cache(
                    (backend, prefill_backend),
                    block_size=self.block_size or backend.get_preferred_block_size(),
                    num_kv_heads=self.num_kv_heads,
                    head_size=self.head_size,
                    kv_cache_dtype=self.config.kv_cache_dtype,
                )
            except KVCacheNotShareableError as error:
                raise KVCacheNotShareableError(
                    f"Attention({self.layer_name}): decodes on {backend.get_name()} and prefills "
                    f"on {prefill_backend.get_name()} need one KV cache: {error} Use one backend "
                    "for both, or a pair that shares a cache."
                ) from None
            prefill_impl = prefill_backend.get_impl_cls()(*self._impl_args)
        else:
            prefill_backend = None
        self.backend, self.impl = backend, backend.get_impl_cls()(*self._impl_args)
        self.prefill_backend, self.prefill_impl = prefill_backend, prefill_impl

    def kv_cache_spec(
        self,
        block_size: int | None = None,
        dtype: torch.dtype | str | None = None,
        kv_cache_dtype: str | None = None,
    ) -> AttentionSpec:
        """The layer's `AttentionSpec`; each argument defaults to the layer's own (block size:
        the layer's, else the backend's preferred one)."""
        if block_size is None:
            block_size = self.block_size or self.backend.get_preferred_block_size()
        return AttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.config.dtype if dtype is None else dtype,
            kv_cache_dtype=self.config.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype,
            sliding_window=self.sliding_window,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: object,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for one step.

        Args:
            query: `[num_tokens, num_heads, head_size]`.
            key, value: `[num_tokens, num_kv_heads, head_size]` (None for a cross-attention
                step that writes no encoder tokens).
            kv_cache: this layer's cache (for KV-sharing layers: the target layer's cache).
            attn_metadata: what this layer's group builder built for the step, or a
                `PhaseSplitMetadata` for a layer with a prefill backend.
            output_lse: optional float32 `[num_heads, num_tokens]` to receive LSEs (natural
                log for a per-phase step; else in the impl's `lse_base_on_e` base).

        Returns:
            `[num_tokens, num_heads, head_size]`; rows past the step's real tokens are zeros.
        """
        output = torch.empty_like(query)
        # rows past the step's real tokens (padding) are not written by the impl
        num_actual_tokens = getattr(attn_metadata, "num_actual_tokens", 0)
        if num_actual_tokens < output.shape[0]:
            output[num_actual_tokens:].zero_()
        if isinstance(attn_metadata, PhaseSplitMetadata):
            return forward_by_phase(
                self, query, key, value, kv_cache, attn_metadata, output, output_lse
            )
        # Encoder self-attention keeps no cache; backends whose forward writes it do so there.
        writes_cache = self.attn_type not in ENCODER_TYPES and key is not None
        # One check of the whole call before the cache is written (a rejected call changes
        # nothing); the impl's two entry points below skip theirs for this very call.
        check_layer_call(self.impl, self, query, key, value, kv_cache, attn_metadata, output,
                         output_lse, writes_kv=writes_cache)  # fmt: skip
        if writes_cache and not self.backend.forward_includes_kv_cache_update:
            slot_mapping = attn_metadata.slot_mapping
            self.impl.do_kv_cache_update(self, key, value, kv_cache, slot_mapping, attn_metadata)
        return self.impl.forward(
            self, query, key, value, kv_cache, attn_metadata, output, output_lse=output_lse
        )


def resolve_device(
    device: DeviceInfo | torch.device | str | None,
) -> tuple[DeviceInfo, torch.device]:
    """A layer's `device` argument as (the `DeviceInfo` selection judges, where its tensors
    live): a `torch.device` or "cpu" / "cuda" is both; a `DeviceInfo` or "sm90"-style text
    names hardware only (tensors stay on the CPU); None: this machine, tensors on the CPU."""
    if isinstance(device, torch.device) or (
        isinstance(device, str) and not device.strip().lower().startswith("sm")
    ):
        return DeviceInfo.current(torch.device(device)), torch.device(device)
    if isinstance(device, str):
        device = DeviceInfo.parse(device)
    return device or DeviceInfo.current(), torch.device("cpu")


def check_serves(
    owner: str, backend: type[AttentionBackend], config: AttentionSelectorConfig, device: DeviceInfo
) -> None:
    """Raise `ValueError` listing every reason `backend` cannot serve `config` on `device`
    (availability on this machine included); `owner` names the layer."""
    reasons = backend.validate_configuration(config, device)
    if backend.get_unavailable_reason():
        reasons.append(f"not available here: {backend.get_unavailable_reason()}")
    if reasons:
        raise ValueError(
            f"{owner}: backend {backend.get_name()} cannot serve this layer: {'; '.join(reasons)}."
        )
