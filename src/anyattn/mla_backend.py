"""`MLAAttentionBackend`: the declarations every MLA backend shares (docs/mla.md).

The cache holds one latent row `[c_kv (L), k_pe (R)]` per token: logical shape
`(num_blocks, block_size, L + R)`, no K/V or head axis, hence one layout. MLA is causal decoder
attention only. A backend declares the rest, with its latent splits
(`get_supported_mla_splits`) and prefill head sizes (`get_mla_head_dims_reason`).
"""

from __future__ import annotations

from typing import ClassVar

from anyattn.declarations import AttentionBackend
from anyattn.types import AttentionType, KVCacheLayout

__all__ = ["MLAAttentionBackend"]


class MLAAttentionBackend(AttentionBackend):
    """Declarations shared by MLA backends: latent cache shape, one layout, decoder only."""

    supported_attn_types: ClassVar[tuple[AttentionType, ...]] = (AttentionType.DECODER,)

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: str = "auto",
    ) -> tuple[int, ...]:
        """`(num_blocks, block_size, head_size)`: one latent row of `L + R` per token.

        Raises:
            ValueError: `num_kv_heads` other than 1, a bad dimension, or a block size the
                kernels cannot take.
        """
        # the base class's checks of the other arguments
        super().get_kv_cache_shape(num_blocks, block_size, 1, head_size, cache_dtype)
        if num_kv_heads != 1:
            raise ValueError(
                f"{cls.get_name()}.get_kv_cache_shape: num_kv_heads must be 1 for an MLA latent "
                f"cache (got {num_kv_heads!r}); MLA caches one latent row per token, shared by "
                "every head."
            )
        return (num_blocks, block_size, head_size)

    @classmethod
    def get_kv_cache_stride_order(
        cls, layout: KVCacheLayout | str = KVCacheLayout.NHD
    ) -> tuple[int, ...]:
        """The latent cache has no head axis: NHD, its only layout, is the identity order."""
        super().get_kv_cache_stride_order(layout)  # the same errors for other layouts
        return (0, 1, 2)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.NHD,)

    @classmethod
    def get_mla_head_dims_reason(
        cls, qk_nope_head_dim: int | None, qk_rope_head_dim: int | None, v_head_dim: int | None
    ) -> str | None:
        """Why the up-projected (prefill) path cannot take Q/K rows of `qk_nope_head_dim +
        qk_rope_head_dim` and V rows of `v_head_dim`, naming the sizes it takes; None when it
        can (default: any). A size the config leaves None is judged by the impl's constructor,
        which asks with its own."""
        return None
