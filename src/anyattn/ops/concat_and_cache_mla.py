"""Write a step's MLA latents into a paged latent cache (docs/mla.md, "The cache").

Token `t` stores one row `[kv_c[t] (L), k_pe[t] (R)]` at `slot = slot_mapping[t] = block_id *
block_size + offset` of a cache of logical shape `(num_blocks, block_size, L + R)`; slot -1 is
padding and is never written. An fp8 cache stores `row / scale` rounded by the one rule of
`anyattn.ops.fp8_quant` (the standard write's: IEEE float32 division, nearest-even fp8,
saturation, NaN as 0x7F), with one per-layer float32 `scale`.

`concat_and_cache_mla` checks its arguments (`anyattn.ops.tensor_checks.check_mla_write_args`)
before writing, so a refused call leaves the cache unchanged; an MLA impl, which has checked the
call (`anyattn.validation_mla`), writes with `concat_and_cache_mla_unchecked`.
`concat_and_cache_mla_ref` is the token-by-token reference.
"""

from __future__ import annotations

import torch

from anyattn.ops.fp8_quant import quantize_fp8
from anyattn.ops.tensor_checks import check_mla_write_args
from anyattn.types import cache_torch_dtype, is_fp8_cache

__all__ = ["concat_and_cache_mla", "concat_and_cache_mla_ref", "concat_and_cache_mla_unchecked"]

_OP = "concat_and_cache_mla"


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    scale: torch.Tensor | None = None,
) -> None:
    """Write `[kv_c, k_pe]` rows into `kv_cache` at the slots of `slot_mapping`, in place.

    Everything is validated before the first write: after any error the cache is unchanged.

    Args:
        kv_c: `[num_tokens, kv_lora_rank]`, the normalised latents; float32 / float16 /
            bfloat16.
        k_pe: `[num_tokens, qk_rope_head_dim]`, the rotated rope keys; `kv_c`'s dtype.
        kv_cache: `(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)`, any strides; its
            dtype must be `cache_torch_dtype(kv_cache_dtype, kv_c.dtype)`.
        slot_mapping: int64 `[>= num_tokens]`; the first `num_tokens` entries are read, each
            -1 (padding) or in `[0, num_blocks * block_size)`, no slot twice.
        kv_cache_dtype: "auto", "float16", "bfloat16", "fp8" (= e4m3), "fp8_e4m3", "fp8_e5m2".
        scale: float32 `[]` (one per layer), on the cache's device; required, finite and > 0
            for fp8 caches; for other caches None or 1.

    Raises:
        TypeError: a non-tensor argument or a wrong dtype.
        ValueError: wrong shapes (a non-MLA cache among them), mixed devices, an unknown
            `kv_cache_dtype`, a slot out of range or used twice, a missing or bad fp8 scale.
    """
    cache_dtype = check_mla_write_args(
        _OP, kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale
    )
    concat_and_cache_mla_unchecked(kv_c, k_pe, kv_cache, slot_mapping, cache_dtype, scale)


def concat_and_cache_mla_unchecked(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor | None,
) -> None:
    """`concat_and_cache_mla` without its checks, for a caller that has made them (an MLA
    impl): the same arguments, `scale` None for a non-fp8 cache."""
    num_tokens = kv_c.shape[0]
    if num_tokens == 0:
        return
    # rows: [num_tokens, L + R] in the cache dtype
    rows = torch.cat([kv_c, k_pe], dim=-1)
    dtype = cache_torch_dtype(kv_cache_dtype, kv_c.dtype)
    if is_fp8_cache(kv_cache_dtype):
        assert scale is not None
        rows = quantize_fp8(rows, scale.reshape(()), dtype)
    else:
        rows = rows.to(dtype)
    slots = slot_mapping[:num_tokens]
    block_size = kv_cache.shape[1]
    is_real = slots >= 0
    if slots.device.type == "cpu":
        if not bool(is_real.all()):
            slots, rows = slots[is_real], rows[is_real]
        kv_cache[slots // block_size, slots % block_size] = rows
        return
    # On a device, dropping padding with a mask would sync with the host: each padding token
    # instead repeats the first real token's write (same slot, same row), which changes nothing;
    # with no real token it rewrites slot 0 with its own value. `first` is [1], not [] (a 0-dim
    # index would sync too).
    first = torch.argmax(is_real.to(torch.uint8))[None]
    has_real = is_real[first]
    fallback_slot = torch.where(has_real, slots[first], 0)
    fallback_row = kv_cache[fallback_slot // block_size, fallback_slot % block_size]
    fallback_row = torch.where(has_real[:, None], rows[first], fallback_row)
    write_slots = torch.where(is_real, slots, fallback_slot)
    kv_cache[write_slots // block_size, write_slots % block_size] = torch.where(
        is_real[:, None], rows, fallback_row
    )


def concat_and_cache_mla_ref(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    scale: torch.Tensor | None = None,
) -> None:
    """Reference for `concat_and_cache_mla`: same arguments and result, one token at a time.

    Does no validation; meant for tests on valid inputs.
    """
    block_size = kv_cache.shape[1]
    for token in range(kv_c.shape[0]):
        slot = int(slot_mapping[token])
        if slot == -1:
            continue
        # float32 holds every model-dtype value exactly, so casting through it rounds once.
        row = torch.cat([kv_c[token].float(), k_pe[token].float()])
        if is_fp8_cache(kv_cache_dtype):
            row = quantize_fp8(row, scale.reshape(()), kv_cache.dtype)
        kv_cache[slot // block_size, slot % block_size] = row.to(kv_cache.dtype)
