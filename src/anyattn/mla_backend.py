"""`MLAAttentionBackend`: the declarations every MLA backend shares (docs/mla.md).

An MLA backend's cache holds one latent row per token, `[c_kv (L), k_pe (R)]`, so its logical
shape is `(num_blocks, block_size, head_size)` with `head_size = L + R` and a single "KV head";
there is no K/V axis and no head axis, hence one layout. MLA is causal decoder attention only
(no window, soft cap, ALiBi or sinks). A backend subclasses this and declares the rest (name,
impl, builder, dtypes, the latent splits it takes through `get_supported_mla_splits`, the
prefill head sizes through `get_mla_head_dims_reason`).
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
        can. The selector asks with the config's sizes (None where the config does not say
        them: then the sizes it does not know are left to the impl's constructor, which asks
        with its own, so that a config without them still selects by the rest). Default: any
        sizes."""
        return None
