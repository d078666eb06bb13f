"""TORCH_MLA: the reference MLA backend, in plain PyTorch, for the CPU and any CUDA GPU.

Every other MLA backend is judged against it, so it is written to be read (docs/mla.md has the
math): any latent split, float32 / float16 / bfloat16, fp8 latent caches (one per-layer scale),
LSE in natural base. Scores, softmax and merges run in float32.

- `forward_mqa` (decode rows): each row's request's blocks are gathered whole, the latent rows
  dequantised (`cache.float() * k_scale` for fp8), and the absorbed query `[q_latent, q_pe]`
  attends them as MQA: keys are whole rows, values their first L columns.
- `forward_mha` (prefill rows): each request's new tokens attend causally to each other, with
  keys and values up-projected from the given latents (not read back from the cache); then each
  of the builder's context chunks is gathered, dequantised to the model dtype, up-projected by
  `layer.up_project` and attended without a mask by the queries of the requests it holds, and
  merged into their running result by LSE.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import ClassVar

import torch

from anyattn.backends.mla_builder import MLAMetadataBuilder
from anyattn.backends.mla_metadata import MLAMetadata
from anyattn.mla_backend import MLAAttentionBackend
from anyattn.mla_impl import MLAAttentionImpl, MLALayer
from anyattn.types import is_fp8_cache
from anyattn.validation import layer_kv_scale
from anyattn.validation_mla import check_mha_inputs, check_mqa_inputs

__all__ = ["TorchMLABackend", "TorchMLAImpl", "TorchMLAMetadataBuilder"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TorchMLABackend(MLAAttentionBackend):
    """Declarations of the TORCH_MLA backend: any latent split, any block size."""

    priority: ClassVar[Mapping[str, int]] = {"cpu": 0, "cuda": 4, "blackwell": 4}

    supported_dtypes = _DTYPES
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cpu", "cuda")

    @staticmethod
    def get_name() -> str:
        return "TORCH_MLA"

    @staticmethod
    def get_impl_cls() -> type[TorchMLAImpl]:
        return TorchMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TorchMLAMetadataBuilder]:
        return TorchMLAMetadataBuilder

    @classmethod
    def supports_lse(cls) -> bool:
        return True


class TorchMLAMetadataBuilder(MLAMetadataBuilder):
    """The shared MLA builder, its spec checked against TORCH_MLA's declarations."""


class TorchMLAImpl(MLAAttentionImpl[MLAMetadata]):
    """TORCH_MLA's two entry points; see the module docstring."""

    metadata_cls = MLAMetadata
    supported_dtypes = _DTYPES

    def forward_mqa(
        self,
        layer: MLALayer,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: MLAMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `MLAAttentionImpl.forward_mqa`."""
        api = "TORCH_MLA forward_mqa"
        md = attn_metadata
        check_mqa_inputs(api, self, layer, q_latent, q_pe, kv_cache, md, output, output_lse)
        if md.decode is None:
            return
        dec, rows = md.decode, md.num_decode_tokens
        num_blocks = -(-dec.max_seq_len // md.block_size)
        # keys: [rows, max_seq_len, L + R], each row's request's cache rows in order
        keys = kv_cache[dec.block_table[:, :num_blocks].long()].flatten(1, 2)
        keys = self._dequantize(api, layer, keys[:, : dec.max_seq_len], torch.float32)
        q = torch.cat([q_latent, q_pe], dim=-1).float()  # [rows, H, L + R]
        scores = torch.einsum("thd,tnd->thn", q, keys) * self.scale
        positions = torch.arange(dec.max_seq_len, device=keys.device)
        is_key = positions[None, :] < dec.seq_lens[:, None]  # [rows, max_seq_len]
        scores.masked_fill_(~is_key[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [rows, H]
        probs = torch.exp(scores - lse[..., None])
        out = torch.einsum("thn,tnl->thl", probs, keys[..., : self.kv_lora_rank])
        output.copy_(out)
        if output_lse is not None:
            output_lse[:, :rows] = lse.T

    def forward_mha(
        self,
        layer: MLALayer,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: MLAMetadata,
        output: torch.Tensor,
    ) -> None:
        """See `MLAAttentionImpl.forward_mha`."""
        api = "TORCH_MLA forward_mha"
        md = attn_metadata
        check_mha_inputs(api, self, layer, q, kv_c_normed, k_pe, kv_cache, md, output)
        if md.prefill is None:
            return
        pre = md.prefill
        keys, values = self._up_project(api, layer, kv_c_normed, k_pe)
        # acc, acc_lse: float32 [T_pre, H, Vd] and [H, T_pre], the running result of each row
        acc = torch.empty(output.shape, dtype=torch.float32, device=q.device)
        acc_lse = torch.empty(self.num_heads, q.shape[0], dtype=torch.float32, device=q.device)
        loc = pre.query_start_loc_cpu.tolist()
        for start, end in itertools.pairwise(loc):
            rows = slice(start, end)
            acc[rows], acc_lse[:, rows] = _attend(
                q[rows], keys[rows], values[rows], self.scale, causal=True
            )
        for chunk in pre.chunks:
            latent = kv_cache[chunk.slots // md.block_size, chunk.slots % md.block_size]
            latent = self._dequantize(api, layer, latent, q.dtype)  # [N, L + R]
            c_kv, c_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            chunk_keys, chunk_values = self._up_project(api, layer, c_kv, c_pe)
            for piece in chunk.pieces:
                rows = slice(piece.q_start, piece.q_start + piece.q_len)
                keys_of = slice(piece.row_start, piece.row_start + piece.row_len)
                part, part_lse = _attend(
                    q[rows], chunk_keys[keys_of], chunk_values[keys_of], self.scale, causal=False
                )
                _merge_into(acc[rows], acc_lse[:, rows], part, part_lse)
        output.copy_(acc)

    def _up_project(
        self, api: str, layer: MLALayer, c_kv: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[N, H, P + R]` (the rope key shared by every head) and values `[N, H, Vd]`."""
        k_nope, v = layer.up_project(c_kv)
        num_rows, heads = c_kv.shape[0], self.num_heads
        if tuple(k_nope.shape) != (num_rows, heads, self.qk_nope_head_dim) or tuple(v.shape) != (
            num_rows,
            heads,
            self.v_head_dim,
        ):
            raise ValueError(
                f"{api}: layer.up_project returned k_nope {list(k_nope.shape)} and v "
                f"{list(v.shape)} (expected [{num_rows}, {heads}, {self.qk_nope_head_dim}] and "
                f"[{num_rows}, {heads}, {self.v_head_dim}])."
            )
        keys = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1).to(k_nope.dtype)], -1)
        return keys, v

    def _dequantize(
        self, api: str, layer: MLALayer, rows: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Cache rows as `dtype`: `rows.float() * k_scale` for an fp8 cache, else a cast."""
        if not is_fp8_cache(self.kv_cache_dtype):
            return rows.to(dtype)
        scale = layer_kv_scale(api, layer, "k_scale", 1, rows.device)
        return (rows.float() * scale.reshape(())).to(dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `q [M, H, D]` over `k [N, H, D]`, `v [N, H, Dv]` in float32; with
    `causal`, query i sees keys j <= i (M == N: a request's new tokens among themselves).

    Returns out float32 `[M, H, Dv]` and natural-log lse float32 `[H, M]`."""
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k.float()) * scale
    if causal:
        future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1)
        scores.masked_fill_(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hmn,nhv->mhv", torch.exp(scores - lse[..., None]), v.float())
    return out, lse


def _merge_into(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Merge a partial result over other keys into `out [M, H, Dv]`, `lse [H, M]` (views of
    the running result, updated in place): weights `exp(lse_side - lse_union)`."""
    merged = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - merged).T[..., None]).add_(
        part * torch.exp(part_lse - merged).T[..., None]
    )
    lse.copy_(merged)


TorchMLAImpl.backend = TorchMLABackend
TorchMLAMetadataBuilder.backend = TorchMLABackend
