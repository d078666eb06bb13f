"""FLASH_ATTN: FlashAttention's varlen kernel over the paged KV cache.

Wraps `flash_attn_varlen_func` of the newest installed FlashAttention (FA4, `pip install
'anyattn[flash-attn]'`, else FA3, else FA2); `flash_attn_versions` finds the installed
entry points and declares only what they take (`flash_attn_entry_point`; FA4's declarations
while none is installed). Every layer runs the newest version that serves it on its GPU.

One kernel call serves a whole mixed batch with no reordering: queries by `cu_seqlens_q`, keys
through the page table up to `seqused_k` (FA2: `cu_seqlens_k`). Bottom-right causal alignment
puts query `i` of a request at position `context + i`; a window of W keys is `window_size =
(W - 1, 0)`; LSEs are natural logs and count the sink. `build` (`flash_attn_builder`, which also
describes cascade attention and the CUDA-graph layout) holds every call's arguments; `forward`
only calls the kernel.

KV cache: NHD or HND (FA4 needs the head dim contiguous and 16-byte aligned strides). With
pages of the kernel's TILE_N FA4 loads whole pages by TMA, rows past a request's length
included: they must be finite, as zero-initialised caches (`allocate_kv_cache`) are.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar

import torch

from anyattn.backend import AttentionBackend, AttentionImpl, AttentionLayer, check_layer_planned
from anyattn.backends import flash_attn_versions as versions
from anyattn.backends.flash_attn_builder import (
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
    FlashAttnPass,
)
from anyattn.backends.flash_attn_entry_point import (
    PIP_COMMAND,
    FlashAttnInterface,
    FlashAttnRequest,
)
from anyattn.ops.merge_attn_states import merge_attn_states
from anyattn.types import (
    ENCODER_TYPES,
    AttentionType,
    MultipleOf,
    cache_torch_dtype,
    is_fp8_cache,
)
from anyattn.validation import check_forward, check_forward_inputs

__all__ = [
    "FlashAttentionBackend",
    "FlashAttentionImpl",
    "FlashAttentionMetadata",
    "FlashAttentionMetadataBuilder",
    "FlashAttnPass",
]


class _DeclaredByInstalledVersion(abc.ABCMeta):
    """Class attributes that follow the installed FlashAttention (metaclass properties win over
    the base class's plain attributes, so every reader sees the same answer)."""

    @property
    def supported_kv_cache_dtypes(cls) -> tuple[str, ...]:
        names = [d for i in versions.declared_interfaces() for d in i.kv_cache_dtypes]
        return tuple(dict.fromkeys(names))

    @property
    def supported_attn_types(cls) -> tuple[AttentionType, ...]:
        types = {t for i in versions.declared_interfaces() for t in i.attn_types}
        return tuple(t for t in AttentionType if t in types)

    @property
    def min_compute_capability(cls) -> tuple[int, int]:
        return min(i.min_capability for i in versions.declared_interfaces())

    @property
    def supported_features(cls) -> tuple[str, ...]:
        interfaces = versions.declared_interfaces()
        features = [
            feature
            for feature, attribute in _VERSION_FEATURES
            if any(getattr(i, attribute) for i in interfaces)
        ]
        if "lse" in features:
            features.append("cascade")  # the merge needs both passes' LSEs
        return ("non_causal", *features)


# Features a FlashAttention version may take: (feature, its `FlashAttnInterface` attribute).
_VERSION_FEATURES = (
    ("sink", "sink_arg"),
    ("sliding_window", "has_window"),
    ("alibi", "has_alibi"),
    ("logits_soft_cap", "has_softcap"),
    ("lse", "lse_arg"),
)


class FlashAttentionBackend(AttentionBackend, metaclass=_DeclaredByInstalledVersion):
    """Declarations of the FLASH_ATTN backend: the union over the installed versions; joint
    constraints per version (head size by compute capability, ...) in `validate_configuration`."""

    # Second to FLASHINFER on sm90 and Blackwell (see FlashInferBackend.priority), first on
    # other CUDA devices.
    priority: ClassVar[Mapping[str, int]] = {"cuda": 0, "hopper": 1, "blackwell": 1}

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_device_types = ("cuda",)
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        bases = sorted({i.block_size_multiple for i in versions.declared_interfaces()})
        # A multiple of a larger base is a multiple of a smaller one that divides it.
        kept = [b for b in bases if not any(b % s == 0 for s in bases if s < b)]
        return [MultipleOf(b) for b in kept]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return sorted({s for i in versions.declared_interfaces() for s in i.head_sizes()})

    @classmethod
    def supports_combination(cls, config, device) -> str | None:
        if not is_fp8_cache(config.kv_cache_dtype) and config.cache_dtype != config.dtype:
            return (
                f"kv_cache_dtype {config.kv_cache_dtype} with dtype "
                f"{str(config.dtype).removeprefix('torch.')} not supported (the kernels take "
                "queries and keys of one dtype)"
            )
        return None

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        return versions.unavailable_reason()

    @classmethod
    def validate_configuration(cls, config, device) -> list[str]:
        """The declared checks, then (when they pass on a CUDA device) whether one version takes
        everything together, e.g. head size 192 on sm100 (FA4 takes it on sm90 only)."""
        reasons = super().validate_configuration(config, device)
        sm80_or_newer = device.capability is not None and device.capability >= (8, 0)
        if reasons and sm80_or_newer and not versions.installed_interfaces():
            # (nothing installed: what is declared is FA4, the extra's; name the version that
            # serves an sm80-sm89 GPU instead)
            reasons = [
                f"{r}: FA4, which {PIP_COMMAND} installs, runs on sm90+; "
                "FlashAttention 2 runs on sm80+ (pip install flash-attn)"
                if r.startswith("compute capability")
                else r
                for r in reasons
            ]
        if reasons or not device.is_cuda:
            return reasons
        request = FlashAttnRequest.from_config(config, device)
        chosen, why = versions.choose_interface(versions.declared_interfaces(), request)
        if chosen is None:
            reasons.append(f"no FlashAttention version takes this combination ({'; '.join(why)})")
        return reasons


def _aligned(x: torch.Tensor) -> bool:
    """Whether FlashAttention can write `x` directly: a contiguous last dimension and 16-byte
    aligned start and strides (FA4's forward asserts this of `out`; else we copy)."""
    size = x.element_size()
    return (
        x.stride(-1) == 1
        and x.data_ptr() % 16 == 0
        and all(stride * size % 16 == 0 for stride in x.stride()[:-1])
    )


class FlashAttentionImpl(AttentionImpl[FlashAttentionMetadata]):
    """The FLASH_ATTN backend's forward; see the module docstring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sinks = None if self.sinks is None else self.sinks.detach().float()
        self._request = FlashAttnRequest(
            head_size=self.head_size,
            kv_cache_dtype=self.kv_cache_dtype,
            attn_type=self.attn_type,
            has_alibi=self.alibi_slopes is not None,
            has_sink=self.sinks is not None,
            has_logits_soft_cap=self.logits_soft_cap is not None,
            has_sliding_window=self.sliding_window is not None,
        )
        installed = versions.installed_interfaces()
        if not installed:
            raise ImportError(f"FLASH_ATTN impl: {versions.unavailable_reason()}.")
        chosen, why = versions.choose_interface(installed, self._request)
        if chosen is None:
            raise NotImplementedError(
                f"FLASH_ATTN impl: no installed FlashAttention takes this layer ({'; '.join(why)})."
            )
        self._any_device_interface = chosen
        self._interfaces: dict[torch.device, FlashAttnInterface] = {}

    def _interface_for(self, device: torch.device) -> FlashAttnInterface:
        """The version for `device`'s compute capability, chosen once per device."""
        interface = self._interfaces.get(device)
        if interface is None:
            capability = None
            if device.type == "cuda":
                capability = torch.cuda.get_device_capability(device)
            request = replace(self._request, capability=capability)
            interface, why = versions.choose_interface(versions.installed_interfaces(), request)
            if interface is None:
                raise NotImplementedError(
                    f"FLASH_ATTN forward: no installed FlashAttention runs this layer on "
                    f"{device} ({'; '.join(why)})."
                )
            self._interfaces[device] = interface
        return interface

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `AttentionImpl.forward`. Writes `output[:num_actual_tokens]` (and `output_lse`)."""
        md = attn_metadata
        check_layer_planned(md.layer_names, layer, "FLASH_ATTN forward")
        check_forward(self, query, key, value, kv_cache, md, output, output_lse)
        n = md.num_actual_tokens
        if n == 0:
            return output
        interface = self._interface_for(query.device)
        lse = None if output_lse is None else output_lse[:, :n]
        if self.attn_type in ENCODER_TYPES:
            # Bidirectional self-attention over the step's own keys: no cache.
            out, part_lse = self._attend(
                interface, query[:n], key[:n], value[:n], md.encoder, self.sinks, lse is not None
            )
            self._store(output[:n], out, lse, part_lse)
            return output
        # [num_blocks, block_size, num_kv_heads, head_size] views, strides of the layout
        k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
        if md.main.key_rows is not None:
            blocks, offsets = md.main.key_rows  # [keys, num_kv_heads, head_size] each
            k_cache, v_cache = k_cache[blocks, offsets], v_cache[blocks, offsets]
        q = query[:n]
        if md.prefix is None:
            rows = output[:n]
            out_arg = rows if interface.has_out and _aligned(rows) else None
            out, part_lse = self._attend(
                interface, q, k_cache, v_cache, md.main, self.sinks, lse is not None, out=out_arg
            )
            self._store(output[:n], out, lse, part_lse)
            return output
        prefix_out, prefix_lse = self._attend(interface, q, k_cache, v_cache, md.prefix, None, True)
        suffix_out, suffix_lse = self._attend(
            interface, q, k_cache, v_cache, md.main, self.sinks, True
        )
        merge_attn_states(output[:n], prefix_out, prefix_lse, suffix_out, suffix_lse, lse)
        return output

    def _attend(
        self,
        interface: FlashAttnInterface,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pass_: FlashAttnPass,
        sinks: torch.Tensor | None,
        return_lse: bool,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One kernel call (every FlashAttention call of the backend goes through here)."""
        device = q.device
        # Paged keys by per-request lengths where the entry point takes them; contiguous
        # (encoder) keys and FA2 by cumulative offsets.
        if pass_.page_table is not None and interface.seq_lens_arg:
            lens = {"seq_lens": pass_.seq_lens}
        else:
            lens = {"cu_seqlens_k": pass_.cu_seqlens_k}
        out, lse = interface.call(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=pass_.cu_seqlens_q,
            max_seqlen_q=pass_.max_seqlen_q,
            max_seqlen_k=pass_.max_seqlen_k,
            page_table=pass_.page_table,
            softmax_scale=self.scale,
            causal=pass_.causal,
            window=self.sliding_window,
            softcap=self.logits_soft_cap,
            sinks=None if sinks is None else _on(self, "sinks", device),
            alibi_slopes=None if self.alibi_slopes is None else _on(self, "alibi_slopes", device),
            return_lse=return_lse,
            out=out,
            **lens,
        )
        if return_lse and (lse is None or tuple(lse.shape) != (self.num_heads, q.shape[0])):
            got = None if lse is None else tuple(lse.shape)
            raise RuntimeError(
                f"FLASH_ATTN forward: {interface.label} returned an LSE of an unexpected shape "
                f"(got {got}, expected {(self.num_heads, q.shape[0])})."
            )
        return out, lse

    @staticmethod
    def _store(
        output: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        part_lse: torch.Tensor | None,
    ) -> None:
        if out.data_ptr() != output.data_ptr():
            output.copy_(out)
        if lse is not None:
            lse.copy_(part_lse)

    def validate_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: FlashAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `AttentionImpl.validate_inputs`; shapes, dtypes, devices and feature joints."""
        api = "FLASH_ATTN forward"
        check_forward_inputs(api, self, query, key, value, kv_cache, md, FlashAttentionMetadata,
                             output=output, output_lse=output_lse)  # fmt: skip
        self._check_features(md, output_lse, api)
        interface = self._interface_for(query.device)
        if md.block_size % interface.block_size_multiple:
            raise ValueError(
                f"{api}: {interface.label} needs blocks of a multiple of "
                f"{interface.block_size_multiple} tokens (got block_size {md.block_size})."
            )
        if self.attn_type not in ENCODER_TYPES:
            self._check_cache(query, kv_cache, api)

    def _check_features(
        self, md: FlashAttentionMetadata, output_lse: torch.Tensor | None, api: str
    ) -> None:
        # (a sliding window with non-causal attention: refused by check_forward_inputs)
        if self.attn_type in ENCODER_TYPES and md.encoder is None:
            raise ValueError(
                f"{api}: the metadata was built for no encoder layer (got an "
                f"{self.attn_type.value} layer). Give the builder this layer's record."
            )
        bidirectional = not md.causal or self.attn_type is not AttentionType.DECODER
        if self.alibi_slopes is not None and bidirectional:
            raise NotImplementedError(
                f"{api}: ALiBi with non-causal attention not supported (got "
                "attn_metadata.causal=False); FA2 biases by -slope * |i - j|."
            )
        if md.prefix is not None and (self.alibi_slopes is not None or self.sliding_window):
            raise NotImplementedError(
                f"{api}: cascade attention with ALiBi or a sliding window not supported (got "
                f"common_prefix_len={md.common_prefix_len}). Build without a common prefix."
            )
        if (output_lse is not None or md.prefix is not None) and (
            self._any_device_interface.lse_arg is None
        ):
            raise NotImplementedError(
                f"{api}: {self._any_device_interface.label} returns no LSE (got output_lse or a "
                "cascade prefix)."
            )

    def _check_cache(self, query: torch.Tensor, kv_cache: torch.Tensor, api: str) -> None:
        """What FlashAttention adds to the shared checks: one dtype for q/k/v and a contiguous
        head dimension."""
        cache_dtype = cache_torch_dtype(self.kv_cache_dtype, query.dtype)
        if cache_dtype != query.dtype:
            raise ValueError(
                f"{api}: kv_cache dtype differs from the query's (got {cache_dtype} and "
                f"{query.dtype}, expected one dtype). Use kv_cache_dtype='auto'."
            )
        if kv_cache.stride(-1) != 1:
            raise ValueError(
                f"{api}: kv_cache needs a contiguous head dimension (got strides "
                f"{kv_cache.stride()}). Allocate it in NHD or HND order."
            )


def _on(impl: FlashAttentionImpl, name: str, device: torch.device) -> torch.Tensor:
    """`impl.<name>` on `device`, moved there once and kept."""
    tensor = getattr(impl, name)
    if tensor.device != device:
        tensor = tensor.to(device)
        setattr(impl, name, tensor)
    return tensor


FlashAttentionImpl.backend = FlashAttentionBackend
FlashAttentionMetadataBuilder.backend = FlashAttentionBackend
