"""TORCH_MLA: the reference MLA backend, in plain PyTorch, for the CPU and any CUDA GPU.

Every other MLA backend is judged against it, so it is written to be read (docs/mla.md has the
math): any latent split, float32 / float16 / bfloat16, fp8 latent caches (one per-layer scale),
LSE in natural base. Scores, softmax and merges run in float32.

- `forward_mqa` (decode rows): the absorbed query `[q_latent, q_pe]` attends each row's own
  dequantised cache rows as MQA (keys whole rows, values their first L columns), in groups of
  rows whose gathered keys stay under `MAX_WORK_ELEMENTS`.
- `forward_mha` (prefill rows): each request's new tokens attend causally to each other (keys
  and values up-projected from the given latents), then to each of the builder's context
  chunks (read from the cache, up-projected, unmasked), merged by LSE; queries in tiles whose
  scores stay under `MAX_WORK_ELEMENTS`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import ClassVar

import torch

from anyattn.backends.mla_builder import MLAMetadataBuilder
from anyattn.backends.mla_metadata import MLADecodeMetadata, MLAMetadata
from anyattn.mla_backend import MLAAttentionBackend
from anyattn.mla_impl import MLAAttentionImpl, MLALayer
from anyattn.ops.merge_attn_states import merge_attn_states
from anyattn.validation_mla import check_mha_inputs, check_mqa_inputs

__all__ = ["MAX_WORK_ELEMENTS", "TorchMLABackend", "TorchMLAImpl", "TorchMLAMetadataBuilder"]

# Most float32 elements (256 MiB) of one intermediate (gathered decode keys, a tile's scores),
# so that memory does not grow with the batch or the prompt.
MAX_WORK_ELEMENTS = 1 << 26


class TorchMLABackend(MLAAttentionBackend):
    """Declarations of the TORCH_MLA backend: any latent split, any block size."""

    priority: ClassVar[Mapping[str, int]] = {"cpu": 0, "cuda": 4, "blackwell": 4}

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cpu", "cuda")
    supported_features = ("lse",)

    @staticmethod
    def get_name() -> str:
        return "TORCH_MLA"

    @staticmethod
    def get_impl_cls() -> type[TorchMLAImpl]:
        return TorchMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TorchMLAMetadataBuilder]:
        return TorchMLAMetadataBuilder


class TorchMLAMetadataBuilder(MLAMetadataBuilder):
    """The shared MLA builder, its spec checked against TORCH_MLA's declarations."""


class TorchMLAImpl(MLAAttentionImpl[MLAMetadata]):
    """TORCH_MLA's two entry points; see the module docstring."""

    metadata_cls = MLAMetadata

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
        api, md = "TORCH_MLA forward_mqa", attn_metadata
        check_mqa_inputs(api, self, layer, q_latent, q_pe, kv_cache, md, output, output_lse)
        if md.decode is None:
            return
        q = torch.cat([q_latent, q_pe], dim=-1)  # [rows, H, L + R]
        seq_lens = md.decode.seq_lens_cpu.tolist()
        per_key = self.head_size + self.num_heads  # a key row and its scores, float32
        for start, end in _groups(seq_lens, MAX_WORK_ELEMENTS // per_key):
            rows = slice(start, end)
            output[rows], lse = self._decode(api, layer, q[rows], kv_cache, md.decode, rows,
                                             max(seq_lens[rows]), md.block_size)  # fmt: skip
            if output_lse is not None:
                output_lse[:, rows] = lse.T

    def _decode(
        self, api: str, layer: MLALayer, q: torch.Tensor, kv_cache: torch.Tensor,
        dec: MLADecodeMetadata, rows: slice, max_seq_len: int, block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Absorbed attention of decode `rows` (queries `q [g, H, L + R]`), whose longest
        sequence is `max_seq_len`: latent output float32 `[g, H, L]`, lse float32 `[g, H]`."""
        seq_lens = dec.seq_lens[rows].long()
        num_blocks = -(-max_seq_len // block_size)
        table = dec.block_table[rows, :num_blocks].long()
        # Entries past a row's own blocks are unspecified: read the null block there instead.
        columns = torch.arange(num_blocks, device=table.device)
        table = torch.where(columns[None, :] * block_size < seq_lens[:, None], table, 0)
        # keys: [g, max_seq_len, L + R], each row's request's cache rows in order
        keys = kv_cache[table].flatten(1, 2)[:, :max_seq_len]
        keys = self.dequantize_latent(api, layer, keys, torch.float32)
        positions = torch.arange(max_seq_len, device=keys.device)
        is_key = positions[None, :] < seq_lens[:, None]  # [g, max_seq_len]
        # Zeroed, not only masked: a row that is no key may hold NaN (0 * NaN is NaN).
        keys = torch.where(is_key[..., None], keys, 0.0)
        scores = torch.einsum("thd,tnd->thn", q.float(), keys) * self.scale
        scores.masked_fill_(~is_key[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [g, H]
        probs = torch.exp(scores - lse[..., None])
        return torch.einsum("thn,tnl->thl", probs, keys[..., : self.kv_lora_rank]), lse

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
        api, pre = "TORCH_MLA forward_mha", attn_metadata.prefill
        check_mha_inputs(api, self, layer, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output)
        if pre is None:
            return
        keys, values = self.up_projected_keys_values(api, layer, kv_c_normed, k_pe)
        # acc, acc_lse: float32 [T_pre, H, Vd] and [H, T_pre], the running result of each row
        acc = torch.empty(output.shape, dtype=torch.float32, device=q.device)
        acc_lse = torch.empty(self.num_heads, q.shape[0], dtype=torch.float32, device=q.device)
        for start, end in itertools.pairwise(pre.query_start_loc_cpu.tolist()):
            rows = slice(start, end)
            acc[rows], acc_lse[:, rows] = _attend(q[rows], keys[rows], values[rows], self.scale)
        for chunk in pre.chunks:
            c_kv, c_pe = self.read_latents(api, layer, kv_cache, chunk.slots, q.dtype)
            chunk_keys, chunk_values = self.up_projected_keys_values(api, layer, c_kv, c_pe)
            for piece in chunk.pieces:
                rows = slice(piece.q_start, piece.q_start + piece.q_len)
                keys_of = slice(piece.row_start, piece.row_start + piece.row_len)
                part, part_lse = _attend(q[rows], chunk_keys[keys_of], chunk_values[keys_of],
                                         self.scale, causal=False)  # fmt: skip
                # the running side always has a key (the row's own token)
                merge_attn_states(acc[rows], acc[rows], acc_lse[:, rows], part, part_lse,
                                  acc_lse[:, rows], impl="torch")  # fmt: skip
        output.copy_(acc)


def _groups(seq_lens: list[int], max_keys: int) -> Iterator[tuple[int, int]]:
    """Consecutive `[start, end)` groups of decode rows whose padded key count (rows times the
    group's longest sequence) stays within `max_keys`; a row alone may exceed it."""
    start, longest = 0, 0
    for row, seq_len in enumerate(seq_lens):
        longest = max(longest, seq_len)
        if row > start and (row + 1 - start) * longest > max_keys:
            yield start, row
            start, longest = row, seq_len
    if seq_lens:
        yield start, len(seq_lens)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `q [M, H, D]` over `k [N, H, D]`, `v [N, H, Dv]` in float32; with
    `causal`, query i sees keys j <= i (M == N). Returns out float32 `[M, H, Dv]` and
    natural-log lse float32 `[H, M]`."""
    num_q, num_k, heads = q.shape[0], k.shape[0], q.shape[1]
    out = torch.empty(num_q, heads, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(heads, num_q, dtype=torch.float32, device=q.device)
    tile = max(1, MAX_WORK_ELEMENTS // max(1, heads * num_k))
    for start in range(0, num_q, tile):
        end = min(start + tile, num_q)
        # A causal tile sees keys up to its last query only.
        keys_end = end if causal else num_k
        scores = torch.einsum("mhd,nhd->hmn", q[start:end].float(), k[:keys_end].float())
        scores *= scale
        if causal:
            query_pos = torch.arange(start, end, device=q.device)
            future = torch.arange(keys_end, device=q.device)[None, :] > query_pos[:, None]
            scores.masked_fill_(future, float("-inf"))
        lse[:, start:end] = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[:, start:end, None])
        out[start:end] = torch.einsum("hmn,nhv->mhv", probs, v[:keys_end].float())
    return out, lse


TorchMLAImpl.backend = TorchMLABackend
TorchMLAMetadataBuilder.backend = TorchMLABackend
