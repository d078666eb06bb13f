"""Write a step's new K/V into a paged KV cache, and read fp8 caches back.

`reshape_and_cache` is the launcher (validates, then writes with vectorised indexing),
`reshape_and_cache_ref` the plain-PyTorch reference, `dequantize_cache` the reader-side helper
that turns (fp8) cache values back into model-dtype values.

The cache has the logical shape `(num_blocks, 2, block_size, num_kv_heads, head_size)`, index 1
being K (0) / V (1), with any strides (NHD or HND, see `anyattn.kv_cache.allocate_kv_cache`);
every write goes through that view, so both layouts work. Token `t` goes to
`slot = slot_mapping[t] = block_id * block_size + offset`; slot -1 is padding and is never
written. fp8 caches hold `(x.float() / scale).to(fp8)`, where `scale` (float32, shape `[]` or
`[num_kv_heads]`) is `k_scale` for K and `v_scale` for V; values beyond the fp8 range saturate to
its largest finite value (448 for e4m3, 57344 for e5m2), as vLLM's kernels do, never inf or NaN.

On CUDA, when triton is importable, the write is one Triton kernel launch (one program per
token); the vectorised PyTorch path serves the CPU and CUDA without triton. `impl=` forces
either one (tests run the kernel on the CPU under `TRITON_INTERPRET=1`).

Checking values (slots in range and distinct, scale values) needs them on the host: on CUDA a
device-to-host sync, which stalls a host that should run ahead of the GPU. Every layer of a step
passes the same `slot_mapping`, and each layer the same scales step after step, so a successful
check is recorded on the checked tensor itself, in the private attribute `_anyattn_checked` (a
`_Checked`: which check, and the tensor's `_version`, data_ptr, shape and stride at the time); a
later call on the unchanged tensor skips that check. An eager step thus syncs once (its first
layer) instead of once per layer, and scales are read once. The record lives on the tensor, not in
a module-level cache (no global state; it goes with the tensor). torch bumps `_version` on every
in-place write it performs (`copy_` into a persistent buffer, index writes, writes through a
view), so a changed tensor is checked again; writes torch does not see (through `.numpy()`,
`.data`, DLPack, or a kernel writing through `data_ptr()`) must be followed by
`torch.autograd.graph.increment_version(tensor)`. Inference tensors (created under
`torch.inference_mode()`) have no version counter: they are checked on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from anyattn.ops.impl_choice import use_triton
from anyattn.types import CACHE_DTYPES, cache_torch_dtype, is_fp8_cache

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = ["dequantize_cache", "reshape_and_cache", "reshape_and_cache_ref"]

_OP = "reshape_and_cache"
_MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The tensor attribute holding a `_Checked` record (see the module docstring).
_CHECKED_ATTR = "_anyattn_checked"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    impl: str = "auto",
) -> None:
    """Write `key`/`value` into `kv_cache` at the slots of `slot_mapping`, in place.

    Everything is validated before the first write: after any error the cache is unchanged.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_size]`, float32 / float16 / bfloat16, same
            shape and dtype.
        kv_cache: logical shape `(num_blocks, 2, block_size, num_kv_heads, head_size)`, any
            strides; its dtype must be `cache_torch_dtype(kv_cache_dtype, key.dtype)`.
        slot_mapping: int64 `[>= num_tokens]`; only the first `num_tokens` entries are read (and
            validated), so a buffer padded for CUDA graphs can be passed whole. Each is -1
            (padding: not written) or in `[0, num_blocks * block_size)`; no two tokens may
            share a non-negative slot.
        kv_cache_dtype: "auto" (cache dtype = key dtype), "float16", "bfloat16" (key/value are
            cast to it), "fp8" (= e4m3), "fp8_e4m3" or "fp8_e5m2" (scaled, rounded once,
            saturating at the format's largest finite value).
        k_scale, v_scale: float32 `[]` (per tensor) or `[num_kv_heads]` (per KV head), on the
            cache's device. Required, finite and > 0 for fp8 caches. For other caches they may
            be None or all ones (the engine always carries 1.0 scales) and are then ignored;
            any other value is rejected, since it would be silently dropped.
        impl: "auto" (the Triton kernel on CUDA when triton is importable, else PyTorch),
            "torch" or "triton" (on the CPU it needs `TRITON_INTERPRET=1` set before triton is
            imported).

    Raises:
        TypeError: a non-tensor argument or a wrong dtype.
        ValueError: wrong shapes, mixed devices, an unknown `kv_cache_dtype`, a slot out of
            range or used twice, missing fp8 scales or scales with a bad value, an unknown
            `impl`.
        RuntimeError: `impl="triton"` without triton installed.

    Validation reads `slot_mapping` (and the scales) on the host in one transfer: on CUDA one
    device-to-host sync, made only when one of them has not been checked unchanged before (see
    the module docstring), so a step's later layers do not sync. While a CUDA graph is being
    captured the value checks are skipped (a sync is illegal there); the write never syncs.
    """
    cache_dtype = _validate(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    use_triton = _use_triton(impl, kv_cache, cache_dtype)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    if use_triton:
        _write_with_triton(key, value, kv_cache, slot_mapping, cache_dtype, k_scale, v_scale)
        return
    block_size = kv_cache.shape[2]
    # slots: [num_tokens] int64, -1 for padding
    slots = slot_mapping[:num_tokens]
    if slots.device.type == "cpu":
        _write_on_cpu(key, value, kv_cache, slots, cache_dtype, k_scale, v_scale)
        return
    is_real = slots >= 0
    # index_put_ cannot skip an index without a boolean mask, and a mask costs a device-to-host
    # sync. So each padding token repeats the write of the first real token (same slot, same
    # row), which changes nothing; with no real token at all it rewrites slot 0 with the value
    # already there. `first` has shape [1], not []: indexing with a 0-dim tensor would sync.
    first = torch.argmax(is_real.to(torch.uint8))[None]  # first real token, or 0 if none
    has_real = is_real[first]
    fallback_slot = torch.where(has_real, slots[first], 0)
    write_slots = torch.where(is_real, slots, fallback_slot)
    block, offset = write_slots // block_size, write_slots % block_size
    for index, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        # part: [num_blocks, block_size, num_kv_heads, head_size], a view of the cache
        part = kv_cache[:, index]
        rows = _to_cache_dtype(x, scale, cache_dtype)
        # fallback_row: [1, num_kv_heads, head_size]
        fallback_row = part[fallback_slot // block_size, fallback_slot % block_size]
        fallback_row = torch.where(has_real[:, None, None], rows[first], fallback_row)
        part[block, offset] = torch.where(is_real[:, None, None], rows, fallback_row)


def _use_triton(impl: str, kv_cache: torch.Tensor, cache_dtype: str) -> bool:
    chosen = use_triton(_OP, impl, kv_cache.device)
    if not chosen or impl != "auto":
        return chosen
    # Triton casts to fp8 e4m3 only from sm89 (Ada, Hopper) on.
    e4m3 = kv_cache.dtype == torch.float8_e4m3fn
    return not e4m3 or torch.cuda.get_device_capability(kv_cache.device) >= (8, 9)


def _write_with_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_dtype: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    fp8 = is_fp8_cache(cache_dtype)
    if fp8:
        assert k_scale is not None and v_scale is not None
        scales: tuple[torch.Tensor, torch.Tensor] = (k_scale, v_scale)
    else:
        # Never read: the pointers only need a valid tensor.
        scales = (slot_mapping, slot_mapping)
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_size)
    tile = block_h * block_d
    num_warps = 1 if tile <= 256 else 2 if tile <= 1024 else 4 if tile <= 4096 else 8
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        scales[0],
        scales[1],
        num_kv_heads,
        head_size,
        kv_cache.shape[2],
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        slot_mapping.stride(0),
        FP8=fp8,
        FP8_MAX=torch.finfo(kv_cache.dtype).max if fp8 else 0.0,
        K_SCALE_PER_HEAD=fp8 and k_scale is not None and k_scale.dim() == 1,
        V_SCALE_PER_HEAD=fp8 and v_scale is not None and v_scale.dim() == 1,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )


if triton is not None:

    @triton.jit
    def _store_rows(
        x_ptr,
        cache_ptr,
        scale_ptr,
        token,
        cache_row,  # int64 offset of (block, K/V, offset, 0, 0) in the cache
        heads,
        dims,
        head_mask,
        mask,
        stride_x_token,
        stride_x_head,
        stride_x_dim,
        stride_c_head,
        stride_c_dim,
        FP8: tl.constexpr,
        FP8_MAX: tl.constexpr,
        SCALE_PER_HEAD: tl.constexpr,
    ):
        # x: [BLOCK_H, BLOCK_D] rows of one token, in the model dtype
        x = tl.load(
            x_ptr
            + token * stride_x_token
            + heads[:, None] * stride_x_head
            + dims[None, :] * stride_x_dim,
            mask=mask,
        )
        if FP8:
            if SCALE_PER_HEAD:
                scale = tl.load(scale_ptr + heads, mask=head_mask, other=1.0)[:, None]
            else:
                scale = tl.load(scale_ptr)
            y = x.to(tl.float32) / scale
            y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        else:
            # float32 holds every model-dtype value exactly: one rounding, as in torch's cast.
            y = x.to(tl.float32)
        offsets = cache_row + heads[:, None] * stride_c_head + dims[None, :] * stride_c_dim
        tl.store(cache_ptr + offsets, y.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _reshape_and_cache_kernel(
        key_ptr,
        value_ptr,
        cache_ptr,
        slot_ptr,
        k_scale_ptr,
        v_scale_ptr,
        num_kv_heads,
        head_size,
        block_size,
        stride_k_token,
        stride_k_head,
        stride_k_dim,
        stride_v_token,
        stride_v_head,
        stride_v_dim,
        stride_c_block,
        stride_c_kv,
        stride_c_offset,
        stride_c_head,
        stride_c_dim,
        stride_slot,
        FP8: tl.constexpr,
        FP8_MAX: tl.constexpr,
        K_SCALE_PER_HEAD: tl.constexpr,
        V_SCALE_PER_HEAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per token: all heads of its K and V rows.
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token * stride_slot)  # int64: no 32-bit offset overflow
        if slot >= 0:
            block = slot // block_size
            offset = slot % block_size
            row = block * stride_c_block + offset * stride_c_offset
            heads = tl.arange(0, BLOCK_H)
            dims = tl.arange(0, BLOCK_D)
            head_mask = heads < num_kv_heads
            mask = head_mask[:, None] & (dims[None, :] < head_size)
            _store_rows(
                key_ptr, cache_ptr, k_scale_ptr, token, row, heads, dims, head_mask, mask,
                stride_k_token, stride_k_head, stride_k_dim, stride_c_head, stride_c_dim,
                FP8, FP8_MAX, K_SCALE_PER_HEAD,
            )  # fmt: skip
            _store_rows(
                value_ptr, cache_ptr, v_scale_ptr, token, row + stride_c_kv, heads, dims,
                head_mask, mask,
                stride_v_token, stride_v_head, stride_v_dim, stride_c_head, stride_c_dim,
                FP8, FP8_MAX, V_SCALE_PER_HEAD,
            )  # fmt: skip


def _write_on_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    cache_dtype: torch.dtype,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    # On the CPU dropping padding with a mask costs nothing extra, and it saves the
    # sync-free fallback writes the device path needs.
    is_real = slots >= 0
    if not bool(is_real.all()):
        slots, key, value = slots[is_real], key[is_real], value[is_real]
    block_size = kv_cache.shape[2]
    block, offset = slots // block_size, slots % block_size
    for index, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        kv_cache[:, index][block, offset] = _to_cache_dtype(x, scale, cache_dtype)


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference for `reshape_and_cache`: same arguments and result, one token at a time.

    Does no validation; meant for tests on valid inputs.
    """
    fp8 = is_fp8_cache(kv_cache_dtype)
    block_size = kv_cache.shape[2]
    # float32 holds every model-dtype value exactly, so casting through it rounds only once.
    for token in range(key.shape[0]):
        slot = int(slot_mapping[token])
        if slot == -1:
            continue
        block, offset = divmod(slot, block_size)
        k, v = key[token].float(), value[token].float()
        if fp8:
            fp8_max = torch.finfo(kv_cache.dtype).max
            k = (k / _per_head(k_scale)).clamp(-fp8_max, fp8_max)
            v = (v / _per_head(v_scale)).clamp(-fp8_max, fp8_max)
        kv_cache[block, 0, offset] = k.to(kv_cache.dtype)
        kv_cache[block, 1, offset] = v.to(kv_cache.dtype)


def dequantize_cache(
    kv_cache_part: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Values of (part of) a KV cache as `dtype`: `kv_cache_part.float() * scale`.

    Args:
        kv_cache_part: `[..., num_kv_heads, head_size]`, any cache dtype (e.g. the K half of a
            cache, `kv_cache[:, 0]`, or rows gathered from it).
        scale: float32 `[]` (per tensor) or `[num_kv_heads]` (per KV head), broadcast over the
            head dim; None means no scaling (a non-fp8 cache), i.e. a plain cast.
        dtype: the dtype of the result.

    Returns:
        A new tensor of `kv_cache_part`'s shape and dtype `dtype`.

    Raises:
        TypeError: a non-tensor argument, or a scale that is not float32.
        ValueError: a part of rank < 2, a scale of the wrong shape or on another device.
    """
    op = "dequantize_cache"
    _check_tensor(op, "kv_cache_part", kv_cache_part)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"{op}: dtype must be a torch.dtype (got {type(dtype).__name__}, expected e.g. "
            "torch.float16)."
        )
    if kv_cache_part.dim() < 2:
        raise ValueError(
            f"{op}: kv_cache_part must end in [num_kv_heads, head_size] (got rank "
            f"{kv_cache_part.dim()}, expected rank >= 2)."
        )
    values = kv_cache_part.to(torch.float32)
    if scale is not None:
        _check_scale(op, "scale", scale, kv_cache_part.shape[-2], kv_cache_part.device)
        values = values * _per_head(scale)
    return values.to(dtype)


def _to_cache_dtype(x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: str) -> torch.Tensor:
    # x: [num_tokens, num_kv_heads, head_size]. fp8: divide in float32, saturate (torch's own
    # cast gives inf or NaN out of range, depending on the format and version), round once.
    dtype = cache_torch_dtype(cache_dtype, x.dtype)
    if not is_fp8_cache(cache_dtype):
        return x.to(dtype)
    assert scale is not None
    fp8_max = torch.finfo(dtype).max
    return (x.float() / _per_head(scale)).clamp(-fp8_max, fp8_max).to(dtype)


def _per_head(scale: torch.Tensor) -> torch.Tensor:
    # [] broadcasts as is; [num_kv_heads] -> [num_kv_heads, 1] to broadcast over head_size.
    return scale if scale.dim() == 0 else scale[:, None]


def _check_tensor(op: str, name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor (got {type(x).__name__}).")


def _check_scale(
    op: str, name: str, scale: object, num_kv_heads: int, device: torch.device
) -> None:
    _check_tensor(op, name, scale)
    assert isinstance(scale, torch.Tensor)
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


def _validate(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> str:
    """Every check of `reshape_and_cache`; returns the cache dtype string."""
    _validate_layout(key, value, kv_cache, slot_mapping)
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(
            f"{_OP}: unknown kv_cache_dtype (got {kv_cache_dtype!r}, expected one of "
            f"{', '.join(CACHE_DTYPES)})."
        )
    expected = cache_torch_dtype(kv_cache_dtype, key.dtype)
    if kv_cache.dtype != expected:
        raise TypeError(
            f"{_OP}: kv_cache has the wrong dtype for kv_cache_dtype={kv_cache_dtype!r} (got "
            f"{kv_cache.dtype}, expected {expected}). Allocate the cache with the same "
            "kv_cache_dtype and model dtype."
        )
    fp8 = is_fp8_cache(kv_cache_dtype)
    num_kv_heads = kv_cache.shape[3]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            if fp8:
                raise ValueError(
                    f"{_OP}: {name} is required for an fp8 cache (got None, expected a float32 "
                    f"tensor of shape [] or [{num_kv_heads}]). Pass the layer's {name}."
                )
            continue
        _check_scale(_OP, name, scale, num_kv_heads, kv_cache.device)
    if kv_cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return kv_cache_dtype
    _validate_values(key.shape[0], kv_cache, slot_mapping, fp8, k_scale, v_scale)
    return kv_cache_dtype


def _validate_layout(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    for name, x in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        _check_tensor(_OP, name, x)
    _check_tensor(_OP, "slot_mapping", slot_mapping)
    if key.dim() != 3:
        raise ValueError(
            f"{_OP}: key must be [num_tokens, num_kv_heads, head_size] (got rank {key.dim()}, "
            "expected 3)."
        )
    if value.shape != key.shape:
        raise ValueError(
            f"{_OP}: value's shape differs from key's (got {list(value.shape)}, expected "
            f"{list(key.shape)})."
        )
    if key.dtype not in _MODEL_DTYPES:
        raise TypeError(
            f"{_OP}: key has an unsupported dtype (got {key.dtype}, expected float32, float16 "
            "or bfloat16)."
        )
    if value.dtype != key.dtype:
        raise TypeError(
            f"{_OP}: value's dtype differs from key's (got {value.dtype}, expected {key.dtype})."
        )
    num_tokens, num_kv_heads, head_size = key.shape
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{_OP}: kv_cache must be (num_blocks, 2, block_size, num_kv_heads, head_size) (got "
            f"{list(kv_cache.shape)}). Allocate it with the backend's get_kv_cache_shape."
        )
    if tuple(kv_cache.shape[3:]) != (num_kv_heads, head_size):
        raise ValueError(
            f"{_OP}: kv_cache's [num_kv_heads, head_size] do not match key's (got "
            f"{list(kv_cache.shape[3:])}, expected [{num_kv_heads}, {head_size}])."
        )
    if slot_mapping.dtype != torch.int64:
        raise TypeError(
            f"{_OP}: slot_mapping has the wrong dtype (got {slot_mapping.dtype}, expected "
            "torch.int64). Pass slot_mapping.long()."
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"{_OP}: slot_mapping must be 1-D with at least num_tokens entries (got shape "
            f"{list(slot_mapping.shape)}, expected [>= {num_tokens}])."
        )
    for name, x in (("value", value), ("slot_mapping", slot_mapping), ("kv_cache", kv_cache)):
        if x.device != key.device:
            raise ValueError(
                f"{_OP}: {name} is on another device than key (got {x.device}, expected "
                f"{key.device}). Put key, value, kv_cache, slot_mapping and the scales on one "
                "device."
            )


def _validate_values(
    num_tokens: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fp8: bool,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    num_slots = kv_cache.shape[0] * kv_cache.shape[2]
    scale_check = "fp8 scale" if fp8 else "unit scale"
    # What is not known valid yet (None: nothing to check).
    is_slots_known = _is_known_valid(slot_mapping, "slot_mapping", num_tokens, num_slots)
    slots = None if is_slots_known else slot_mapping[:num_tokens]
    scales = [
        None if scale is None or _is_known_valid(scale, scale_check) else scale
        for scale in (k_scale, v_scale)
    ]
    if slots is None and scales == [None, None]:
        return
    if kv_cache.device.type == "cpu":
        # On the CPU a few Python checks cost less than a dozen tiny tensor ops.
        bad = _find_bad_values_on_cpu(slots, num_slots, fp8, *scales)
    else:
        bad = _find_bad_values_on_device(slots, num_slots, fp8, *scales)
    _raise_for(*bad, num_slots, fp8)
    if slots is not None:
        _mark_valid(slot_mapping, "slot_mapping", num_tokens, num_slots)
    for scale in scales:
        if scale is not None:
            _mark_valid(scale, scale_check)


@dataclass(frozen=True, slots=True)
class _Checked:
    """A successful value check, recorded on the checked tensor as `_anyattn_checked`."""

    check: str  # "slot_mapping", "fp8 scale" (finite, > 0) or "unit scale" (all 1)
    state: tuple[object, ...]  # `_tensor_state` when checked
    num_tokens: int = 0  # slot_mapping: its first num_tokens entries are valid
    num_slots: int = 0  # ... for a cache of num_slots slots


def _tensor_state(x: torch.Tensor) -> tuple[object, ...] | None:
    # None: an inference tensor has no version counter, so a change to it cannot be seen.
    if x.is_inference():
        return None
    return (x._version, x.data_ptr(), tuple(x.shape), x.stride())


def _is_known_valid(x: torch.Tensor, check: str, num_tokens: int = 0, num_slots: int = 0) -> bool:
    record = getattr(x, _CHECKED_ATTR, None)
    state = _tensor_state(x)
    # Slots valid for n tokens and m slots stay valid for fewer tokens or a bigger cache.
    return (
        isinstance(record, _Checked)
        and state is not None
        and (record.check, record.state) == (check, state)
        and num_tokens <= record.num_tokens
        and num_slots >= record.num_slots
    )


def _mark_valid(x: torch.Tensor, check: str, num_tokens: int = 0, num_slots: int = 0) -> None:
    state = _tensor_state(x)
    if state is not None:
        setattr(x, _CHECKED_ATTR, _Checked(check, state, num_tokens, num_slots))


def _find_bad_values_on_device(
    slots: torch.Tensor | None,
    num_slots: int,
    fp8: bool,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[bool, bool, bool, bool]:
    """`(bad_range, duplicate, bad_k_scale, bad_v_scale)`; None arguments are not checked."""
    flags: dict[str, torch.Tensor] = {}
    if slots is not None:
        flags["range"] = ((slots < -1) | (slots >= num_slots)).any()
        # Duplicates are neighbours once sorted; -1 (padding) may repeat.
        ordered = torch.sort(slots).values
        flags["duplicate"] = ((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).any()
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and fp8:
            flags[name] = ~(torch.isfinite(scale) & (scale > 0)).all()
        elif scale is not None:
            flags[name] = (scale != 1).any()
    if not flags:
        return False, False, False, False
    # One device-to-host transfer for every check still to make.
    found = dict(zip(flags, torch.stack(list(flags.values())).tolist(), strict=True))
    names = ("range", "duplicate", "k_scale", "v_scale")
    bad_range, duplicate, bad_k_scale, bad_v_scale = (found.get(name, False) for name in names)
    return bad_range, duplicate, bad_k_scale, bad_v_scale


def _find_bad_values_on_cpu(
    slots: torch.Tensor | None,
    num_slots: int,
    fp8: bool,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[bool, bool, bool, bool]:
    """As `_find_bad_values_on_device`, with Python checks on host values."""
    values = [] if slots is None else slots.tolist()
    real = [v for v in values if v != -1]
    bad_range = bool(values) and (min(values) < -1 or max(values) >= num_slots)
    duplicate = len(set(real)) != len(real)
    bad_scales = []
    for scale in (k_scale, v_scale):
        scale_values = [] if scale is None else scale.reshape(-1).tolist()
        if fp8:
            bad_scales.append(not all(math.isfinite(x) and x > 0 for x in scale_values))
        else:
            bad_scales.append(any(x != 1 for x in scale_values))
    return bad_range, duplicate, bad_scales[0], bad_scales[1]


def _raise_for(
    bad_range: bool, duplicate: bool, bad_k_scale: bool, bad_v_scale: bool, num_slots: int,
    fp8: bool,
) -> None:  # fmt: skip
    if bad_range:
        raise ValueError(
            f"{_OP}: slot_mapping has a slot out of range (got a slot < -1 or >= num_blocks * "
            f"block_size = {num_slots}, expected -1 for padding or 0 <= slot < {num_slots})."
        )
    if duplicate:
        raise ValueError(
            f"{_OP}: slot_mapping gives the same slot to two tokens (got a repeated slot, "
            "expected distinct slots, -1 excepted). Check the block table the slots were built "
            "from."
        )
    for name, bad in (("k_scale", bad_k_scale), ("v_scale", bad_v_scale)):
        if bad and fp8:
            raise ValueError(
                f"{_OP}: {name} has a bad value for an fp8 cache (got a scale <= 0 or not "
                "finite, expected finite scales > 0)."
            )
        if bad:
            raise ValueError(
                f"{_OP}: {name} is not 1 for a non-fp8 cache (got a scale other than 1, "
                "expected None or ones, since only fp8 caches are scaled). Use an fp8 "
                "kv_cache_dtype or drop the scale."
            )
