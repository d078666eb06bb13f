"""Absorbed MLA decode over the paged latent cache: one Triton launch, plus a merge for split-KV.

Each decode row `t` (one request's one new token) attends, for every head `h`, to the latent
rows `[c_kv (L), k_pe (R)]` of its request (docs/mla.md, "Two paths"):

    s[h, j] = scale * (q_latent[t, h] . c_kv[j] + q_pe[t, h] . k_pe[j])
    out[t, h] = sum_j softmax_j(s[h, j]) c_kv[j]        # [L], the latent output

`mla_decode` checks its arguments and launches `anyattn.ops.mla_decode_kernel` on a grid of
(rows, head tiles, splits): a program reads each latent row once for all `BLOCK_H` heads of its
tile (the absorbed decode at many heads is compute-bound, so the heads share each read as the
rows of `tl.dot` tiles). With `num_splits > 1` each request's keys are cut into that many
chunks (flash-decoding, for batches too small to fill the GPU) whose partial results a second
launch merges by LSE. `MLADecodeTiles` (`anyattn.ops.mla_decode_tiles`) holds the launch's
tuning knobs (tile sizes, warps, stages, latent splits, how keys are read); `mla_decode_tiles`
is the default choice. The launch
depends only on tensor sizes, never on device values: CUDA-graph safe. `mla_decode_ref` is the
same computation in plain PyTorch, for tests.
"""

from __future__ import annotations

import torch

from anyattn.ops.mla_decode_kernel import KV_BLOCK, KV_GATHER, KV_TMA
from anyattn.ops.mla_decode_tiles import (
    MLADecodeTiles,
    check_tiles,
    mla_decode_tiles,
    tma_unsupported_reason,
)

try:
    import triton
except ImportError:  # triton is an optional extra
    triton = None

__all__ = [
    "MLADecodeTiles",
    "mla_decode",
    "mla_decode_ref",
    "mla_decode_tiles",
    "mla_decode_workspace_shape",
    "tma_unsupported_reason",
]

_OP = "mla_decode"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# The widest latent the kernel holds in one accumulator tile (DeepSeek's kv_lora_rank).
_MAX_LATENT = 512

# The kernel's constexpr for each `MLADecodeTiles.kv_load`.
_KV_LOADS = {"gather": KV_GATHER, "block": KV_BLOCK, "tma": KV_TMA}

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from anyattn.ops.mla_decode_kernel import mla_decode_kernel, mla_reduce_kernel


def mla_decode_workspace_shape(
    num_rows: int, num_heads: int, kv_lora_rank: int, num_splits: int
) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    """Shapes of the float32 split-KV workspace: partial outputs and their base-2 LSEs,
    `((num_rows, num_heads, num_splits, kv_lora_rank), (num_rows, num_heads, num_splits))`."""
    return (num_rows, num_heads, num_splits, kv_lora_rank), (num_rows, num_heads, num_splits)


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    output_lse: torch.Tensor | None = None,
    num_splits: int = 1,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiles: MLADecodeTiles | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of decode rows over the paged latent cache.

    Args:
        q_latent: `[num_rows, num_heads, L]` float32 / float16 / bfloat16 (`W_UK^T q_nope`),
            `L <= 512`.
        q_pe: `[num_rows, num_heads, R]`, the rotated rope queries, `q_latent`'s dtype.
        kv_cache: `(num_blocks, block_size, L + R)`, any strides: `q_latent`'s dtype, another
            of the three float dtypes, or fp8 (then `k_scale`).
        output: `[num_rows, num_heads, L]`, written with the latent output (its dtype may
            differ from the query's).
        block_table: int32 `[>= num_rows, max_blocks]`: row t's request's blocks.
        seq_lens: int32 `[>= num_rows]`: keys of row t (0: the row gets zeros, LSE -inf).
        scale: the softmax scale.
        k_scale: float32 `[]` (or `[1]`) on the device, the per-layer scale of an fp8 cache
            (a row reads as `row.float() * k_scale`); ignored for other caches.
        output_lse: float32 `[num_heads, >= num_rows]` for the natural-log LSE, or None.
        num_splits: >1 cuts each row's keys into that many chunks merged by LSE.
        workspace: float32 `(partial_out, partial_lse)` of at least
            `mla_decode_workspace_shape(num_rows, num_heads, L, num_splits)`; required when
            `num_splits > 1`.
        tiles: the launch shape (default `mla_decode_tiles(num_heads, kv_cache, L)`), whose
            `kv_load` may restrict the block size and cache layout (`MLADecodeTiles`).

    Returns:
        `output`.

    Raises:
        TypeError: a non-tensor argument.
        ValueError: shapes, dtypes or devices that disagree, a missing workspace or fp8
            scale, tiles whose conditions the inputs do not meet (nothing is written).
        RuntimeError: triton is not installed.
    """
    _validate(q_latent, q_pe, kv_cache, output, block_table, seq_lens, k_scale, output_lse,
              num_splits, workspace)  # fmt: skip
    if triton is None:
        raise RuntimeError(
            f"{_OP}: needs triton (got no importable triton). Install the 'triton' extra."
        )
    num_rows, num_heads, rank = q_latent.shape
    rope = q_pe.shape[2]
    if num_rows == 0:
        return output
    tiles = tiles or mla_decode_tiles(num_heads, kv_cache, rank)
    check_tiles(_OP, tiles, kv_cache, rank)
    is_fp8 = kv_cache.dtype in _FP8
    dummy = seq_lens  # a valid pointer for arguments a constexpr flag disables
    partial_out, partial_lse = workspace if num_splits > 1 else (output, output)
    lse = output_lse if output_lse is not None else dummy
    grid = (num_rows, tiles.programs_per_row(num_heads), num_splits)
    latent_pad = max(16, triton.next_power_of_2(rank))
    latent_tile = latent_pad // tiles.latent_splits
    rope_pad = max(16, triton.next_power_of_2(rope))
    c_kv_desc = k_pe_desc = kv_cache
    if tiles.kv_load == "tma":
        # rows: [num_blocks * block_size, L + R], the cache's rows in block order.
        rows = kv_cache.flatten(0, 1)
        c_kv_desc = TensorDescriptor.from_tensor(rows[:, :rank], [tiles.tile_n, latent_tile])
        k_pe_desc = TensorDescriptor.from_tensor(rows[:, rank:], [tiles.tile_n, rope_pad])
    mla_decode_kernel[grid](
        q_latent, q_pe, kv_cache, c_kv_desc, k_pe_desc, output, lse, partial_out, partial_lse,
        block_table, seq_lens, k_scale.reshape(()) if is_fp8 else dummy,
        num_heads, rank, rope, float(scale) * 1.4426950408889634, num_splits,
        *q_latent.stride(), *q_pe.stride(), *kv_cache.stride(), *output.stride(),
        *(output_lse.stride() if output_lse is not None else (0, 0)),
        *(partial_out.stride() if num_splits > 1 else (0, 0, 0, 0)),
        *(partial_lse.stride() if num_splits > 1 else (0, 0, 0)),
        block_table.stride(0),
        LATENT_TILE=latent_tile,
        ROPE_PAD=rope_pad,
        BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_H=tiles.block_h,
        TILE_N=tiles.tile_n,
        LATENT_SPLITS=tiles.latent_splits,
        KV_LOAD=_KV_LOADS[tiles.kv_load],
        IS_SPLIT_KV=num_splits > 1,
        HAS_KV_SCALE=is_fp8,
        HAS_LSE=output_lse is not None,
        IEEE_DOT=q_latent.dtype == torch.float32,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        mla_reduce_kernel[(num_rows, num_heads)](
            output, lse, partial_out, partial_lse, rank, num_splits,
            *output.stride(),
            *(output_lse.stride() if output_lse is not None else (0, 0)),
            *partial_out.stride(), *partial_lse.stride(),
            LATENT_PAD=latent_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HAS_LSE=output_lse is not None,
            num_warps=4,
        )  # fmt: skip
    return output


def _validate(
    q_latent: object, q_pe: object, kv_cache: object, output: object, block_table: object,
    seq_lens: object, k_scale: object, output_lse: object, num_splits: object,
    workspace: object,
) -> None:  # fmt: skip
    """Everything the kernel relies on, checked before the launch (nothing is written first)."""
    named = {"q_latent": q_latent, "q_pe": q_pe, "kv_cache": kv_cache, "output": output,
             "block_table": block_table, "seq_lens": seq_lens}  # fmt: skip
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor (got {type(x).__name__}).")
    if q_latent.dim() != 3 or q_latent.dtype not in _DTYPES:
        raise ValueError(
            f"{_OP}: q_latent must be [num_rows, num_heads, kv_lora_rank] in float32, float16 "
            f"or bfloat16 (got {q_latent.dtype} {tuple(q_latent.shape)})."
        )
    num_rows, num_heads, rank = q_latent.shape
    if not 1 <= rank <= _MAX_LATENT:
        raise ValueError(
            f"{_OP}: kv_lora_rank not supported (got {rank}, expected 1 to {_MAX_LATENT})."
        )
    if q_pe.dim() != 3 or q_pe.shape[:2] != q_latent.shape[:2] or q_pe.dtype != q_latent.dtype:
        raise ValueError(
            f"{_OP}: q_pe must be [{num_rows}, {num_heads}, qk_rope_head_dim] in "
            f"{q_latent.dtype} (got {q_pe.dtype} {tuple(q_pe.shape)})."
        )
    row = rank + q_pe.shape[2]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != row or kv_cache.dtype not in _DTYPES + _FP8:
        raise ValueError(
            f"{_OP}: kv_cache must be a latent cache [num_blocks, block_size, {row}] "
            f"(kv_lora_rank + qk_rope_head_dim) of a float or fp8 dtype (got {kv_cache.dtype} "
            f"{tuple(kv_cache.shape)})."
        )
    if output.shape != q_latent.shape or output.dtype not in _DTYPES:
        raise ValueError(
            f"{_OP}: output must be {list(q_latent.shape)} in float32, float16 or bfloat16 "
            f"(got {output.dtype} {tuple(output.shape)})."
        )
    if (
        block_table.dtype != torch.int32
        or block_table.dim() != 2
        or block_table.shape[0] < (num_rows)
    ):
        raise ValueError(
            f"{_OP}: block_table must be int32 [>= {num_rows}, max_blocks] (got "
            f"{block_table.dtype} {tuple(block_table.shape)})."
        )
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] < num_rows:
        raise ValueError(
            f"{_OP}: seq_lens must be int32 [>= {num_rows}] (got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)})."
        )
    if kv_cache.dtype in _FP8 and (
        not isinstance(k_scale, torch.Tensor)
        or k_scale.dtype != torch.float32
        or k_scale.numel() != 1
        or k_scale.device != q_latent.device
    ):
        got = (
            f"{k_scale.dtype} {tuple(k_scale.shape)} on {k_scale.device}"
            if isinstance(k_scale, torch.Tensor)
            else repr(k_scale)
        )
        raise ValueError(
            f"{_OP}: an fp8 kv_cache needs k_scale, a float32 [] tensor on {q_latent.device} "
            f"(got {got})."
        )
    if output_lse is not None and (
        not isinstance(output_lse, torch.Tensor)
        or output_lse.dtype != torch.float32
        or output_lse.dim() != 2
        or output_lse.shape[0] != num_heads
        or output_lse.shape[1] < num_rows
    ):
        got = (
            f"{output_lse.dtype} {tuple(output_lse.shape)}"
            if isinstance(output_lse, torch.Tensor)
            else type(output_lse).__name__
        )
        raise ValueError(
            f"{_OP}: output_lse must be float32 [{num_heads}, >= {num_rows}] (got {got})."
        )
    tensors = [q_pe, kv_cache, output, block_table, seq_lens]
    tensors += [x for x in (output_lse,) if isinstance(x, torch.Tensor)]
    for x in tensors:
        if x.device != q_latent.device:
            raise ValueError(
                f"{_OP}: every tensor must be on q_latent's device (got {x.device}, expected "
                f"{q_latent.device})."
            )
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{_OP}: num_splits must be an int >= 1 (got {num_splits!r}).")
    if num_splits > 1:
        _check_workspace(workspace, num_rows, num_heads, rank, num_splits, q_latent.device)


def _check_workspace(
    workspace: object, num_rows: int, num_heads: int, rank: int, num_splits: int,
    device: torch.device,
) -> None:  # fmt: skip
    need = mla_decode_workspace_shape(num_rows, num_heads, rank, num_splits)
    ok = (
        isinstance(workspace, tuple)
        and len(workspace) == 2
        and all(
            isinstance(t, torch.Tensor)
            and t.dtype == torch.float32
            and t.device == device
            and t.dim() == len(shape)
            and all(have >= n for have, n in zip(t.shape, shape, strict=True))
            for t, shape in zip(workspace, need, strict=True)
        )
    )
    if not ok:
        got = (
            [tuple(t.shape) for t in workspace if isinstance(t, torch.Tensor)]
            if isinstance(workspace, tuple)
            else workspace
        )
        raise ValueError(
            f"{_OP}: num_splits={num_splits} needs a float32 workspace of at least {need[0]} and "
            f"{need[1]} on {device} (got {got}). Size it with mla_decode_workspace_shape."
        )


def mla_decode_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same computation in plain PyTorch, one row at a time, for tests: in `compute_dtype`
    (default float32, or float64 when `q_latent` is float64; a 16-bit dtype gives the
    low-precision run of the tolerance rule). fp8 rows are dequantised in float32 first.

    Returns:
        `(out [num_rows, num_heads, L], lse [num_heads, num_rows])` (natural log; a row with
        no key gives zeros and -inf).
    """
    acc = compute_dtype or torch.promote_types(q_latent.dtype, torch.float32)
    num_rows, num_heads, rank = q_latent.shape
    block_size = kv_cache.shape[1]
    out = torch.zeros(num_rows, num_heads, rank, dtype=acc, device=q_latent.device)
    lse = torch.full((num_heads, num_rows), float("-inf"), dtype=acc, device=q_latent.device)
    for t, seq_len in enumerate(seq_lens[:num_rows].tolist()):
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=kv_cache.device)
        rows = kv_cache[block_table[t, pos // block_size].long(), pos % block_size]
        if kv_cache.dtype in _FP8 and k_scale is not None:
            rows = rows.float() * k_scale.float()
        rows = rows.to(acc)
        q = torch.cat([q_latent[t], q_pe[t]], dim=-1).to(acc)  # [H, L + R]
        s = (q @ rows.T) * scale  # [H, seq_len]
        lse[:, t] = torch.logsumexp(s, dim=-1)
        out[t] = torch.softmax(s, dim=-1) @ rows[:, :rank]
    return out, lse
