"""Paged attention for a whole mixed batch in one Triton launch (plus a reduce for split-KV).

`unified_attention` checks its arguments, chooses the tile shape and launches
`unified_attention_kernel` over `num_tokens // BLOCK_Q + num_reqs` programs per KV head (each
finds its request on the GPU, so the launch depends only on tensor sizes: CUDA-graph safe).
With `num_splits > 1` (flash-decoding) each request's keys are cut into that many chunks, merged
by `split_kv_reduce`. `unified_attention_ref` is the same computation in plain PyTorch.
Semantics: docs/semantics.md; a row with no key gives zeros and LSE -inf (the sink's logit with
sinks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
except ImportError:  # triton is an optional extra
    triton = None

__all__ = [
    "UnifiedAttentionParams",
    "split_kv_workspace_shape",
    "unified_attention",
    "unified_attention_ref",
]

_OP = "unified_attention"

if triton is not None:
    from anyattn.ops.split_kv_reduce import reduce_splits_kernel
    from anyattn.ops.unified_attention_kernel import unified_attention_kernel


@dataclass(frozen=True, slots=True)
class UnifiedAttentionParams:
    """Per-layer constants of the kernel (the impl's constructor arguments).

    Attributes:
        scale: softmax scale.
        causal: keep keys `j <= p`.
        sliding_window: W (keys `p - W < j <= p`), or None.
        logits_soft_cap: cap, or None.
        alibi_slopes: float32 `[num_heads]` on the query's device, or None.
        sinks: float32 `[num_heads]` sink logits on the query's device, or None.
        k_scale, v_scale: float32 `[]` or `[num_kv_heads]` dequantisation scales of an fp8
            cache (ignored for other caches).
    """

    scale: float
    causal: bool = True
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class _Config:
    tile_m: int
    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int


def _choose_config(
    max_query_len: int,
    num_queries_per_kv: int,
    head_pad: int,
    from_input: bool,
    cache_element_size: int = 2,
) -> _Config:
    """Tile shapes, from the H200 sweep in benchmarks/RESULTS.md."""
    min_m = max(16, triton.next_power_of_2(num_queries_per_kv))
    rows = max_query_len * num_queries_per_kv
    # fp32 caches hold half the keys per byte of shared memory: halve the key tiles.
    wide = head_pad * cache_element_size > 256
    if rows <= 16:
        return _Config(min_m, min_m // num_queries_per_kv, 64 if wide else 128, 4, 3)
    long_keys = max_query_len >= 4096 and not wide
    if long_keys:  # long prefills: the biggest tiles; TMA feeds a deeper pipeline
        tile_m, tile_n, warps, stages = 128, 128, 8, (3 if from_input else 2)
    elif not wide:  # mixed batches, shorter prefills: more programs in flight
        tile_m, tile_n, warps, stages = 64, 64, 4, 3
    else:  # wide heads or fp32: keep Q + staged K/V tiles within shared memory
        tile_m, tile_n, warps, stages = 64, 32, 4, 2
    tile_m = max(min_m, tile_m)
    return _Config(tile_m, tile_m // num_queries_per_kv, tile_n, warps, stages)


def split_kv_workspace_shape(
    max_num_tokens: int, num_heads: int, head_size: int, num_splits: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the float32 split-KV workspace: partial outputs `(max_num_tokens, num_heads,
    num_splits, head_size)` and their LSEs `(max_num_tokens, num_heads, num_splits)`."""
    return (
        (max_num_tokens, num_heads, num_splits, head_size),
        (max_num_tokens, num_heads, num_splits),
    )


def unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int,
    max_query_len: int,
    params: UnifiedAttentionParams,
    *,
    output_lse: torch.Tensor | None = None,
    num_splits: int = 1,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    tiles: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Attention of every request of a step over the paged KV cache, in one launch.

    Args:
        query: `[num_tokens, num_heads, head_size]` float32 / float16 / bfloat16; rows past
            `query_start_loc[num_reqs]` are padding (never read into results).
        kv_cache: `(num_blocks, 2, block_size, num_kv_heads, head_size)` in any stride order
            (NHD or HND), the query's dtype or an fp8 dtype (then `params.k_scale/v_scale`).
        output: like `query` (its dtype may differ); rows of real tokens are written in place,
            padding rows are left untouched.
        query_start_loc: int32 `[>= num_reqs + 1]` on the device.
        seq_lens: int32 `[>= num_reqs]`: context + new tokens per request.
        block_table: int32 `[>= num_reqs, max_blocks]` physical block ids (block-size units).
        num_reqs: requests the launch covers (may count padding requests).
        max_query_len: the longest query of the step (chooses the tile shape only).
        params: the layer's constants.
        output_lse: float32 `[num_heads, num_tokens]` for the natural-log LSE, or None.
        num_splits: >1 cuts each request's keys into that many chunks (flash-decoding).
        workspace: float32 `(partial_out, partial_lse)` of `split_kv_workspace_shape` with at
            least `num_tokens` rows and `num_splits` splits; required when `num_splits > 1`.
        key, value: `[num_tokens, num_kv_heads, head_size]`, the step's new K/V, given only
            when every request is a fresh prefill (no context) whose keys equal what was just
            cached (model-dtype cache, not a shared layer): the kernel then reads them with
            TMA instead of gathering pages (CUDA, power-of-two head sizes).
        tiles: `(TILE_M, TILE_N, num_warps, num_stages[, warp_specialize])` to override the
            tile choice (tuning).

    Returns:
        `output`.
    """
    if triton is None:
        raise RuntimeError(
            f"{_OP}: needs triton (got no importable triton). Install the 'triton' extra."
        )
    _validate(query, kv_cache, output, output_lse, num_splits, workspace, key, value)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    if num_tokens == 0 or num_reqs == 0:
        return output
    queries_per_kv = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    cfg = _choose_config(
        max_query_len, queries_per_kv, head_pad, key is not None, kv_cache.element_size()
    )
    if tiles is not None:
        tile_m = max(tiles[0], triton.next_power_of_2(queries_per_kv))
        cfg = _Config(tile_m, tile_m // queries_per_kv, tiles[1], tiles[2], tiles[3])
    warp_specialize = bool(tiles[4]) if tiles is not None and len(tiles) > 4 else False
    k_desc = v_desc = None
    if key is not None:
        k_desc, v_desc = _input_descriptors(key, value, cfg.tile_n, head_pad)
    key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
    is_fp8 = kv_cache.element_size() == 1
    dummy = seq_lens  # a valid pointer for arguments a constexpr flag disables
    k_scale = params.k_scale if is_fp8 and params.k_scale is not None else None
    v_scale = params.v_scale if is_fp8 and params.v_scale is not None else None
    if num_splits > 1:
        partial_out, partial_lse = workspace
    else:
        partial_out = partial_lse = output
    num_tiles = num_tokens // cfg.block_q + num_reqs
    lse_arg = output_lse if output_lse is not None else dummy
    unified_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        query, key_cache, value_cache, k_desc, v_desc, output, lse_arg, partial_out, partial_lse,
        block_table, seq_lens, query_start_loc,
        params.alibi_slopes if params.alibi_slopes is not None else dummy,
        params.sinks if params.sinks is not None else dummy,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        num_reqs, params.scale, params.logits_soft_cap or 0.0, params.sliding_window or 0,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *output.stride(),
        *(output_lse.stride() if output_lse is not None else (0, 0)),
        *(partial_out.stride() if num_splits > 1 else (0, 0, 0, 0)),
        *(partial_lse.stride() if num_splits > 1 else (0, 0, 0)),
        block_table.stride(0), _scale_stride(k_scale), _scale_stride(v_scale),
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, QUERIES_PER_KV=queries_per_kv,
        BLOCK_SIZE=kv_cache.shape[2], TILE_M=cfg.tile_m, BLOCK_Q=cfg.block_q, TILE_N=cfg.tile_n,
        NUM_SPLITS=num_splits, IS_CAUSAL=params.causal,
        HAS_WINDOW=params.sliding_window is not None,
        HAS_SOFTCAP=params.logits_soft_cap is not None,
        HAS_ALIBI=params.alibi_slopes is not None, HAS_SINKS=params.sinks is not None,
        HAS_KV_SCALE=k_scale is not None, HAS_LSE=output_lse is not None,
        IEEE_DOT=query.dtype == torch.float32, KV_FROM_INPUT=key is not None,
        WARP_SPECIALIZE=warp_specialize, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        reduce_splits_kernel[(num_tokens, num_heads)](
            output, lse_arg, partial_out, partial_lse, query_start_loc, num_reqs,
            *output.stride(), *(output_lse.stride() if output_lse is not None else (0, 0)),
            *partial_out.stride(), *partial_lse.stride(),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), HAS_LSE=output_lse is not None,
            num_warps=4,
        )  # fmt: skip
    return output


def _validate(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    output_lse: torch.Tensor | None,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
) -> None:
    """Shapes the kernel relies on, checked before the launch."""
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{_OP}: query must be [num_tokens, num_heads, head_size] and kv_cache "
            f"[num_blocks, 2, block_size, num_kv_heads, head_size] (got {tuple(query.shape)} and "
            f"{tuple(kv_cache.shape)})."
        )
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_size or num_heads % num_kv_heads:
        raise ValueError(
            f"{_OP}: query heads must be a multiple of the cache's KV heads with the same "
            f"head_size (got query {tuple(query.shape)}, kv_cache {tuple(kv_cache.shape)})."
        )
    if output.shape != query.shape or output.device != query.device:
        raise ValueError(
            f"{_OP}: output must have the query's shape and device (got {tuple(output.shape)} "
            f"on {output.device}, expected {tuple(query.shape)} on {query.device})."
        )
    if kv_cache.device != query.device:
        raise ValueError(
            f"{_OP}: kv_cache and query are on different devices (got {kv_cache.device} and "
            f"{query.device})."
        )
    if output_lse is not None and (
        output_lse.dtype != torch.float32
        or output_lse.dim() != 2
        or output_lse.shape[0] != num_heads
        or output_lse.shape[1] < num_tokens
    ):
        raise ValueError(
            f"{_OP}: output_lse must be float32 [{num_heads}, >= {num_tokens}] (got "
            f"{output_lse.dtype} {tuple(output_lse.shape)})."
        )
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{_OP}: num_splits must be an int >= 1 (got {num_splits!r}).")
    if num_splits > 1:
        need_out, need_lse = split_kv_workspace_shape(num_tokens, num_heads, head_size, num_splits)
        ok = (
            workspace is not None
            and len(workspace) == 2
            and all(t.dtype == torch.float32 and t.device == query.device for t in workspace)
            and workspace[0].dim() == 4
            and workspace[1].dim() == 3
            and all(h >= n for h, n in zip(workspace[0].shape, need_out, strict=True))
            and all(h >= n for h, n in zip(workspace[1].shape, need_lse, strict=True))
        )
        if not ok:
            got = None if workspace is None else [tuple(t.shape) for t in workspace]
            raise ValueError(
                f"{_OP}: num_splits={num_splits} needs a float32 workspace of at least "
                f"{need_out} and {need_lse} on {query.device} (got {got}). Use "
                "split_kv_workspace_shape to size it."
            )
    if key is not None:
        pow2 = head_size >= 16 and head_size & (head_size - 1) == 0
        for name, x in (("key", key), ("value", value)):
            if (
                x is None
                or x.shape != (num_tokens, num_kv_heads, head_size)
                or x.dtype != query.dtype
                or not pow2
                or x.stride(2) != 1
                or x.stride(1) != head_size
            ):
                raise ValueError(
                    f"{_OP}: reading K/V from the inputs needs {name} of shape "
                    f"[{num_tokens}, {num_kv_heads}, {head_size}] in {query.dtype}, rows of "
                    "contiguous heads and a power-of-two head_size >= 16 (got "
                    f"{None if x is None else (tuple(x.shape), x.dtype, x.stride())})."
                )


def _input_descriptors(key: torch.Tensor, value: torch.Tensor, tile_n: int, head_pad: int):
    """TMA descriptors over the new K/V as 2-D `[num_tokens, num_kv_heads * head_size]`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_tokens, num_kv_heads, head_size = key.shape
    return tuple(
        TensorDescriptor.from_tensor(
            x.reshape(num_tokens, num_kv_heads * head_size), [tile_n, head_size]
        )
        for x in (key, value)
    )


def _scale_stride(scale: torch.Tensor | None) -> int:
    """0 for a per-tensor scale (every KV head reads element 0), else the per-head stride."""
    return 0 if scale is None or scale.numel() == 1 else scale.stride(-1)


def unified_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int,
    params: UnifiedAttentionParams,
    *,
    output_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same computation in plain PyTorch, one request at a time, for tests: in float32, or
    float64 when the query is float64."""
    acc = torch.promote_types(query.dtype, torch.float32)
    num_heads = query.shape[1]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r in range(num_reqs):
        q = query[starts[r] : starts[r + 1]].to(acc)  # [Lq, H, D]
        query_len, seq_len = q.shape[0], lens[r]
        pos = torch.arange(seq_len, device=query.device)
        blocks = block_table[r, pos // block_size].long()
        k = kv_cache[blocks, 0, pos % block_size].to(acc)  # [L, Hkv, D]
        v = kv_cache[blocks, 1, pos % block_size].to(acc)
        if kv_cache.element_size() == 1 and params.k_scale is not None:
            k = k * params.k_scale.to(acc).reshape(-1, 1)
            v = v * params.v_scale.to(acc).reshape(-1, 1)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * params.scale  # [H, Lq, L]
        if params.logits_soft_cap is not None:
            s = params.logits_soft_cap * torch.tanh(s / params.logits_soft_cap)
        q_pos = seq_len - query_len + torch.arange(query_len, device=query.device)
        rel = pos[None, :] - q_pos[:, None]  # [Lq, L]: j - p
        if params.alibi_slopes is not None:
            s = s + params.alibi_slopes.to(acc).reshape(-1, 1, 1) * rel
        allowed = torch.ones_like(rel, dtype=torch.bool)
        if params.causal:
            allowed &= rel <= 0
        if params.sliding_window is not None:
            allowed &= rel > -params.sliding_window
        s = s.masked_fill(~allowed, float("-inf"))
        if params.sinks is not None:
            sink = params.sinks.to(acc).reshape(-1, 1, 1).expand(-1, query_len, 1)
            s = torch.cat([s, sink], dim=-1)
        lse = torch.logsumexp(s, dim=-1)  # [H, Lq]
        p = torch.exp(s - lse.clamp_min(-1e30)[..., None]).nan_to_num(0.0)[..., :seq_len]
        out = torch.einsum("hqk,khd->qhd", p, v)
        output[starts[r] : starts[r + 1]] = out.to(output.dtype)
        if output_lse is not None:
            output_lse[:, starts[r] : starts[r + 1]] = lse
    return output
