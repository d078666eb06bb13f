"""`MLAAttentionImpl`: the impl side of multi-head latent attention (docs/mla.md).

One instance per MLA layer; its shared constructor checks the arguments against the backend
(`anyattn.impl_args`). There is no `forward`: the layer (`anyattn.MLAAttention`) writes the
step's latents (`do_kv_cache_update`), then runs its decode rows absorbed (`forward_mqa`) and
its prefill rows up-projected (`forward_mha`). No entry point plans.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Generic, NoReturn, Protocol, TypeVar

import torch

from anyattn.impl import AttentionImplBase
from anyattn.impl_args import validate_mla_impl_arguments
from anyattn.layer_params import DEFAULT_WORKSPACE_TOKENS, MLALayerParams
from anyattn.ops.concat_and_cache_mla import concat_and_cache_mla_unchecked
from anyattn.types import AttentionType, is_fp8_cache
from anyattn.validation import layer_kv_scale
from anyattn.validation_mla import check_mla_kv_write

__all__ = ["MLAAttentionImpl", "MLALayer"]

M = TypeVar("M")


class MLALayer(Protocol):
    """What an MLA impl may read from the layer that calls it."""

    layer_name: str
    k_scale: torch.Tensor  # float32 []: the one scale of an fp8 latent cache

    def up_project(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`c_kv [N, L]` -> `(k_nope [N, H, P], v [N, H, Vd])` through the layer's kv_b_proj."""


class MLAAttentionImpl(AttentionImplBase[M], Generic[M]):
    """Multi-head latent attention: the cache holds one latent row `[c_kv, k_pe]` per token.

    Subclasses set `backend` (an `MLAAttentionBackend`, whose `supported_dtypes` the inputs
    are checked against) and `metadata_cls` (the metadata their builder makes, checked on
    every call), and implement `forward_mqa` and `forward_mha`.
    """

    params_cls: ClassVar[type[MLALayerParams]] = MLALayerParams
    metadata_cls: ClassVar[type]

    def __init__(
        self,
        num_heads: int,
        scale: float,
        *,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        qk_nope_head_dim: int,
        v_head_dim: int,
        kv_cache_dtype: str = "auto",
        kv_sharing_target_layer_name: str | None = None,
        workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
    ) -> None:
        """Check the arguments against `self.backend` and keep them.

        Args:
            num_heads: H, query heads.
            scale: the softmax scale (DeepSeek with YaRN: `mscale^2 / sqrt(P + R)`).
            kv_lora_rank: L; qk_rope_head_dim: R; qk_nope_head_dim: P; v_head_dim: Vd.
            kv_cache_dtype: "auto" or one of `anyattn.types.CACHE_DTYPES` the backend declares.
            kv_sharing_target_layer_name: a layer whose cache this one reads (writes nothing).
            workspace_tokens: most latent context rows a prefill reads at once (the builder
                plans chunks of it; at least one block).

        Kept: those arguments, `head_size = L + R`, `num_kv_heads = 1`, `attn_type` decoder.

        Raises:
            TypeError: the class names no backend, or a non-MLA one.
            ValueError: a malformed size or scale, or a latent split, row size, cache dtype or
                up-projected head sizes (`get_mla_head_dims_reason`) the backend refuses.
        """
        validate_mla_impl_arguments(
            self._declared_backend("MLAAttentionBackend"),
            num_heads=num_heads,
            scale=scale,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            qk_nope_head_dim=qk_nope_head_dim,
            v_head_dim=v_head_dim,
            kv_cache_dtype=kv_cache_dtype,
            workspace_tokens=workspace_tokens,
        )
        self.num_heads, self.num_kv_heads, self.scale = num_heads, 1, float(scale)
        self.head_size = kv_lora_rank + qk_rope_head_dim
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        self.kv_cache_dtype, self.workspace_tokens = kv_cache_dtype, workspace_tokens
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = AttentionType.DECODER

    def layer_params(self) -> MLALayerParams:
        """This layer's record for its builder (`MLALayerParams`)."""
        return self.params_cls(
            num_heads=self.num_heads,
            num_kv_heads=1,
            head_size=self.head_size,
            scale=self.scale,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
            workspace_tokens=self.workspace_tokens,
        )

    def forward(self, *args: object, **kwargs: object) -> NoReturn:
        """MLA impls have no `forward`: a `TypeError` names the two entry points instead."""
        raise TypeError(
            f"{type(self).__name__}.forward: an MLA impl has no forward (got a call to forward, "
            "expected forward_mqa for decode rows and forward_mha for prefill rows). Use "
            "anyattn.MLAAttention, which splits a step and calls both."
        )

    @abstractmethod
    def forward_mqa(
        self,
        layer: MLALayer,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: M,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """Decode rows, absorbed: MQA over the latent cache with one shared KV head.

        Args:
            layer: the calling layer (`layer_name`; `k_scale` for an fp8 cache).
            q_latent: `[T_dec, H, L]`, `W_UK[h]^T q_nope[t, h]`, model dtype.
            q_pe: `[T_dec, H, R]`, the rotated rope part of the queries.
            kv_cache: `(num_blocks, block_size, L + R)`; keys are whole rows, values their
                first L columns.
            attn_metadata: the step's metadata; `T_dec` is its `num_decode_tokens`.
            output: `[T_dec, H, L]`, written with the latent output.
            output_lse: float32 `[H, >= T_dec]` to receive each row's natural-log LSE.
        """

    @abstractmethod
    def forward_mha(
        self,
        layer: MLALayer,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: M,
        output: torch.Tensor,
    ) -> None:
        """Prefill rows, up-projected: each request's new tokens attend causally to each
        other (keys and values up-projected from `kv_c_normed`) and to its cached context,
        read in the builder's chunks and up-projected by `layer.up_project`, merged by LSE.

        Args:
            q: `[T_pre, H, P + R]`, rope applied; `T_pre` is the metadata's
                `num_prefill_tokens`.
            kv_c_normed: `[T_pre, L]`, the new tokens' normalised latents.
            k_pe: `[T_pre, R]`, their rotated rope keys.
            output: `[T_pre, H, Vd]`.
        """

    def do_kv_cache_update(
        self,
        layer: MLALayer,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        attn_metadata: object = None,
    ) -> None:
        """Write the step's latent rows `[kv_c_normed, k_pe]` (`[T, L]`, `[T, R]`) into the
        cache (slot -1 skipped) after `anyattn.validation_mla.check_mla_kv_write`; with the
        step's `attn_metadata` the slots are checked from its CPU mirrors. Layers that share
        another layer's cache write nothing."""
        if self.kv_sharing_target_layer_name is not None:
            return
        scale = check_mla_kv_write(self, layer, kv_c_normed, k_pe, kv_cache, slot_mapping,
                                   attn_metadata)  # fmt: skip
        concat_and_cache_mla_unchecked(kv_c_normed, k_pe, kv_cache, slot_mapping,
                                       self.kv_cache_dtype, scale)  # fmt: skip

    def up_project(
        self, api: str, layer: MLALayer, c_kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer.up_project(c_kv)` for latents `c_kv [N, L]`: `(k_nope [N, H, P], v [N, H, Vd])`;
        a `ValueError` names other shapes the layer returned."""
        k_nope, v = layer.up_project(c_kv)
        num_rows, heads = c_kv.shape[0], self.num_heads
        want = ((num_rows, heads, self.qk_nope_head_dim), (num_rows, heads, self.v_head_dim))
        if (tuple(k_nope.shape), tuple(v.shape)) != want:
            raise ValueError(
                f"{api}: layer.up_project returned k_nope {list(k_nope.shape)} and v "
                f"{list(v.shape)} (expected {list(want[0])} and {list(want[1])})."
            )
        return k_nope, v

    def up_projected_keys_values(
        self, api: str, layer: MLALayer, c_kv: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys `[N, H, P + R]` (`[k_nope, k_pe]`, the rope key `k_pe [N, R]` shared by every
        head) and values `[N, H, Vd]` of latents `c_kv [N, L]` (`up_project`'s checks)."""
        k_nope, v = self.up_project(api, layer, c_kv)
        rope = k_pe[:, None, :].expand(-1, self.num_heads, -1).to(k_nope.dtype)
        return torch.cat([k_nope, rope], dim=-1), v

    def latent_scale(self, api: str, layer: MLALayer, device: torch.device) -> torch.Tensor | None:
        """The fp8 latent cache's per-layer scale (`layer.k_scale`, shape `[]`, on `device`);
        None for a cache in a 16- or 32-bit dtype."""
        if not is_fp8_cache(self.kv_cache_dtype):
            return None
        return layer_kv_scale(api, layer, "k_scale", 1, device).reshape(())

    def read_latents(
        self,
        api: str,
        layer: MLALayer,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache rows at `slots [N]` (int64, `block_id * block_size + offset`) as `dtype`
        (`dequantize_latent`), split into `c_kv [N, L]` and `k_pe [N, R]`."""
        block_size = kv_cache.shape[1]
        rows = kv_cache[slots // block_size, slots % block_size]  # [N, L + R]
        rows = self.dequantize_latent(api, layer, rows, dtype)
        return rows.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)

    def dequantize_latent(
        self, api: str, layer: MLALayer, rows: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Cache rows as `dtype`: `rows.float() * k_scale` for an fp8 cache, else a cast."""
        scale = self.latent_scale(api, layer, rows.device)
        if scale is None:
            return rows.to(dtype)
        return (rows.float() * scale).to(dtype)
