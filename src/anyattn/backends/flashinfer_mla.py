"""FLASHINFER_MLA: FlashInfer's MLA kernels behind the MLA contract (docs/mla.md), CUDA only.

- `forward_mqa` (decode rows, absorbed): `flashinfer.mla.BatchMLAPagedAttentionWrapper.run`,
  planned in `build` (`flashinfer_mla_builder`), reading the latent cache as it is: FlashInfer
  takes the packed `[c_kv, k_pe]` rows of the cache and splits them into its ckv / kpe views
  itself, so nothing is copied per step. The query goes in as the split pair
  `(q_latent, q_pe)`; the LSE comes back in natural base.
- `forward_mha` (prefill rows, up-projected): FlashInfer's ragged prefill over keys
  `[k_nope, k_pe]` (`P + R` wide) and values (`Vd` wide) up-projected by the layer, for the new
  tokens (causal) and for each of the builder's context chunks gathered from the latent cache
  (no mask), merged into the running result by LSE (`anyattn.ops.merge_attn_states`).

Only FlashInfer's public API is used (the releases of `flashinfer_version.SUPPORTED_VERSIONS`).
Declared: what ran on an H100 (sm90): float16 / bfloat16 with a cache of the model's dtype,
latent split 512 + 64, up-projected head sizes `P + R = 192` and `Vd = 128` (DeepSeek-V2/V3's),
blocks of 16, 32 and 64 tokens, the decode LSE. Not declared: fp8 latent caches, other splits
(FlashInfer's kernels take `kv_lora_rank` in multiples of 128 with rope 64; not run), other
architectures, CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from anyattn.backends.flashinfer_mla_builder import (
    FlashInferMLAMetadata,
    FlashInferMLAMetadataBuilder,
    MLAWrapperPlan,
)
from anyattn.backends.flashinfer_version import PIP_COMMAND, installed_flashinfer
from anyattn.mla_backend import MLAAttentionBackend
from anyattn.mla_impl import MLAAttentionImpl, MLALayer
from anyattn.ops.merge_attn_states import merge_attn_states
from anyattn.types import DTYPES, DeviceInfo
from anyattn.validation_mla import check_mha_inputs, check_mqa_inputs

__all__ = ["FlashInferMLABackend", "FlashInferMLAImpl", "FlashInferMLAMetadataBuilder"]

# (P + R, Vd) pairs of the up-projected prefill that ran: DeepSeek-V2/V3's. (With Vd = 192,
# FlashInfer 0.7.2's ragged prefill merges its KV splits with a kernel that refuses head 192.)
_PREFILL_HEAD_DIMS = ((192, 128),)


class FlashInferMLABackend(MLAAttentionBackend):
    """Declarations of the FLASHINFER_MLA backend (see the module docstring)."""

    # First among the MLA backends on Hopper, where it ran (it decodes about twice as fast as
    # TRITON_MLA there: benchmarks/RESULTS.md).
    priority: ClassVar[Mapping[str, int]] = {"cuda": 1}

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16")
    supported_device_types = ("cuda",)
    supported_features = ("lse",)

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER_MLA"

    @staticmethod
    def get_impl_cls() -> type[FlashInferMLAImpl]:
        return FlashInferMLAImpl

    @staticmethod
    def get_builder_cls() -> type[FlashInferMLAMetadataBuilder]:
        return FlashInferMLAMetadataBuilder

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int]:
        return [16, 32, 64]

    @classmethod
    def get_supported_mla_splits(cls) -> list[tuple[int, int]]:
        return [(512, 64)]

    @classmethod
    def supports_compute_capability(cls, capability: tuple[int, int]) -> bool:
        return capability == (9, 0)

    @classmethod
    def supports_combination(cls, config, device: DeviceInfo) -> str | None:
        cache = config.kv_cache_dtype
        if cache in ("float16", "bfloat16") and DTYPES[cache] != config.dtype:
            return (
                f"kv_cache_dtype {cache} with dtype {str(config.dtype).removeprefix('torch.')} "
                "not supported (FlashInfer's MLA kernels need the cache in the model dtype)"
            )
        return None

    @classmethod
    def get_mla_head_dims_reason(
        cls, qk_nope_head_dim: int | None, qk_rope_head_dim: int | None, v_head_dim: int | None
    ) -> str | None:
        """Refuses up-projected head sizes other than `_PREFILL_HEAD_DIMS`; sizes the config
        does not give are checked by the impl's constructor."""
        if qk_nope_head_dim is None or qk_rope_head_dim is None or v_head_dim is None:
            return None
        if (qk_nope_head_dim + qk_rope_head_dim, v_head_dim) in _PREFILL_HEAD_DIMS:
            return None
        pairs = ", ".join(f"{qk}/{vd}" for qk, vd in _PREFILL_HEAD_DIMS)
        return (
            f"prefill head sizes qk_nope_head_dim + qk_rope_head_dim / v_head_dim = "
            f"{qk_nope_head_dim + qk_rope_head_dim}/{v_head_dim} not supported (supported: "
            f"{pairs})"
        )

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        importable, _ = installed_flashinfer()
        return None if importable else f"flashinfer is not installed; {PIP_COMMAND}"


class FlashInferMLAImpl(MLAAttentionImpl[FlashInferMLAMetadata]):
    """FLASHINFER_MLA's two entry points; see the module docstring."""

    metadata_cls = FlashInferMLAMetadata

    def forward_mqa(
        self,
        layer: MLALayer,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMLAMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `MLAAttentionImpl.forward_mqa`."""
        api = "FLASHINFER_MLA forward_mqa"
        md = attn_metadata
        check_mqa_inputs(api, self, layer, q_latent, q_pe, kv_cache, md, output, output_lse)
        if md.decode is None:
            return
        plan = self._plan(api, layer, md)
        rows, heads = md.num_decode_tokens, self.num_heads
        assert md.decode_lse is not None  # planned with every decode part
        lse = md.decode_lse[: rows * heads].view(rows, heads)
        plan.decode.run(query=(q_latent[:rows], q_pe[:rows]), kv_cache=kv_cache,
                        out=output[:rows], lse=lse, return_lse=True,
                        return_lse_base_on_e=True)  # fmt: skip
        if output_lse is not None:
            output_lse[:, :rows].copy_(lse.t())

    def forward_mha(
        self,
        layer: MLALayer,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMLAMetadata,
        output: torch.Tensor,
    ) -> None:
        """See `MLAAttentionImpl.forward_mha`."""
        api = "FLASHINFER_MLA forward_mha"
        md = attn_metadata
        check_mha_inputs(api, self, layer, q, kv_c_normed, k_pe, kv_cache, md, output)
        if md.prefill is None:
            return
        plan = self._plan(api, layer, md)
        assert plan.new_tokens is not None  # planned with every prefill part
        keys, values = self.up_projected_keys_values(api, layer, kv_c_normed, k_pe)
        rows = plan.new_tokens.q_end
        if not plan.chunks:
            plan.new_tokens.wrapper.run(q[:rows], keys, values, out=output[:rows])
            return
        # acc_lse: float32 [H, T_pre], each row's running LSE; the running output is `output`.
        acc_lse = torch.empty(self.num_heads, rows, dtype=torch.float32, device=q.device)
        plan.new_tokens.wrapper.run(q[:rows], keys, values, out=output[:rows], lse=acc_lse,
                                    return_lse=True, lse_base="ln", lse_layout="HN")  # fmt: skip
        del keys, values
        for chunk, launches in zip(md.prefill.chunks, plan.chunks, strict=True):
            c_kv, c_pe = self.read_latents(api, layer, kv_cache, chunk.slots, q.dtype)
            keys, values = self.up_projected_keys_values(api, layer, c_kv, c_pe)
            for launch in launches:
                qs, ks = (
                    slice(launch.q_start, launch.q_end),
                    slice(launch.key_start, launch.key_end),
                )
                part = torch.empty_like(output[qs])
                part_lse = torch.empty_like(acc_lse[:, qs])
                launch.wrapper.run(q[qs], keys[ks], values[ks], out=part, lse=part_lse,
                                   return_lse=True, lse_base="ln", lse_layout="HN")  # fmt: skip
                merge_attn_states(output[qs], output[qs], acc_lse[:, qs], part, part_lse,
                                  output_lse=acc_lse[:, qs])  # fmt: skip

    def _plan(self, api: str, layer: MLALayer, md: FlashInferMLAMetadata) -> MLAWrapperPlan:
        plan = md.plans[layer.layer_name]  # the layer name was checked with the inputs
        plan.check_current(api)
        return plan


FlashInferMLAImpl.backend = FlashInferMLABackend
FlashInferMLAMetadataBuilder.backend = FlashInferMLABackend
