"""Copy requests' keys and values out of a paged KV cache into contiguous rows.

`gather_kv_rows` is the launcher (validates, then copies), `gather_kv_rows_ref` the plain-PyTorch
reference. Request r's `key_lens[r]` keys (positions 0, 1, ... of its block table row) go, back
to back, to rows `first_row + key_lens[0] + ... + key_lens[r - 1] + j` of `k_rows` / `v_rows`
(`[num_kv_heads, rows, head_size]`, the layout FlexAttention reads); fp8 caches are dequantised
on the way (`value.float() * scale`, then cast). Rows outside the requests' keys are untouched.

Everything per key happens on the device: the launcher reads only tensor shapes and the two host
integers it is given (`num_keys`, `max_key_len`, both known to a builder from the CPU mirrors),
never tensor values, so it does not synchronise with the GPU.

On CUDA, when triton is importable, the copy is one Triton kernel launch: program (t, r, h)
copies key tile t (`TILE_N` keys) of request r for KV head h, K and V, finding the request's
first row by summing `key_lens[:r]` itself, so no per-key or per-request array is made
beforehand. Heads are programs, not a loop, so that enough copies are in flight to use the
memory bandwidth: with the heads looped in one program, a mixed step's 2 x 2048 keys (8 heads
of 128, bf16; 128 programs) took 18.3 us on an H200, 1.49x a contiguous copy of their bytes,
and take 13.7 us (1.11x) now; a 4 x 4096 prefill's copy was at 1.09x already and stayed there
(benchmarks/RESULTS.md, sixteenth session). The
vectorised PyTorch path (a handful of ops) serves the CPU and CUDA without triton; `impl=`
forces either one (tests run the kernel on the CPU under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch

from anyattn.ops.impl_choice import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None

__all__ = ["MAX_NUM_REQS", "gather_kv_rows", "gather_kv_rows_ref"]

_OP = "gather_kv_rows"
_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Elements of one (keys x head_size) tile per head; requests are summed this many at a time.
_TILE_ELEMENTS = 4096
_BLOCK_R = 256
_NUM_WARPS = 4
MAX_NUM_REQS = 65535  # CUDA's limit on the grid's second dimension


def gather_kv_rows(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    key_lens: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    *,
    num_keys: int,
    max_key_len: int,
    first_row: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    impl: str = "auto",
) -> None:
    """Write every request's cached keys / values into `k_rows` / `v_rows`, in place.

    Args:
        kv_cache: logical shape `(num_blocks, 2, block_size, num_kv_heads, head_size)`, any
            strides (NHD or HND), index 1 being K (0) / V (1); any model or fp8 dtype.
        block_table: int32 `[>= num_reqs, max_blocks]` physical block ids per request.
        key_lens: int32 or int64 `[num_reqs]`: keys per request (`num_reqs` = its length; slice
            a padded tensor first).
        k_rows, v_rows: `[num_kv_heads, rows, head_size]`, float32 / float16 / bfloat16, same
            shape, dtype and strides; request r's key j goes to row
            `first_row + sum(key_lens[:r]) + j`.
        num_keys: `sum(key_lens)`, as a host integer (the caller knows it from CPU mirrors).
        max_key_len: `max(key_lens)` (0 without requests), as a host integer.
        first_row: the row of request 0's first key.
        k_scale, v_scale: float32 `[]`, `[1]` or `[num_kv_heads]` on the cache's device:
            values are read as `cache.float() * scale`. Both or neither; required for fp8
            caches, None (a plain cast) otherwise.
        impl: "auto" (the Triton kernel on CUDA when triton is importable, except for fp8
            e4m3 caches before sm89; else PyTorch), "torch" or "triton" (on the CPU it needs
            `TRITON_INTERPRET=1` set before triton is imported).

    Raises:
        TypeError: a non-tensor argument or a wrong dtype.
        ValueError: wrong shapes, mixed devices, rows or block table too small for the keys,
            missing or misshaped scales, an unknown `impl`.
        RuntimeError: `impl="triton"` without triton installed.

    `num_keys` and `max_key_len` must match `key_lens`: they are not checked against its values
    (that would synchronise with the GPU).
    """
    _validate(kv_cache, block_table, key_lens, k_rows, v_rows, num_keys, max_key_len, first_row)
    k_scale = _checked_scale("k_scale", k_scale, kv_cache)
    v_scale = _checked_scale("v_scale", v_scale, kv_cache)
    if (k_scale is None) != (v_scale is None):
        raise ValueError(
            f"{_OP}: k_scale and v_scale go together (got only one of them, expected both or "
            "neither). Pass both of the layer's scales."
        )
    chosen = _use_triton(impl, kv_cache)
    if num_keys == 0:
        return
    if chosen:
        _gather_with_triton(
            kv_cache, block_table, key_lens, k_rows, v_rows, max_key_len, first_row, k_scale,
            v_scale,
        )  # fmt: skip
        return
    device = kv_cache.device
    block_size = kv_cache.shape[2]
    # request, position: int64 [num_keys], which request each key belongs to and its position
    request = torch.repeat_interleave(
        torch.arange(key_lens.shape[0], device=device), key_lens, output_size=num_keys
    )
    first = torch.cumsum(key_lens, 0) - key_lens  # exclusive prefix sum
    position = torch.arange(num_keys, device=device) - first[request]
    block = block_table[request, position // block_size].long()
    offset = position % block_size
    rows = slice(first_row, first_row + num_keys)
    for which, (target, scale) in enumerate(((k_rows, k_scale), (v_rows, v_scale))):
        # stored: [num_keys, num_kv_heads, head_size], straight out of the pages
        stored = kv_cache[block, which, offset]
        if scale is not None:
            stored = stored.float() * _per_head(scale)
        target[:, rows] = stored.transpose(0, 1)


def _use_triton(impl: str, kv_cache: torch.Tensor) -> bool:
    chosen = use_triton(_OP, impl, kv_cache.device)
    if not chosen or impl != "auto" or kv_cache.dtype != torch.float8_e4m3fn:
        return chosen
    # Triton converts fp8 e4m3 only from sm89 (Ada, Hopper) on.
    return torch.cuda.get_device_capability(kv_cache.device) >= (8, 9)


def _gather_with_triton(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    key_lens: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    max_key_len: int,
    first_row: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    block_d = triton.next_power_of_2(head_size)
    tile_n = max(1, _TILE_ELEMENTS // block_d)
    dequantize = k_scale is not None
    # Never read without scales: the pointers only need a valid tensor.
    scales = (k_scale, v_scale) if dequantize else (key_lens, key_lens)
    grid = (triton.cdiv(max_key_len, tile_n), key_lens.shape[0], num_kv_heads)
    _gather_kv_rows_kernel[grid](
        kv_cache, block_table, key_lens, k_rows, v_rows, scales[0], scales[1],
        first_row, head_size, kv_cache.shape[2],
        *kv_cache.stride(), *block_table.stride(), key_lens.stride(0), *k_rows.stride(),
        _scale_stride(k_scale), _scale_stride(v_scale),
        DEQUANTIZE=dequantize, TILE_N=tile_n, BLOCK_D=block_d, BLOCK_R=_BLOCK_R,
        num_warps=_NUM_WARPS,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _load_head(cache_ptr, scale_ptr, src, dims, mask, stride_c_dim, DEQUANTIZE: tl.constexpr):
        # One head's TILE_N keys, [TILE_N, BLOCK_D] (src: int64 offsets of their dim 0).
        x = tl.load(cache_ptr + src[:, None] + dims[None, :] * stride_c_dim, mask=mask)
        if DEQUANTIZE:
            x = x.to(tl.float32) * tl.load(scale_ptr)
        return x

    @triton.jit
    def _gather_kv_rows_kernel(
        cache_ptr,
        table_ptr,
        lens_ptr,
        k_out_ptr,
        v_out_ptr,
        k_scale_ptr,
        v_scale_ptr,
        first_row,
        head_size,
        block_size,
        stride_c_block,
        stride_c_kv,
        stride_c_offset,
        stride_c_head,
        stride_c_dim,
        stride_t_req,
        stride_t_col,
        stride_lens,
        stride_o_head,
        stride_o_row,
        stride_o_dim,
        stride_k_scale,
        stride_v_scale,
        DEQUANTIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        tile = tl.program_id(0)
        req = tl.program_id(1)
        head = tl.program_id(2).to(tl.int64)  # (int64: rows * head_size may pass 2**31)
        key_len = tl.load(lens_ptr + req * stride_lens)
        # Requests shorter than the longest have empty tiles: they stop here.
        if tile * TILE_N < key_len:
            # The request's first row: first_row + sum(key_lens[:req]), BLOCK_R at a time
            # (every tile and head of the request sums the same few lengths again: L2 hits)
            start = tl.full((), 0, tl.int64) + first_row
            base = 0
            while base < req:
                others = base + tl.arange(0, BLOCK_R)
                lens = tl.load(lens_ptr + others * stride_lens, mask=others < req, other=0)
                start += tl.sum(lens.to(tl.int64), axis=0)
                base += BLOCK_R
            keys = tile * TILE_N + tl.arange(0, TILE_N)
            is_key = keys < key_len
            block = tl.load(
                table_ptr + req.to(tl.int64) * stride_t_req + (keys // block_size) * stride_t_col,
                mask=is_key,
                other=0,
            ).to(tl.int64)
            # src, dst: int64 [TILE_N], offsets of each key's (this head, dim 0) element
            src = block * stride_c_block + (keys % block_size) * stride_c_offset
            src += head * stride_c_head
            dst = (start + keys) * stride_o_row + head * stride_o_head
            dims = tl.arange(0, BLOCK_D)
            mask = is_key[:, None] & (dims[None, :] < head_size)
            # Both loads before either store: two tiles in flight per program.
            k = _load_head(cache_ptr, k_scale_ptr + head * stride_k_scale, src, dims, mask,
                           stride_c_dim, DEQUANTIZE)  # fmt: skip
            v = _load_head(cache_ptr + stride_c_kv, v_scale_ptr + head * stride_v_scale, src,
                           dims, mask, stride_c_dim, DEQUANTIZE)  # fmt: skip
            out = dst[:, None] + dims[None, :] * stride_o_dim
            tl.store(k_out_ptr + out, k.to(k_out_ptr.dtype.element_ty), mask=mask)
            tl.store(v_out_ptr + out, v.to(v_out_ptr.dtype.element_ty), mask=mask)


def gather_kv_rows_ref(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    key_lens: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    *,
    first_row: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference for `gather_kv_rows`: same result, one key at a time. No validation."""
    block_size = kv_cache.shape[2]
    row = first_row
    for r, key_len in enumerate(key_lens.tolist()):
        for j in range(key_len):
            block = int(block_table[r, j // block_size])
            for which, (target, scale) in enumerate(((k_rows, k_scale), (v_rows, v_scale))):
                stored = kv_cache[block, which, j % block_size]  # [num_kv_heads, head_size]
                if scale is not None:
                    stored = stored.float() * _per_head(scale)
                target[:, row] = stored.to(target.dtype)
            row += 1


def _per_head(scale: torch.Tensor) -> torch.Tensor:
    # [] and [1] broadcast as they are; [num_kv_heads] -> [num_kv_heads, 1] over head_size.
    return scale if scale.numel() == 1 else scale[:, None]


def _scale_stride(scale: torch.Tensor | None) -> int:
    """0 for a per-tensor scale (every head reads element 0), else the per-head stride."""
    return 0 if scale is None or scale.numel() == 1 else scale.stride(0)


def _check_tensor(name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_OP}: {name} must be a torch.Tensor (got {type(x).__name__}).")


def _checked_scale(
    name: str, scale: torch.Tensor | None, kv_cache: torch.Tensor
) -> torch.Tensor | None:
    num_kv_heads = kv_cache.shape[3]
    if scale is None:
        if kv_cache.dtype in _FP8_DTYPES:
            raise ValueError(
                f"{_OP}: {name} is required for an fp8 cache (got None, expected a float32 "
                f"tensor of shape [] or [{num_kv_heads}]). Pass the layer's {name}."
            )
        return None
    _check_tensor(name, scale)
    if scale.dtype != torch.float32:
        raise TypeError(
            f"{_OP}: {name} has the wrong dtype (got {scale.dtype}, expected torch.float32). "
            f"Pass {name}.float()."
        )
    if tuple(scale.shape) not in ((), (1,), (num_kv_heads,)):
        raise ValueError(
            f"{_OP}: {name} has the wrong shape (got {list(scale.shape)}, expected [], [1] or "
            f"[{num_kv_heads}])."
        )
    if scale.device != kv_cache.device:
        raise ValueError(
            f"{_OP}: {name} is on another device (got {scale.device}, expected "
            f"{kv_cache.device}). Move {name} to the cache's device."
        )
    return scale


def _validate(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    key_lens: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    num_keys: int,
    max_key_len: int,
    first_row: int,
) -> None:
    """Shapes, dtypes, devices and host integers; never tensor values (no sync)."""
    names = ("kv_cache", "block_table", "key_lens", "k_rows", "v_rows")
    for name, x in zip(names, (kv_cache, block_table, key_lens, k_rows, v_rows), strict=True):
        _check_tensor(name, x)
        if x.device != kv_cache.device:
            raise ValueError(
                f"{_OP}: {name} is on another device than kv_cache (got {x.device}, expected "
                f"{kv_cache.device}). Put every tensor on one device."
            )
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{_OP}: kv_cache must be (num_blocks, 2, block_size, num_kv_heads, head_size) (got "
            f"{list(kv_cache.shape)}). Allocate it with the backend's get_kv_cache_shape."
        )
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise TypeError(
            f"{_OP}: block_table must be int32 [num_reqs, max_blocks] (got {block_table.dtype} "
            f"of rank {block_table.dim()})."
        )
    if key_lens.dtype not in (torch.int32, torch.int64) or key_lens.dim() != 1:
        raise TypeError(
            f"{_OP}: key_lens must be int32 or int64 [num_reqs] (got {key_lens.dtype} of rank "
            f"{key_lens.dim()})."
        )
    num_reqs = key_lens.shape[0]
    if block_table.shape[0] < num_reqs or num_reqs > MAX_NUM_REQS:
        raise ValueError(
            f"{_OP}: block_table has too few rows or there are too many requests (got "
            f"{block_table.shape[0]} rows for {num_reqs} requests, expected >= num_reqs and "
            f"num_reqs <= {MAX_NUM_REQS})."
        )
    if k_rows.dtype not in _ROW_DTYPES:
        raise TypeError(
            f"{_OP}: k_rows has an unsupported dtype (got {k_rows.dtype}, expected float32, "
            "float16 or bfloat16)."
        )
    expected = (num_kv_heads, head_size)
    if k_rows.dim() != 3 or (k_rows.shape[0], k_rows.shape[2]) != expected:
        raise ValueError(
            f"{_OP}: k_rows must be [num_kv_heads, rows, head_size] = [{num_kv_heads}, rows, "
            f"{head_size}] (got {list(k_rows.shape)})."
        )
    same = (v_rows.shape, v_rows.dtype, v_rows.stride())
    if same != (k_rows.shape, k_rows.dtype, k_rows.stride()):
        raise ValueError(
            f"{_OP}: v_rows differs from k_rows in shape, dtype or strides (got "
            f"{list(v_rows.shape)} {v_rows.dtype} {v_rows.stride()}, expected "
            f"{list(k_rows.shape)} {k_rows.dtype} {k_rows.stride()}). Take both from one "
            "buffer."
        )
    if min(num_keys, max_key_len, first_row) < 0 or first_row + num_keys > k_rows.shape[1]:
        raise ValueError(
            f"{_OP}: the keys do not fit the rows (got first_row={first_row}, num_keys="
            f"{num_keys} for {k_rows.shape[1]} rows, expected first_row + num_keys <= rows, "
            "all >= 0). Grow k_rows / v_rows."
        )
    block_size = kv_cache.shape[2]
    if max_key_len > block_table.shape[1] * block_size:
        raise ValueError(
            f"{_OP}: block_table too narrow for the longest request (got "
            f"{block_table.shape[1]} columns of block_size {block_size}, expected >= "
            f"{-(-max_key_len // block_size)} for max_key_len {max_key_len})."
        )
