"""Attention of a padded group of requests over gathered keys, in batched PyTorch ops.

The compute core of the TORCH backend. Keys arrive KV-head-major (`[num_kv_heads, B, L, D]`),
the order one indexing op copies them out of the paged cache in, so the batched matmuls run
over (kv head, request) without another copy; the query heads of a KV head go together (GQA).
Semantics are docs/semantics.md's: scale, soft cap, ALiBi, causal / sliding-window masks,
sinks in the denominator only, empty rows give zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "DenseKV",
    "PagedKV",
    "ScoreMods",
    "dense_attention",
    "is_one_load",
    "plain_decode_attention",
]

# Scores of one query chunk are materialised; bound their size (elements) to bound memory.
_MAX_SCORE_ELEMENTS = 1 << 24
# Bytes of K (or V) copied out of the paged cache per load: about one core's L2, so the copy
# is still cached when the matmul reads it.
_LOAD_BYTES = 2 << 20


@dataclass(frozen=True)
class ScoreMods:
    """Per-layer score modifiers, prepared once per impl.

    Attributes:
        scale: multiplies q·k.
        soft_cap: `cap * tanh(s / cap)` when set.
        sliding_window: W keeps keys with `p - W < j <= p`.
        alibi_slopes: float32 `[num_kv_heads, 1, G, 1, 1]` (G = query heads per KV head).
        sinks: float32 `[num_kv_heads, 1, G, 1]`, added as exp(sink) to the denominator.
    """

    scale: float
    soft_cap: float | None = None
    sliding_window: int | None = None
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None


Workspace = Callable[[int, torch.dtype, torch.device], torch.Tensor]


def _gather_blocks(source: torch.Tensor, index: torch.Tensor, workspace: Workspace):
    """Blocks `index` of `source [kinds, heads, num_blocks, block_size, head_size]` (a view of
    the cache), copied into the workspace: `[kinds, heads, len(index), block_size, head_size]`.
    The view stays 5-D: index_select on some lower-rank slices of it copies the whole pool."""
    shape = (*source.shape[:2], index.numel(), *source.shape[3:])
    numel = math.prod(shape)
    out = workspace(numel, source.dtype, source.device)[:numel].view(shape)
    return torch.index_select(source, 2, index, out=out)


class DenseKV:
    """Keys and values already in memory: `[num_kv_heads, B, L, head_size]` each."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.num_kv_heads, self.batch, self.length, self.head_size = k.shape

    def load(self, which: int, first_head: int, last_head: int) -> torch.Tensor:
        """K (which=0) or V (1) of heads `[first_head, last_head)` as float32."""
        return (self.k, self.v)[which][first_head:last_head].float()

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


class PagedKV:
    """Keys and values of B requests left in the paged cache, copied out on demand.

    Args:
        kv_cache: `[num_blocks, 2, block_size, num_kv_heads, head_size]`, any strides.
        block_ids: int `[B, nblk]` physical block ids per request (L = nblk * block_size).
        k_scale, v_scale: float32 `[]` or `[num_kv_heads]` for fp8 caches (which hold
            value / scale), else None.
        workspace: `(numel, dtype, device) -> 1-D buffer` to copy into. Reusing one matters
            on the CPU: first-touch page faults on fresh memory cost more than the copy.
        length: keep only the first `length` key positions (default: all `nblk * block_size`);
            trimming the last block's unused slots can spare a mask.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        workspace: Workspace,
        length: int | None = None,
    ) -> None:
        _, _, self.block_size, self.num_kv_heads, self.head_size = kv_cache.shape
        self.batch, nblk = block_ids.shape
        self.padded_length = nblk * self.block_size
        self.length = self.padded_length if length is None else length
        assert 0 <= self.length <= self.padded_length, "length beyond the gathered blocks"
        # [2, num_kv_heads, num_blocks, block_size, head_size]: a gather lands KV-head-major
        self.source = kv_cache.permute(1, 3, 0, 2, 4)
        self.index = block_ids.reshape(-1).to(torch.long)
        self.scales = (k_scale, v_scale)
        self.workspace = workspace

    def _load(self, kinds: slice, first_head: int, last_head: int) -> torch.Tensor:
        """K/V `kinds` of heads `[first_head, last_head)`, float32 `[kinds, h, B, L, D]`."""
        x = _gather_blocks(self.source[kinds, first_head:last_head], self.index, self.workspace)
        x = x.view(*x.shape[:2], self.batch, self.padded_length, self.head_size)
        x = x[:, :, :, : self.length].float()
        for part, scale in zip(x, self.scales[kinds], strict=True):
            if scale is not None:
                scale = scale[first_head:last_head] if scale.dim() else scale
                part.mul_(scale.view(-1, 1, 1, 1))
        return x

    def load(self, which: int, first_head: int, last_head: int) -> torch.Tensor:
        """K (which=0) or V (1) of heads `[first_head, last_head)`: float32 `[h, B, L, D]`."""
        return self._load(slice(which, which + 1), first_head, last_head)[0]

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every head, `[num_kv_heads, B, L, D]` each (dequantised for fp8)."""
        k, v = self._load(slice(0, 2), 0, self.num_kv_heads)
        return k, v


def _allowed(q_pos, k_pos, k_valid, causal: bool, sliding_window: int | None):
    """bool `[B, Lq or 1, L]` of allowed (query, key) pairs, or None when all are allowed
    (arguments as `dense_attention`'s)."""
    allowed = None
    if causal or sliding_window is not None:
        rel = k_pos.view(1, 1, -1) - q_pos.unsqueeze(-1)  # j - p: [B, Lq, L]
        allowed = rel <= 0
        if sliding_window is not None:
            allowed &= rel > -sliding_window
    if k_valid is not None:
        valid = k_valid.unsqueeze(1)  # [B, 1, L], broadcast over the queries
        allowed = valid if allowed is None else allowed & valid
    return allowed


def _manual(q, kv: DenseKV | PagedKV, q_pos, k_pos, allowed, mods: ScoreMods, use_sinks, need_lse):
    """The explicit math path, in q's dtype (float32 or float64); q `[KVH, B, G, Lq, D]`,
    `allowed` from `_allowed`. K and V are loaded a few KV heads at a time (`_LOAD_BYTES`).

    Returns out `[KVH, B, G, Lq, D]` and natural-log lse float64 `[KVH, B, G, Lq]` (None
    unless `need_lse`).
    """
    kvh, batch, group, lq, d = q.shape
    length = kv.length
    if length == 0:
        # No keys at all: zero output; the LSE is the sink term alone, or -inf.
        out = q.new_zeros(kvh, batch, group, lq, d)
        lse = q.new_full((kvh, batch, group, lq), float("-inf"), dtype=torch.float64)
        if use_sinks and mods.sinks is not None:
            lse = lse.copy_(mods.sinks.double().expand(kvh, batch, group, lq))
        return out, lse
    heads_per_load = max(1, _LOAD_BYTES // max(1, batch * length * d * 4))
    chunks = [(h, min(kvh, h + heads_per_load)) for h in range(0, kvh, heads_per_load)]
    q = q.reshape(kvh, batch, group * lq, d)
    s = torch.empty(kvh, batch, group * lq, length, dtype=q.dtype, device=q.device)
    for h0, h1 in chunks:
        torch.matmul(q[h0:h1], kv.load(0, h0, h1).to(q.dtype).transpose(-1, -2), out=s[h0:h1])
    s = s.view(kvh, batch, group, lq, length).mul_(mods.scale)
    if mods.soft_cap is not None:
        s = s.div_(mods.soft_cap).tanh_().mul_(mods.soft_cap)
    if mods.alibi_slopes is not None:
        rel = (k_pos.view(1, 1, -1) - q_pos.unsqueeze(-1)).to(s.dtype)  # [B, Lq, L]
        s = s.add_(mods.alibi_slopes * rel.unsqueeze(1))
    if allowed is not None:
        s = s.masked_fill_(~allowed.unsqueeze(1), float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    sinks = mods.sinks.unsqueeze(-1) if use_sinks and mods.sinks is not None else None
    if sinks is not None:
        row_max = torch.maximum(row_max, sinks)
    # A row with no allowed key (and no sink) has max -inf; shift by 0 so exp gives 0, not NaN.
    row_max = row_max.masked_fill_(torch.isneginf(row_max), 0.0)
    p = s.sub_(row_max).exp_()
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + (sinks - row_max).exp()
    p = p.view(kvh, batch, group * lq, length)
    out = torch.empty(kvh, batch, group * lq, d, dtype=q.dtype, device=q.device)
    for h0, h1 in chunks:
        torch.matmul(p[h0:h1], kv.load(1, h0, h1).to(q.dtype), out=out[h0:h1])
    out = out.view(kvh, batch, group, lq, d).div_(denom.clamp_min(torch.finfo(denom.dtype).tiny))
    if not need_lse:
        return out, None
    # float64: |lse| can be large, and merging partial results amplifies its rounding.
    lse = (denom.double().log() + row_max.double()).squeeze(-1)
    return out, lse


def is_one_load(batch: int, length: int, head_size: int, num_kv_heads: int) -> bool:
    """Whether K (or V) of `batch` requests of `length` keys is small enough to gather whole:
    up to `_LOAD_BYTES` of float32; larger ones are loaded a few KV heads at a time."""
    return batch * length * head_size * num_kv_heads <= _LOAD_BYTES // 4


def dense_attention(
    q: torch.Tensor,
    kv: DenseKV | PagedKV,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor | None,
    mods: ScoreMods,
    *,
    causal: bool,
    use_sinks: bool = True,
    need_lse: bool = False,
    lse_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of B padded requests.

    Args:
        q: `[B, Lq, num_heads, head_size]`.
        kv: the keys and values, `[num_kv_heads, B, L, head_size]` (`DenseKV` in memory,
            `PagedKV` still in the paged cache).
        q_pos: int64 `[B, Lq]` absolute position of each query.
        k_pos: int64 `[L]` absolute position of each key column (shared by the group).
        k_valid: bool `[B, L]`: which key columns exist for each request, or None (all).
        mods: the layer's score modifiers.
        causal: keep only keys with `j <= p`.
        use_sinks: add the layer's sinks to the denominator (False for a partial pass whose
            sink term is counted by another pass).
        need_lse: also return the natural-log LSE.
        lse_dtype: float32, or float64 for partial results that will be merged in float64.

    Returns:
        `(out [B, Lq, num_heads, head_size] in q's dtype, lse [B, num_heads, Lq] or None)`.
    """
    batch, lq, num_heads, d = q.shape
    kvh = kv.num_kv_heads
    plain = (
        mods.soft_cap is None
        and mods.alibi_slopes is None
        and (mods.sinks is None or not use_sinks)
        and not need_lse
    )
    small = is_one_load(batch, kv.length, d, kvh)
    if plain and kv.length > 0 and (small or (batch == 1 and lq > 1)):
        # SDPA's fused kernels: no score matrix in memory. All rows have a key here: causal
        # rows see themselves, windows include the current key, decode callers mask the rest.
        k, v = kv.full()
        allowed = _allowed(q_pos, k_pos, k_valid, causal, mods.sliding_window)
        # Lq == L with every key valid means a fresh sequence (keys and queries both start at
        # position 0), where SDPA's built-in causal mask is the same as ours and cheaper.
        fresh_causal = (
            causal and lq == kv.length and k_valid is None and mods.sliding_window is None
        )
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, H, Lq, D]
            k.transpose(0, 1).to(q.dtype),  # [B, KVH, L, D]
            v.transpose(0, 1).to(q.dtype),
            attn_mask=None if allowed is None or fresh_causal else allowed.unsqueeze(1),
            is_causal=fresh_causal,
            scale=mods.scale,
            enable_gqa=num_heads > kvh,
        )
        return out.transpose(1, 2), None

    # q: [B, Lq, KVH, G, D] -> [KVH, B, G, Lq, D]. Partial results to be merged in float64 are
    # computed in float64: the merge cannot be more exact than its parts.
    compute_dtype = torch.float64 if lse_dtype == torch.float64 else torch.float32
    q32 = q.to(compute_dtype).view(batch, lq, kvh, -1, d).permute(2, 0, 3, 1, 4)
    out = torch.empty(batch, lq, num_heads, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, num_heads, lq, dtype=lse_dtype, device=q.device) if need_lse else None
    chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, batch * num_heads * kv.length))
    if chunk < lq and isinstance(kv, PagedKV):
        kv = DenseKV(*kv.full())  # gather once, not once per query chunk
    for start in range(0, lq, chunk):
        end = min(lq, start + chunk)
        qp = q_pos[:, start:end]
        allowed = _allowed(qp, k_pos, k_valid, causal, mods.sliding_window)
        o, part_lse = _manual(
            q32[:, :, :, start:end], kv, qp, k_pos, allowed, mods, use_sinks, need_lse
        )
        # [KVH, B, G, Lc, D] -> [B, Lc, KVH*G, D]; lse [KVH, B, G, Lc] -> [B, KVH*G, Lc]
        out[:, start:end] = o.permute(1, 3, 0, 2, 4).flatten(2, 3)
        if lse is not None:
            lse[:, :, start:end] = part_lse.transpose(0, 1).flatten(1, 2)
    return out, lse


def plain_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_keys: int,
    key_bias: torch.Tensor | None,
    scale: float,
    workspace: Workspace,
    out: torch.Tensor,
) -> None:
    """One query token per request, no score modifier: `dense_attention`'s SDPA path for a
    decode group, as one gather of the requests' blocks and one SDPA call.

    Args:
        q: `[B, num_heads, head_size]`, the cache's dtype; `out` alike, written.
        kv_cache: `[num_blocks, 2, block_size, num_kv_heads, head_size]`, any strides.
        block_ids: int64 `[B, nblk]` physical block ids; keys are their first `num_keys`
            positions (`is_one_load` of them).
        key_bias: additive mask `[B, 1, 1, num_keys]` in q's dtype (0, or -inf past a
            request's length), or None when every request has `num_keys` keys.
        workspace: as `PagedKV`'s.
    """
    batch, num_heads, head_size = q.shape
    num_kv_heads = kv_cache.shape[3]
    kv = _gather_blocks(kv_cache.permute(1, 3, 0, 2, 4), block_ids.view(-1), workspace)
    # kv: [2, num_kv_heads, B, keys, head_size]
    kv = kv.view(2, num_kv_heads, batch, -1, head_size)[:, :, :, :num_keys]
    attended = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, num_heads, 1, head_size]
        kv[0].transpose(0, 1),  # [B, num_kv_heads, keys, head_size]
        kv[1].transpose(0, 1),
        attn_mask=key_bias,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out.copy_(attended.squeeze(2))
