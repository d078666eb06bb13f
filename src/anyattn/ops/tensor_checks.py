"""The argument checks of the KV write (`reshape_and_cache`, and an impl's `do_kv_cache_update`
through `anyattn.validation`), with the values of its slots and scales where no CPU mirror holds
them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from anyattn.types import CACHE_DTYPES, cache_torch_dtype, is_fp8_cache

__all__ = [
    "cache_block_dims",
    "check_kv_write_args",
    "check_mla_write_args",
    "check_scale",
    "check_scale_values",
    "check_slot_mapping",
    "check_slot_values",
    "check_tensor",
]

_MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_kv_write_args(
    op: str, key: object, value: object, kv_cache: object, slot_mapping: object,
    kv_cache_dtype: str, k_scale: object, v_scale: object, *, check_values: bool = True,
) -> str:  # fmt: skip
    """Every check of the `reshape_and_cache` op's arguments (see its docstring), `op` naming
    the caller in messages; with `check_values`, also the values of `slot_mapping[:num_tokens]`
    and of the scales (read back from a device). Returns the cache dtype string.

    Raises:
        TypeError, ValueError: the first problem found.
    """
    for name, x in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        check_tensor(op, name, x)
    check_tensor(op, "slot_mapping", slot_mapping)
    if key.dim() != 3:
        raise ValueError(
            f"{op}: key must be [num_tokens, num_kv_heads, head_size] (got rank {key.dim()}, "
            "expected 3)."
        )
    if value.shape != key.shape:
        raise ValueError(
            f"{op}: value's shape differs from key's (got {list(value.shape)}, expected "
            f"{list(key.shape)})."
        )
    if key.dtype not in _MODEL_DTYPES:
        raise TypeError(
            f"{op}: key has an unsupported dtype (got {key.dtype}, expected float32, float16 "
            "or bfloat16)."
        )
    if value.dtype != key.dtype:
        raise TypeError(
            f"{op}: value's dtype differs from key's (got {value.dtype}, expected {key.dtype})."
        )
    num_tokens, num_kv_heads, head_size = key.shape
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{op}: kv_cache must be (num_blocks, 2, block_size, num_kv_heads, head_size) (got "
            f"{list(kv_cache.shape)}). Allocate it with the backend's get_kv_cache_shape."
        )
    if tuple(kv_cache.shape[3:]) != (num_kv_heads, head_size):
        raise ValueError(
            f"{op}: kv_cache's [num_kv_heads, head_size] do not match key's (got "
            f"{list(kv_cache.shape[3:])}, expected [{num_kv_heads}, {head_size}])."
        )
    check_slot_mapping(op, slot_mapping, num_tokens, key.device)
    for name, x in (("value", value), ("kv_cache", kv_cache)):
        if x.device != key.device:
            raise ValueError(
                f"{op}: {name} is on another device than key (got {x.device}, expected "
                f"{key.device}). Put key, value, kv_cache, slot_mapping and the scales on one "
                "device."
            )
    _check_cache_dtype(op, kv_cache, kv_cache_dtype, key.dtype)
    fp8 = is_fp8_cache(kv_cache_dtype)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            if fp8:
                raise ValueError(
                    f"{op}: {name} is required for an fp8 cache (got None, expected a float32 "
                    f"tensor of shape [] or [{num_kv_heads}]). Pass the layer's {name}."
                )
            continue
        check_scale(op, name, scale, num_kv_heads, kv_cache.device)
        if check_values and not _is_capturing(kv_cache):
            check_scale_values(op, name, scale, fp8)
    if check_values:
        check_slot_values(op, slot_mapping[:num_tokens], kv_cache)
    return kv_cache_dtype


def check_mla_write_args(
    op: str, kv_c: object, k_pe: object, kv_cache: object, slot_mapping: object,
    kv_cache_dtype: str, scale: object, *, check_values: bool = True,
) -> str:  # fmt: skip
    """Every check of the `concat_and_cache_mla` op's arguments (see its docstring), `op`
    naming the caller; with `check_values`, also the values of `slot_mapping[:num_tokens]` and
    of the scale (read back from a device). Returns the cache dtype string.

    Raises:
        TypeError, ValueError: the first problem found.
    """
    for name, x in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache)):
        check_tensor(op, name, x)
    if kv_c.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != kv_c.shape[0]:
        raise ValueError(
            f"{op}: kv_c must be [num_tokens, kv_lora_rank] and k_pe [num_tokens, "
            f"qk_rope_head_dim] (got {list(kv_c.shape)} and {list(k_pe.shape)})."
        )
    if kv_c.dtype not in _MODEL_DTYPES or k_pe.dtype != kv_c.dtype:
        raise TypeError(
            f"{op}: kv_c and k_pe must share one dtype of float32, float16 or bfloat16 (got "
            f"{kv_c.dtype} and {k_pe.dtype})."
        )
    num_tokens, row = kv_c.shape[0], kv_c.shape[1] + k_pe.shape[1]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != row:
        raise ValueError(
            f"{op}: kv_cache must be an MLA latent cache (num_blocks, block_size, kv_lora_rank "
            f"+ qk_rope_head_dim = {row}) (got {list(kv_cache.shape)}). Allocate it with an "
            "MLA backend's get_kv_cache_shape."
        )
    check_slot_mapping(op, slot_mapping, num_tokens, kv_c.device)
    for name, x in (("k_pe", k_pe), ("kv_cache", kv_cache)):
        if x.device != kv_c.device:
            raise ValueError(
                f"{op}: {name} is on another device than kv_c (got {x.device}, expected "
                f"{kv_c.device}). Put kv_c, k_pe, kv_cache, slot_mapping and scale on one device."
            )
    _check_cache_dtype(op, kv_cache, kv_cache_dtype, kv_c.dtype)
    fp8 = is_fp8_cache(kv_cache_dtype)
    if scale is None:
        if fp8:
            raise ValueError(
                f"{op}: scale is required for an fp8 cache (got None, expected a float32 "
                "tensor of shape []). Pass the layer's k_scale."
            )
    else:
        check_scale(op, "scale", scale, 1, kv_cache.device)
        if check_values and not _is_capturing(kv_cache):
            check_scale_values(op, "scale", scale, fp8)
    if check_values:
        check_slot_values(op, slot_mapping[:num_tokens], kv_cache)
    return kv_cache_dtype


def _check_cache_dtype(
    op: str, kv_cache: torch.Tensor, kv_cache_dtype: str, model_dtype: torch.dtype
) -> None:
    """`kv_cache_dtype` a known name and `kv_cache` of the element dtype it means for
    `model_dtype`."""
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(
            f"{op}: unknown kv_cache_dtype (got {kv_cache_dtype!r}, expected one of "
            f"{', '.join(CACHE_DTYPES)})."
        )
    expected = cache_torch_dtype(kv_cache_dtype, model_dtype)
    if kv_cache.dtype != expected:
        raise TypeError(
            f"{op}: kv_cache has the wrong dtype for kv_cache_dtype={kv_cache_dtype!r} (got "
            f"{kv_cache.dtype}, expected {expected}). Allocate the cache with the same "
            "kv_cache_dtype and model dtype."
        )


def cache_block_dims(kv_cache: torch.Tensor) -> tuple[int, int]:
    """`(num_blocks, block_size)` of a paged cache: `(num_blocks, 2, block_size, ...)`, or an
    MLA latent cache `(num_blocks, block_size, head_size)`."""
    if kv_cache.dim() == 3:
        return int(kv_cache.shape[0]), int(kv_cache.shape[1])
    return int(kv_cache.shape[0]), int(kv_cache.shape[2])


def check_slot_mapping(
    op: str, slot_mapping: object, num_tokens: int, device: torch.device
) -> None:
    """`slot_mapping`: an int64 1-D tensor of at least `num_tokens` entries on `device`."""
    check_tensor(op, "slot_mapping", slot_mapping)
    if slot_mapping.dtype != torch.int64:
        raise TypeError(
            f"{op}: slot_mapping has the wrong dtype (got {slot_mapping.dtype}, expected "
            "torch.int64). Pass slot_mapping.long()."
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"{op}: slot_mapping must be 1-D with at least num_tokens entries (got shape "
            f"{list(slot_mapping.shape)}, expected [>= {num_tokens}])."
        )
    if slot_mapping.device != device:
        raise ValueError(
            f"{op}: slot_mapping is on another device than key (got {slot_mapping.device}, "
            f"expected {device}). Put key, value, kv_cache, slot_mapping and the scales on one "
            "device."
        )


def check_slot_values(op: str, slots: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Slots without a CPU mirror: each -1 or in `[0, num_blocks * block_size)` of `kv_cache`,
    none twice. A device's are read back (one copy); not checked while a graph is captured."""
    if _is_capturing(kv_cache):
        return  # a read is illegal while capturing; a replay's values are another step's
    values = slots.cpu().numpy()
    num_blocks, block_size = cache_block_dims(kv_cache)
    num_slots = num_blocks * block_size
    bad = np.flatnonzero((values < -1) | (values >= num_slots))
    if bad.size:
        raise ValueError(
            f"{op}: slot_mapping has a slot out of range at entry {bad[0]} (got "
            f"{values[bad[0]]}, expected -1 for padding or 0 <= slot < num_blocks * block_size "
            f"= {num_slots})."
        )
    real = np.sort(values[values >= 0])
    repeated = np.flatnonzero(real[1:] == real[:-1])
    if repeated.size:
        raise ValueError(
            f"{op}: slot_mapping gives the same slot to two tokens (got slot "
            f"{real[repeated[0]]} twice, expected distinct slots, -1 excepted). Check the "
            "block table the slots were computed from."
        )


def check_scale_values(op: str, name: str, scale: torch.Tensor, fp8: bool) -> None:
    """An fp8 cache's scale finite and > 0; another cache's all 1 (it would be dropped)."""
    values = scale.detach().reshape(-1).cpu().tolist()
    if fp8 and not all(math.isfinite(x) and x > 0 for x in values):
        raise ValueError(
            f"{op}: {name} has a bad value for an fp8 cache (got a scale <= 0 or not finite, "
            "expected finite scales > 0)."
        )
    if not fp8 and any(x != 1 for x in values):
        raise ValueError(
            f"{op}: {name} is not 1 for a non-fp8 cache (got a scale other than 1, expected "
            "None or ones, since only fp8 caches are scaled). Use an fp8 kv_cache_dtype or "
            "drop the scale."
        )


def _is_capturing(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_tensor(op: str, name: str, x: object) -> None:
    """Raise `TypeError` unless `x` is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor (got {type(x).__name__}).")


def check_scale(op: str, name: str, scale: object, num_kv_heads: int, device: torch.device) -> None:
    """A scale's type, dtype (float32), shape (`[]` or `[num_kv_heads]`) and device."""
    check_tensor(op, name, scale)
    if scale.dtype != torch.float32:
        raise TypeError(
            f"{op}: {name} has the wrong dtype (got {scale.dtype}, expected torch.float32). "
            f"Pass {name}.float()."
        )
    if tuple(scale.shape) not in ((), (num_kv_heads,)):
        raise ValueError(
            f"{op}: {name} has the wrong shape (got {list(scale.shape)}, expected [] per tensor "
            f"or [{num_kv_heads}] per KV head)."
        )
    if scale.device != device:
        raise ValueError(
            f"{op}: {name} is on another device (got {scale.device}, expected {device}). "
            f"Move {name} to the cache's device."
        )
