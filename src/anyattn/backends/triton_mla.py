"""TRITON_MLA: our own Triton kernels over the paged latent cache (docs/mla.md), CUDA only.

- `forward_mqa` (decode rows, absorbed): one launch of `anyattn.ops.mla_decode`; a program
  reads each latent row once for a tile of up to 64 heads, the rope part folded into the same
  scores; split-KV over long contexts when the rows leave the GPU idle, merged by LSE.
- `forward_mha` (prefill rows, up-projected): the new tokens' keys and values (from the given
  latents, through `layer.up_project`) attend causally by `anyattn.ops.unified_attention` over
  a dense cache of one-token blocks; each of the builder's context chunks is gathered from the
  latent cache, dequantised to the model dtype, up-projected and attended the same way without
  the causal mask; `merge_attn_states` joins them by LSE. The kernel wants one head size for
  keys and values: the shorter of `P + R` and `Vd` is padded with zeros (queries too when `Vd`
  is the longer), and the padded output columns are dropped.

Declared: float16 / bfloat16; latent splits `kv_lora_rank` any multiple of 16 up to 512 with
`qk_rope_head_dim` 16, 32 or 64; any block size; fp8 latent caches (one per-layer scale; e4m3
from sm89, as Triton casts it); the decode LSE in natural base; CUDA graphs for uniform
single-token decodes (`triton_mla_builder`); up-projected head sizes `P + R` and `Vd` each at
most 256, the prefill kernel's widest head (`get_mla_head_dims_reason`, which the selector asks
with the config's sizes, when it gives them, and the impl's constructor with its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from anyattn.backends.triton_mla_builder import (
    DenseAttentionPlan,
    TritonMLAMetadata,
    TritonMLAMetadataBuilder,
)
from anyattn.mla_backend import MLAAttentionBackend
from anyattn.mla_impl import MLAAttentionImpl, MLALayer
from anyattn.ops.merge_attn_states import merge_attn_states
from anyattn.ops.mla_decode import mla_decode
from anyattn.ops.unified_attention import UnifiedAttentionParams, unified_attention
from anyattn.types import DeviceInfo
from anyattn.validation_mla import check_mha_inputs, check_mqa_inputs

__all__ = ["TritonMLABackend", "TritonMLAImpl", "TritonMLAMetadataBuilder"]

_ROPE_DIMS = (16, 32, 64)
_MAX_RANK = 512
# unified_attention's widest head (TRITON declares head sizes up to 256).
_MAX_DENSE_HEAD = 256


class TritonMLABackend(MLAAttentionBackend):
    """Declarations of the TRITON_MLA backend."""

    priority: ClassVar[Mapping[str, int]] = {"cuda": 2, "blackwell": 2}

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cuda",)
    supported_features = ("lse",)

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA"

    @staticmethod
    def get_impl_cls() -> type[TritonMLAImpl]:
        return TritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TritonMLAMetadataBuilder]:
        return TritonMLAMetadataBuilder

    @classmethod
    def get_supported_mla_splits(cls) -> list[tuple[int, int]]:
        # The decode kernel pads the latent to a power of two with masks, up to one 512-wide
        # accumulator; multiples of 16 keep every row's loads aligned.
        return [(rank, rope) for rope in _ROPE_DIMS for rank in range(16, _MAX_RANK + 1, 16)]

    @classmethod
    def supports_compute_capability(cls, capability: tuple[int, int]) -> bool:
        return capability >= (8, 0)

    @classmethod
    def get_mla_head_dims_reason(
        cls, qk_nope_head_dim: int | None, qk_rope_head_dim: int | None, v_head_dim: int | None
    ) -> str | None:
        """Refuses `P + R` or `Vd` above 256 (`unified_attention`'s widest head); sizes the
        config does not give are checked by the impl's constructor, which knows them."""
        limit = (
            "supported: qk_nope_head_dim + qk_rope_head_dim and v_head_dim each <= "
            f"{_MAX_DENSE_HEAD}, the prefill kernel's widest head"
        )
        if qk_nope_head_dim is None or qk_rope_head_dim is None or v_head_dim is None:
            return None
        qk = qk_nope_head_dim + qk_rope_head_dim
        if qk > _MAX_DENSE_HEAD or v_head_dim > _MAX_DENSE_HEAD:
            return (
                f"MLA prefill head sizes qk_nope_head_dim + qk_rope_head_dim = {qk}, v_head_dim "
                f"= {v_head_dim} not supported ({limit})"
            )
        return None

    @classmethod
    def supports_combination(cls, config, device: DeviceInfo) -> str | None:
        capability = device.capability
        if config.kv_cache_dtype in ("fp8", "fp8_e4m3") and capability and capability < (8, 9):
            return "fp8 e4m3 KV cache needs compute capability >= 8.9 (Triton's e4m3 casts)"
        return None

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed: pip install 'anyattn[triton]'"
        return None


class TritonMLAImpl(MLAAttentionImpl[TritonMLAMetadata]):
    """TRITON_MLA's two entry points; see the module docstring."""

    metadata_cls = TritonMLAMetadata

    @property
    def _dense_head(self) -> int:
        """Keys and values share one head size in the prefill kernel; the shorter is padded."""
        return max(self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim)

    def forward_mqa(
        self,
        layer: MLALayer,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonMLAMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `MLAAttentionImpl.forward_mqa`."""
        api = "TRITON_MLA forward_mqa"
        md = attn_metadata
        check_mqa_inputs(api, self, layer, q_latent, q_pe, kv_cache, md, output, output_lse)
        if md.decode is None:
            return
        plan = md.decode_plan
        mla_decode(
            q_latent,
            q_pe,
            kv_cache,
            output,
            md.decode.block_table,
            md.decode.seq_lens,
            self.scale,
            k_scale=self.latent_scale(api, layer, kv_cache.device),
            output_lse=output_lse,
            num_splits=plan.num_splits,
            workspace=plan.workspace,
        )

    def forward_mha(
        self,
        layer: MLALayer,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonMLAMetadata,
        output: torch.Tensor,
    ) -> None:
        """See `MLAAttentionImpl.forward_mha`."""
        api = "TRITON_MLA forward_mha"
        md = attn_metadata
        check_mha_inputs(api, self, layer, q, kv_c_normed, k_pe, kv_cache, md, output)
        if md.prefill is None:
            return
        plan = md.prefill_plan
        num_rows, heads, dense = q.shape[0], self.num_heads, self._dense_head
        # query: [T_pre, H, dense], q padded with zero columns when Vd is the wider head.
        query = q if q.shape[2] == dense else _pad_last(q, dense)
        new_kv = self._dense_cache(api, layer, kv_c_normed, k_pe)
        if not plan.chunks:
            result = output if self.v_head_dim == dense else q.new_empty(num_rows, heads, dense)
            self._attend(query, new_kv, result, None, plan.new_tokens)
            if result is not output:
                output.copy_(result[..., : self.v_head_dim])
            return
        # acc, acc_lse: float32 [T_pre, H, dense] and [H, T_pre], each row's running result.
        acc = torch.empty(num_rows, heads, dense, dtype=torch.float32, device=q.device)
        acc_lse = torch.empty(heads, num_rows, dtype=torch.float32, device=q.device)
        self._attend(query, new_kv, acc, acc_lse, plan.new_tokens)
        del new_kv
        for chunk, chunk_plan in zip(md.prefill.chunks, plan.chunks, strict=True):
            c_kv, c_pe = self.read_latents(api, layer, kv_cache, chunk.slots, q.dtype)
            chunk_kv = self._dense_cache(api, layer, c_kv, c_pe)
            rows = slice(chunk_plan.q_start, chunk_plan.q_end)
            part = torch.empty_like(acc[rows])
            part_lse = torch.empty_like(acc_lse[:, rows])
            self._attend(query[rows], chunk_kv, part, part_lse, chunk_plan)
            merge_attn_states(acc[rows], acc[rows], acc_lse[:, rows], part, part_lse,
                              output_lse=acc_lse[:, rows])  # fmt: skip
        output.copy_(acc[..., : self.v_head_dim])

    def _attend(
        self,
        query: torch.Tensor,
        kv: torch.Tensor,
        out: torch.Tensor,
        out_lse: torch.Tensor | None,
        plan: DenseAttentionPlan,
    ) -> None:
        """One `unified_attention` launch of `query [M, H, D]` over the dense cache `kv`."""
        unified_attention(
            query,
            kv,
            out,
            plan.query_start_loc,
            plan.seq_lens,
            plan.block_table,
            plan.num_reqs,
            plan.max_query_len,
            UnifiedAttentionParams(scale=self.scale, causal=plan.causal),
            output_lse=out_lse,
        )

    def _dense_cache(
        self, api: str, layer: MLALayer, c_kv: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        """Up-projected keys and values of latents `c_kv [N, L]`, `k_pe [N, R]` as a cache of N
        one-token blocks `(N, 2, 1, H, D)` (D the dense head; padding columns zero)."""
        k_nope, v = self.up_project(api, layer, c_kv)
        num_rows, heads = c_kv.shape[0], self.num_heads
        nope, rope, vd = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        dense = self._dense_head
        kv = torch.empty(num_rows, 2, heads, dense, dtype=c_kv.dtype, device=c_kv.device)
        kv[:, 0, :, :nope] = k_nope
        kv[:, 0, :, nope : nope + rope] = k_pe[:, None, :]  # one rope key shared by every head
        kv[:, 0, :, nope + rope :] = 0
        kv[:, 1, :, :vd] = v
        kv[:, 1, :, vd:] = 0
        return kv[:, :, None]  # [N, 2, block_size 1, H, D]


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` with zero columns appended to its last dimension, up to `size`."""
    return torch.nn.functional.pad(x, (0, size - x.shape[-1]))


TritonMLAImpl.backend = TritonMLABackend
TritonMLAMetadataBuilder.backend = TritonMLABackend
