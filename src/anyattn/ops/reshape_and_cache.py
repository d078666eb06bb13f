"""Write a step's new K/V into a paged KV cache, and read fp8 caches back.

`reshape_and_cache` checks its arguments (`tensor_checks.check_kv_write_args`) and writes;
`reshape_and_cache_unchecked` writes for an impl that has checked the layer call
(`anyattn.validation`); `reshape_and_cache_ref` is the plain-PyTorch reference and
`dequantize_cache` turns cache values back into model-dtype values.

The cache is the logical `(num_blocks, 2, block_size, num_kv_heads, head_size)` view (index 1:
K, V) in any stride order. Token `t` goes to `slot_mapping[t] = block_id * block_size +
offset`; -1 is padding, never written. fp8 caches hold `x / scale` by `fp8_quant`'s rule.

On CUDA, when triton is importable, the write is one Triton launch (one program per token); the
PyTorch path serves the CPU and CUDA without triton. `impl=` forces either one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anyattn.ops.fp8_quant import quantize_fp8
from anyattn.ops.impl_choice import use_triton
from anyattn.ops.tensor_checks import check_kv_write_args, check_scale, check_tensor
from anyattn.types import cache_torch_dtype, is_fp8_cache

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = [
    "CpuSlots",
    "cpu_slots",
    "dequantize_cache",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "reshape_and_cache_unchecked",
    "write_cpu_slots",
]

_OP = "reshape_and_cache"


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
    """Write `key`/`value` into `kv_cache` at the slots of `slot_mapping`, in place; after
    any error the cache is unchanged.

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

    The values of `slot_mapping[:num_tokens]` and of the scales are checked on the host (read
    back from a device, except while a CUDA graph is captured); the write never syncs.
    """
    cache_dtype = check_kv_write_args(
        _OP, key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )
    reshape_and_cache_unchecked(
        key, value, kv_cache, slot_mapping, cache_dtype, k_scale, v_scale, impl=impl
    )


def reshape_and_cache_unchecked(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_dtype: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    impl: str = "auto",
) -> None:
    """`reshape_and_cache` without its checks, for a caller that has made them (an attention
    impl, after `anyattn.validation.check_kv_write`): the same arguments, scales None for a
    non-fp8 cache."""
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
        key, value, kv_cache, slot_mapping, *scales, num_kv_heads, head_size, kv_cache.shape[2],
        *key.stride(), *value.stride(), *kv_cache.stride(), slot_mapping.stride(0),
        FP8=fp8, IS_E4M3=kv_cache.dtype == torch.float8_e4m3fn,
        K_SCALE_PER_HEAD=fp8 and k_scale is not None and k_scale.dim() == 1,
        V_SCALE_PER_HEAD=fp8 and v_scale is not None and v_scale.dim() == 1,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip


if triton is not None:
    from anyattn.ops.fp8_quant import fp8_bits

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
        IS_E4M3: tl.constexpr,
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
        # float32 holds every model-dtype value exactly: one rounding, as in torch's cast.
        x = x.to(tl.float32)
        if FP8:
            if SCALE_PER_HEAD:
                scale = tl.load(scale_ptr + heads, mask=head_mask, other=1.0)[:, None]
            else:
                scale = tl.load(scale_ptr)
            # fp8_quant's rule: IEEE division (`/` is approximate on NVIDIA), integer rounding.
            y = fp8_bits(tl.div_rn(x, scale), IS_E4M3).to(cache_ptr.dtype.element_ty, bitcast=True)
        else:
            y = x.to(cache_ptr.dtype.element_ty)
        offsets = cache_row + heads[:, None] * stride_c_head + dims[None, :] * stride_c_dim
        tl.store(cache_ptr + offsets, y, mask=mask)

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
        IS_E4M3: tl.constexpr,
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
                FP8, IS_E4M3, K_SCALE_PER_HEAD,
            )  # fmt: skip
            _store_rows(
                value_ptr, cache_ptr, v_scale_ptr, token, row + stride_c_kv, heads, dims,
                head_mask, mask,
                stride_v_token, stride_v_head, stride_v_dim, stride_c_head, stride_c_dim,
                FP8, IS_E4M3, V_SCALE_PER_HEAD,
            )  # fmt: skip


def _write_on_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    cache_dtype: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    planned = cpu_slots(slots, key.shape[0], kv_cache.shape[2])
    write_cpu_slots(planned, key, value, kv_cache, cache_dtype, k_scale, v_scale)


@dataclass(frozen=True)
class CpuSlots:
    """A slot mapping resolved for writes into CPU caches of one block size: made once per
    step (`cpu_slots`, e.g. by a metadata builder), it leaves each layer's write one
    `index_put_` (`write_cpu_slots`) instead of a dozen small tensor ops.

    Attributes:
        slot_mapping: the mapping it was made from (`serves` asks for that very tensor).
        num_tokens: tokens resolved (the first `num_tokens` entries).
        block_size: the caches' block size.
        rows: int64 `[n]` rows of the real (non -1) tokens, or None when all are real.
        index: `(block, 0 for K / 1 for V, offset)`, int64 `[2 * n]` each: K rows, then V rows.
    """

    slot_mapping: torch.Tensor
    num_tokens: int
    block_size: int
    rows: torch.Tensor | None
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def serves(self, slot_mapping: torch.Tensor, num_tokens: int, kv_cache: torch.Tensor) -> bool:
        """Whether a write of `num_tokens` tokens at `slot_mapping` into `kv_cache` is this."""
        return (
            slot_mapping is self.slot_mapping
            and num_tokens == self.num_tokens
            and kv_cache.device.type == "cpu"
            and kv_cache.shape[2] == self.block_size
        )


def cpu_slots(slot_mapping: torch.Tensor, num_tokens: int, block_size: int) -> CpuSlots:
    """Resolve the first `num_tokens` entries of a CPU `slot_mapping` (int64, -1 for padding)
    into cache indices for blocks of `block_size` tokens (no checks: see `reshape_and_cache`)."""
    slots = slot_mapping[:num_tokens]
    # On the CPU dropping padding with a mask costs nothing extra, and it saves the sync-free
    # fallback writes the device path needs.
    is_real = slots >= 0
    rows = None
    if not bool(is_real.all()):
        rows = is_real.nonzero().flatten()
        slots = slots[rows]
    block, offset = slots // block_size, slots % block_size
    kind = torch.arange(2).repeat_interleave(slots.shape[0])
    index = (block.repeat(2), kind, offset.repeat(2))
    return CpuSlots(slot_mapping, num_tokens, block_size, rows, index)


def write_cpu_slots(
    slots: CpuSlots,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    cache_dtype: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """`reshape_and_cache_unchecked` into a CPU cache at resolved slots (`slots.serves` this
    write); scales None for a non-fp8 cache."""
    if slots.rows is not None:
        key, value = key[slots.rows], value[slots.rows]
    k = _to_cache_dtype(key, k_scale, cache_dtype)
    v = _to_cache_dtype(value, v_scale, cache_dtype)
    # [2 * n, num_kv_heads, head_size] at (block, K or V, offset)
    kv_cache.index_put_(slots.index, torch.cat((k, v)))


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference for `reshape_and_cache`, one token at a time; no validation."""
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
            k = quantize_fp8(k, _per_head(k_scale), kv_cache.dtype)
            v = quantize_fp8(v, _per_head(v_scale), kv_cache.dtype)
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
    check_tensor(op, "kv_cache_part", kv_cache_part)
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
        check_scale(op, "scale", scale, kv_cache_part.shape[-2], kv_cache_part.device)
        values = values * _per_head(scale)
    return values.to(dtype)


def _to_cache_dtype(x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: str) -> torch.Tensor:
    # x: [num_tokens, num_kv_heads, head_size]; fp8 by the rule of anyattn.ops.fp8_quant.
    dtype = cache_torch_dtype(cache_dtype, x.dtype)
    if not is_fp8_cache(cache_dtype):
        return x.to(dtype)
    assert scale is not None
    return quantize_fp8(x, _per_head(scale), dtype)


def _per_head(scale: torch.Tensor) -> torch.Tensor:
    # [] broadcasts as is; [num_kv_heads] -> [num_kv_heads, 1] to broadcast over head_size.
    return scale if scale.dim() == 0 else scale[:, None]
