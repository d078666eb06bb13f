"""Index arrays the FLASH_ATTN builder hands FlashAttention, as small pure functions of CPU
tensors (the step's mirrors) or slices, so they never synchronise with a GPU: cumulative
lengths, the CUDA-graph batch size, the cascade plan and its cost model.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "CascadePlan",
    "cascade_is_worthwhile",
    "cu_seqlens_from_lens",
    "padded_num_reqs",
    "plan_cascade",
]

# Below these, the extra launches (prefix pass, merge) cost more than they save.
MIN_CASCADE_PREFIX_LEN = 256
MIN_CASCADE_REQS = 8
# One SM streams about this many times its even share of HBM bandwidth (an assumption, not a
# measurement); it bounds how fast few CTAs can read a long prefix.
_SM_BANDWIDTH_FACTOR = 4
# Query rows per CTA of the attention kernels (TILE_M).
_TILE_M = 128


def cu_seqlens_from_lens(lens: torch.Tensor) -> torch.Tensor:
    """`[0, l0, l0 + l1, ...]`: int32 `[n + 1]` from int `[n]` lengths (same device)."""
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, 0, out=out[1:])
    return out


def contiguous_key_rows(
    block_table: torch.Tensor, lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each request's keys lie in the paged cache, request after request: int64 block ids
    and offsets, both `[sum(lens)]`, so that `cache[blocks, offsets]` is the keys laid out for
    `cu_seqlens_k = cu_seqlens_from_lens(lens)`. CPU tensors in and out (`block_table`
    `[>= n, max_blocks]`, `lens` `[n]`).
    """
    lens = lens.long()
    request = torch.repeat_interleave(torch.arange(lens.shape[0]), lens)
    position = torch.arange(request.shape[0]) - (torch.cumsum(lens, 0) - lens)[request]
    return block_table[request, position // block_size].long(), position % block_size


def padded_num_reqs(num_reqs: int, capture_sizes: Sequence[int]) -> int:
    """Requests a single-token decode batch is laid out for: the smallest CUDA-graph capture size
    that holds it, else `num_reqs` itself (no graph that large)."""
    sizes = sorted(capture_sizes)
    index = bisect.bisect_left(sizes, num_reqs)
    return sizes[index] if index < len(sizes) else num_reqs


@dataclass(frozen=True)
class CascadePlan:
    """The two passes of cascade attention over a prefix shared by every request.

    Attributes:
        common_prefix_len: shared tokens (a whole number of blocks).
        prefix_blocks: block-table columns of the prefix (the same ids in every row).
        num_tokens: query tokens of the step; all of them form the prefix pass's one request.
        prefix_cu_seqlens_q: int32 `[2]` = `[0, num_tokens]`.
        prefix_seq_lens: int32 `[1]` = `[common_prefix_len]`.
        prefix_cu_seqlens_k: int32 `[2]` = `[0, common_prefix_len]`.
        suffix_seq_lens: int32 `[num_reqs]`: keys after the prefix per request.
        suffix_cu_seqlens_k: int32 `[num_reqs + 1]`, their cumulative sum.
        suffix_max_seq_len: the longest suffix.
    """

    common_prefix_len: int
    prefix_blocks: int
    num_tokens: int
    prefix_cu_seqlens_q: torch.Tensor
    prefix_seq_lens: torch.Tensor
    prefix_cu_seqlens_k: torch.Tensor
    suffix_seq_lens: torch.Tensor
    suffix_cu_seqlens_k: torch.Tensor
    suffix_max_seq_len: int


def plan_cascade(
    common_prefix_len: int,
    block_size: int,
    seq_lens_cpu: torch.Tensor,
    num_computed_tokens_cpu: torch.Tensor,
    num_tokens: int,
    *,
    api: str = "plan_cascade",
) -> CascadePlan:
    """Plan cascade attention from the CPU mirrors of one step.

    The prefix pass runs all `num_tokens` queries as one request, non-causally, over the first
    `common_prefix_len` keys (every query comes after them). The suffix pass runs each request
    over its keys from `common_prefix_len` on, with the step's own causal flag: its query
    positions stay bottom-right aligned with the shortened keys.

    Args:
        common_prefix_len: shared leading tokens, a multiple of `block_size`, within every
            request's context.
        block_size: tokens per block of the block table.
        seq_lens_cpu: int32 `[num_reqs]`, context + new tokens.
        num_computed_tokens_cpu: int32 `[num_reqs]`, context before this step.
        num_tokens: the step's real query tokens.

    Raises:
        ValueError: a prefix that is not block-aligned or reaches into some request's new tokens.
    """
    if common_prefix_len <= 0 or common_prefix_len % block_size:
        raise ValueError(
            f"{api}: common_prefix_len must be a positive multiple of block_size (got "
            f"{common_prefix_len}, block_size {block_size})."
        )
    min_context = int(num_computed_tokens_cpu.min()) if num_computed_tokens_cpu.numel() else 0
    if common_prefix_len > min_context:
        raise ValueError(
            f"{api}: common_prefix_len must lie within every request's context (got "
            f"{common_prefix_len}, shortest context {min_context})."
        )
    suffix = (seq_lens_cpu - common_prefix_len).to(torch.int32)
    return CascadePlan(
        common_prefix_len=common_prefix_len,
        prefix_blocks=common_prefix_len // block_size,
        num_tokens=num_tokens,
        prefix_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32),
        prefix_seq_lens=torch.tensor([common_prefix_len], dtype=torch.int32),
        prefix_cu_seqlens_k=torch.tensor([0, common_prefix_len], dtype=torch.int32),
        suffix_seq_lens=suffix,
        suffix_cu_seqlens_k=cu_seqlens_from_lens(suffix),
        suffix_max_seq_len=int(suffix.max()) if suffix.numel() else 0,
    )


def cascade_is_worthwhile(
    common_prefix_len: int,
    query_lens: np.ndarray,
    num_query_heads: int,
    num_kv_heads: int,
    num_sms: int,
) -> bool:
    """Whether reading the shared prefix once beats every request reading it.

    A bandwidth model of the prefix's cost, in units of "the prefix of one KV head read once at
    full bandwidth": the plain path reads it `num_reqs * num_kv_heads` times; cascade reads it
    `num_kv_heads` times but with only `num_kv_heads * ceil(query rows / TILE_M)` CTAs, each of
    which streams at most `_SM_BANDWIDTH_FACTOR / num_sms` of the bandwidth, plus the merge
    (reading two partial outputs, writing one). Without a known SM count (`num_sms <= 0`) the
    CTA limit is left out. Short prefixes and small batches never pay for the extra launches.
    """
    num_reqs = len(query_lens)
    if common_prefix_len < MIN_CASCADE_PREFIX_LEN or num_reqs < MIN_CASCADE_REQS:
        return False
    group = max(num_query_heads // max(num_kv_heads, 1), 1)
    num_tokens = int(np.sum(query_lens))

    def read_time(num_reads: int, num_ctas: int) -> float:
        if num_sms <= 0:
            return float(num_reads)
        waves = math.ceil(num_ctas / num_sms)
        return max(float(num_reads), waves * num_sms / _SM_BANDWIDTH_FACTOR)

    plain_ctas = num_kv_heads * sum(math.ceil(int(q) * group / _TILE_M) for q in query_lens)
    plain = read_time(num_reqs * num_kv_heads, plain_ctas)
    cascade_ctas = num_kv_heads * math.ceil(num_tokens * group / _TILE_M)
    # merge traffic: ~4 rows of head_size per (token, query head), against prefix rows of
    # 2 * head_size (K and V) per (position, KV head)
    merge = 2.0 * num_tokens * num_query_heads / common_prefix_len
    cascade = read_time(num_kv_heads, cascade_ctas) + merge
    return cascade < plain
