"""FLASHINFER: FlashInfer's batch attention wrappers behind the anyattn contract.

The builder (`flashinfer_builder`) calls the wrappers' `plan()` in `build`; `forward` only calls
`run()` (or the plan-free XQA decode, `flashinfer_xqa`). Only FlashInfer's public API is used,
on the releases `flashinfer_version.SUPPORTED_VERSIONS` (another runs, with a warning).

The wrappers are made for "NHD" and handed the logical cache view, whose strides FlashInfer's
kernels read, so NHD and HND caches both work. A window of W keys is `window_left = W - 1`.
LSEs are base 2 (`lse_base_on_e = False`); decodes that XQA runs return none (a forward asking
for one there is refused). fp8 caches take per-tensor scales, which FlashInfer takes as Python
floats: read from the device once per scale tensor (run one eager step before capturing graphs).

Not declared, because FlashInfer's paged kernels would drop or change them: sinks, ALiBi (its
own slopes and distances), per-head fp8 scales, encoder and cross attention, cascade.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from anyattn.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    check_layer_planned,
)
from anyattn.backends.flashinfer_builder import FlashInferMetadataBuilder
from anyattn.backends.flashinfer_metadata import FlashInferMetadata
from anyattn.backends.flashinfer_version import PIP_COMMAND, installed_flashinfer
from anyattn.backends.flashinfer_xqa import run_xqa_decode, xqa_decode_reason
from anyattn.types import DTYPES, AttentionType, MultipleOf, is_fp8_cache
from anyattn.validation import check_forward, check_forward_inputs, check_metadata_type

__all__ = [
    "FlashInferBackend",
    "FlashInferImpl",
    "FlashInferMetadata",
    "FlashInferMetadataBuilder",
]


class FlashInferBackend(AttentionBackend):
    """Declarations of the FLASHINFER backend (see the module docstring)."""

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cuda",)
    supported_attn_types = (AttentionType.DECODER,)
    supported_features = ("sliding_window", "logits_soft_cap", "non_causal", "lse")
    min_compute_capability = (8, 0)
    forward_includes_kv_cache_update = False
    # First on sm90, where it was measured fastest or tied in every phase (benchmarks/RESULTS.md,
    # "Attention kernels, every contender in one run"), and on Blackwell; second to FLASH_ATTN
    # on other CUDA devices.
    priority: ClassVar[Mapping[str, int]] = {"cuda": 1, "hopper": 0, "blackwell": 0}

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls() -> type[FlashInferImpl]:
        return FlashInferImpl

    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # The head dims FlashInfer builds ahead of time for fa2 and fa3.
        return [64, 128, 256]

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        return [16, 32, 64]

    @classmethod
    def supports_combination(cls, config, device) -> str | None:
        cache = config.kv_cache_dtype
        if cache in ("float16", "bfloat16") and DTYPES[cache] != config.dtype:
            return (
                f"kv_cache_dtype {cache} with dtype {str(config.dtype).removeprefix('torch.')} "
                "not supported (FlashInfer's 16-bit kernels need the cache in the model dtype)"
            )
        if config.needs_lse and config.block_size is not None:
            xqa_declines = xqa_decode_reason(
                FlashInferMetadataBuilder.decode_kernel, device.capability, config.block_size,
                config.head_size, config.dtype, config.cache_dtype,
                1.0 if config.has_logits_soft_cap else 0.0,
            )  # fmt: skip
            if xqa_declines is None:
                return (
                    f"LSE with block_size {config.block_size} not supported here "
                    "(its decodes run FlashInfer's XQA kernel, which returns no "
                    "LSE; blocks of 16 or 32 tokens decode through the planned wrapper)"
                )
        return None

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        # (a release outside the tested range is used, with a warning at import)
        importable, _ = installed_flashinfer()
        return None if importable else f"flashinfer is not installed; {PIP_COMMAND}"


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    """The FLASHINFER backend's forward: runs what the builder planned for the step."""

    # FlashInfer's kernels return log2-sum-exp2 of the log2e-scaled scores.
    lse_base_on_e = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # scale name -> (the tensor's identity, its value): read once per scale tensor
        self._scales: dict[str, tuple[tuple[int, int, int], float]] = {}

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `AttentionImpl.forward`. Writes `output[:num_actual_tokens]` (and `output_lse`,
        base 2) with up to three runs: the decodes (the decode wrapper or XQA), the prefills
        with context (paged wrapper), the fresh prefills (ragged wrapper).

        Raises:
            ValueError: a layer the builder was not given, a layer whose parameters differ
                from its record, an LSE asked of decodes XQA runs; the input checks'.
            RuntimeError: metadata of an earlier build whose wrappers have been planned again.
        """
        api = "FLASHINFER forward"
        md = attn_metadata
        check_metadata_type(api, md, FlashInferMetadata)
        check_layer_planned(md.layer_names, layer, api)
        check_forward(self, query, key, value, kv_cache, md, output, output_lse)
        plan = md.plans[layer.layer_name]
        if plan.record != self.layer_params():
            raise ValueError(
                f"{api}: layer {layer.layer_name!r} differs from the record its builder was "
                f"given (got {self.layer_params()}, expected {plan.record})."
            )
        plan.check_current(api)
        if md.num_actual_tokens == 0:
            return output
        k_scale, v_scale = self._kv_scales(layer)
        n = md.decode_rows
        if n and plan.xqa is not None:
            if output_lse is not None:
                raise ValueError(
                    f"{api}: XQA runs this step's decodes and returns no LSE (got output_lse). "
                    "Set FlashInferMetadataBuilder.decode_kernel = 'wrapper' for LSEs."
                )
            table, seq_lens, workspace = plan.xqa
            run_xqa_decode(query[:n], kv_cache, table, seq_lens, scale=self.scale,
                           k_scale=k_scale, v_scale=v_scale, window_left=plan.window_left,
                           workspace=workspace, out=output[:n])  # fmt: skip
        elif n:
            result = plan.decode.run(query[:n], kv_cache, k_scale=k_scale, v_scale=v_scale,
                                     out=output[:n], return_lse=output_lse is not None)  # fmt: skip
            _write_lse(output_lse, (0, n), result)
        want_lse = output_lse is not None
        start, end = md.paged_tokens
        if end > start:
            result = plan.paged.run(query[start:end], kv_cache, k_scale=k_scale, v_scale=v_scale,
                                    out=output[start:end], return_lse=want_lse)  # fmt: skip
            _write_lse(output_lse, (start, end), result)
        start, end = md.ragged_tokens
        if end > start:
            fresh_key, fresh_value = self._fresh_kv(key, value, kv_cache, md.slot_mapping,
                                                    start, end)  # fmt: skip
            result = plan.ragged.run(query[start:end], fresh_key, fresh_value,
                                     out=output[start:end], return_lse=want_lse)  # fmt: skip
            _write_lse(output_lse, (start, end), result)
        return output

    def _fresh_kv(
        self,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        start: int,
        end: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V rows `[start, end)` of fresh prefills: the inputs, or for a layer that reads
        another layer's cache (or gets no key) the cache rows the step wrote."""
        if key is not None and value is not None and self.kv_sharing_target_layer_name is None:
            return key[start:end], value[start:end]
        slots = slot_mapping[start:end]
        block_size = kv_cache.shape[2]
        # [m, 2, num_kv_heads, head_size]: the advanced indices lead the result
        rows = kv_cache[slots // block_size, :, slots % block_size]
        return rows[:, 0], rows[:, 1]

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        attn_metadata: object = None,
    ) -> None:
        """See `AttentionImpl.do_kv_cache_update`; an fp8 cache's scales are checked first, so
        that scales `forward` would refuse never write the cache."""
        if is_fp8_cache(self.kv_cache_dtype):
            for name in ("k_scale", "v_scale"):
                _per_tensor_scale(layer, name)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping, attn_metadata)

    def _kv_scales(self, layer: AttentionLayer) -> tuple[float | None, float | None]:
        if not is_fp8_cache(self.kv_cache_dtype):
            return None, None
        return self._scale(layer, "k_scale"), self._scale(layer, "v_scale")

    def _scale(self, layer: AttentionLayer, name: str) -> float:
        """The layer's per-tensor fp8 scale as a float (FlashInfer takes Python floats), read
        from the device once per scale tensor and kept while the tensor is unchanged."""
        scale = _per_tensor_scale(layer, name)
        identity = (id(scale), scale._version, scale.data_ptr())
        cached = self._scales.get(name)
        if cached is not None and cached[0] == identity:
            return cached[1]
        if scale.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"FLASHINFER forward: layer.{name} has not been read yet and cannot be read "
                "while a CUDA graph is being captured (got a new scale tensor). Run one eager "
                "forward before capturing."
            )
        value = float(scale.item())
        self._scales[name] = (identity, value)
        return value

    def validate_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: FlashInferMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `AttentionImpl.validate_inputs`; shapes, dtypes and the metadata's spec."""
        api = "FLASHINFER forward"
        check_metadata_type(api, md, FlashInferMetadata)
        spec = (md.num_kv_heads, md.head_size)
        if spec != (self.num_kv_heads, self.head_size):
            raise ValueError(
                f"{api}: the metadata was built for another KV-cache spec (got num_kv_heads, "
                f"head_size {spec}, expected {(self.num_kv_heads, self.head_size)})."
            )
        if query.dtype != md.dtype:
            raise ValueError(
                f"{api}: query dtype differs from the KV-cache spec's dtype (got {query.dtype}, "
                f"expected {md.dtype})."
            )
        check_forward_inputs(api, self, query, key, value, kv_cache, md, FlashInferMetadata,
                             output=output, output_lse=output_lse,
                             # graph steps run their padded rows too
                             num_rows=max(md.num_actual_tokens, md.decode_rows))  # fmt: skip
        if kv_cache.dtype != md.cache_dtype:
            raise ValueError(
                f"{api}: kv_cache dtype differs from the KV-cache spec the step was planned for "
                f"(got {kv_cache.dtype}, expected {md.cache_dtype})."
            )
        if not output.is_contiguous() or kv_cache.stride(-1) != 1:
            raise ValueError(
                f"{api}: output must be contiguous and kv_cache's head dimension too (got "
                f"strides {output.stride()} and {kv_cache.stride()}, expected "
                f"{(output.shape[1] * output.shape[2], output.shape[2], 1)} and (..., 1)). "
                "Allocate output with torch.empty and kv_cache in NHD or HND order."
            )


FlashInferImpl.backend = FlashInferBackend
FlashInferMetadataBuilder.backend = FlashInferBackend


def _per_tensor_scale(layer: AttentionLayer, name: str) -> torch.Tensor:
    """`layer.<name>`, checked to be one per-tensor scale (no device read)."""
    scale = getattr(layer, name, None)
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(
            f"FLASHINFER forward: layer.{name} must be a float32 tensor of shape [] (got "
            f"{got}). FlashInfer takes one per-tensor scale; per-head scales are not supported."
        )
    return scale


def _write_lse(output_lse: torch.Tensor | None, rows: tuple[int, int], result: Any) -> None:
    """Copy a wrapper's base-2 LSE `[rows, num_heads]` into `output_lse[:, rows]`."""
    if output_lse is not None:
        _, lse = result
        output_lse[:, rows[0] : rows[1]].copy_(lse.t())
