"""FLASHINFER's plan-free decode: FlashInfer's XQA kernel over the step's block table.

`flashinfer.decode.xqa_batch_decode_with_kv_cache` (public API) takes the block table and the
sequence lengths as they are, on the device: no `plan()`. `build` hands the forward the step's
rows (eager) or copies them into fixed buffers a captured graph reads (`XqaGraphBuffers`).

The builder's `decode_kernel` says which decodes XQA serves: "auto" (16-bit caches with blocks
of at least `AUTO_MIN_BLOCK_SIZE` tokens, where it measured as fast as the planned decode on the
H200), "xqa" (wherever it can) or "wrapper" (never); `xqa_decode_reason` says why not. XQA has
no soft cap and no LSE output; its fp8 kernel rounds queries to e4m3 (past fp16's bound), so
"auto" keeps fp8 caches on the wrapper and "xqa" takes them under bf16 queries only. It reads
its tensors by raw pointer when the forward runs: the query is made contiguous first, and a
step's table and lengths stay unchanged until its last layer has run.
"""

from __future__ import annotations

import torch

from anyattn.metadata import first_rows

__all__ = [
    "AUTO_MIN_BLOCK_SIZE",
    "DECODE_KERNELS",
    "XQA_WORKSPACE_BYTES",
    "XqaGraphBuffers",
    "contiguous_rows",
    "run_xqa_decode",
    "xqa_decode_reason",
]

DECODE_KERNELS = ("auto", "xqa", "wrapper")
# The smallest block at which XQA was measured as fast as the planned decode (see above).
AUTO_MIN_BLOCK_SIZE = 64
XQA_BLOCK_SIZES = (16, 32, 64, 128)
XQA_MAJORS = (9, 10, 12)
# XQA keeps a request's query heads of one KV head in shared memory (`persistentQ` in its
# mha.cu): the group rounded up to 16 rows of 16-bit heads must fit 16 KiB.
XQA_Q_TILE_BYTES = 16 * 1024
# XQA's workspace: 8 MiB of semaphores (zeroed once; the kernel leaves them zeroed) and the
# multi-block scratch, whose need is bounded by the SM count (about 0.75 CTAs per SM split
# over the sequence), not by the batch: a few MiB for 132 SMs.
XQA_WORKSPACE_BYTES = 64 * 1024 * 1024
# The length a CUDA-graph batch's padding rows get: XQA runs every row of the captured size and
# must not meet an empty sequence, so each reads one key of a page id its row holds.
XQA_PADDING_LEN = 1


def xqa_decode_reason(
    decode_kernel: str,
    compute_capability: tuple[int, int] | None,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    logits_soft_cap: float,
    group: int | None = None,
) -> str | None:
    """Why a layer's decodes run the planned wrapper rather than XQA, or None when XQA runs
    them (`decode_kernel` "auto", "xqa" or "wrapper"; `compute_capability` None off CUDA;
    `group` query heads per KV head, None to leave it unchecked).

    Raises:
        ValueError: `decode_kernel` is not one of `DECODE_KERNELS`.
    """
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(
            f"FlashInferMetadataBuilder: decode_kernel not supported (got {decode_kernel!r}, "
            f"expected one of {', '.join(DECODE_KERNELS)})."
        )
    if decode_kernel == "wrapper":
        return "decode_kernel is 'wrapper'"
    if compute_capability is None or compute_capability[0] not in XQA_MAJORS:
        return f"XQA needs SM90, SM100 or SM12x (got {compute_capability})"
    if logits_soft_cap:
        return "XQA has no soft cap"
    if cache_dtype not in (dtype, torch.float8_e4m3fn):
        return f"XQA reads caches of the model dtype or fp8 e4m3 (got {cache_dtype})"
    if cache_dtype != dtype and dtype == torch.float16:
        return (
            "fp16 queries over an fp8 cache: XQA's fp8 kernel rounds them to e4m3, past "
            "fp16's error bound"
        )
    if block_size not in XQA_BLOCK_SIZES:
        return f"XQA pages are {XQA_BLOCK_SIZES} tokens (got {block_size})"
    if head_size % 16 or not 16 <= head_size <= 512:
        return f"XQA head sizes are multiples of 16 up to 512 (got {head_size})"
    if group is not None and -(-group // 16) * 16 * head_size * 2 > XQA_Q_TILE_BYTES:
        most = XQA_Q_TILE_BYTES // (2 * head_size)
        return f"XQA takes <= {most} query heads per KV head at head size {head_size} (got {group})"
    if decode_kernel == "auto" and cache_dtype != dtype:
        return (
            "fp8 caches: XQA's fp8 kernel rounds queries to e4m3 (decode_kernel 'xqa' uses "
            "it anyway)"
        )
    if decode_kernel == "auto" and block_size < AUTO_MIN_BLOCK_SIZE:
        return (
            f"blocks under {AUTO_MIN_BLOCK_SIZE} tokens: the planned decode is faster there "
            "(decode_kernel 'xqa' uses XQA anyway)"
        )
    return None


class XqaGraphBuffers:
    """The fixed page table and sequence lengths a captured XQA decode reads, one pair per
    captured batch size; a replay step's build copies its own into them.

    Padding rows (the captured size past the step's requests) get length 1 over whatever
    page id their row holds (zero, or a page of an earlier step: every id is one of the
    cache's), so the kernel never sees an empty sequence.
    """

    def __init__(self, size: int, max_pages: int, device: torch.device) -> None:
        self.page_table = torch.zeros(size, max_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)

    def fill(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int, num_pages: int
    ) -> None:
        """Copy the first `num_pages` columns of the first `num_reqs` rows of the step's
        int32 `block_table` and their int32 `seq_lens` in; the other rows become padding.

        Raises:
            ValueError: more requests or pages than the buffers hold (nothing written).
        """
        size, max_pages = self.page_table.shape
        if not 0 <= num_reqs <= size or not 0 <= num_pages <= max_pages:
            raise ValueError(
                f"FlashInferMetadataBuilder.build: a CUDA-graph step larger than its graph's "
                f"buffers (got {num_reqs} requests of up to {num_pages} pages, expected <= "
                f"{size} of <= {max_pages})."
            )
        self.page_table[:num_reqs, :num_pages].copy_(block_table[:num_reqs, :num_pages])
        self.seq_lens[:num_reqs].copy_(seq_lens[:num_reqs])
        self.seq_lens[num_reqs:].fill_(XQA_PADDING_LEN)


def run_xqa_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    k_scale: float | None,
    v_scale: float | None,
    window_left: int,
    workspace: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One single-token query per request through FlashInfer's XQA decode, written to `out`.

    Args:
        query: `[batch, num_heads, head_size]` (copied first when not contiguous).
        out: `[batch, num_heads, head_size]`, contiguous.
        kv_cache: the logical `(num_blocks, 2, block_size, num_kv_heads, head_size)` view, in
            NHD or HND memory order (XQA reads the page, token and head strides).
        page_table: int32 `[batch, pages]`, contiguous (XQA reads rows `pages` apart).
        seq_lens: int32 `[batch]` keys per request, this step's included.
        k_scale, v_scale: per-tensor fp8 scales (None: a 16-bit cache).
        window_left: keys before the query's position that stay visible, -1 for all.
        workspace: `XQA_WORKSPACE_BYTES`, zeroed before its first use, XQA's alone.
    """
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    if not query.is_contiguous():
        query = query.contiguous()
    k_scale = 1.0 if k_scale is None else k_scale
    v_scale = 1.0 if v_scale is None else v_scale
    xqa_batch_decode_with_kv_cache(
        query,
        kv_cache,
        workspace,
        page_table,
        seq_lens,
        page_table.shape[1] * kv_cache.shape[2],
        bmm1_scale=scale * k_scale,
        bmm2_scale=v_scale,
        window_left=window_left,
        out=out,
        kv_layout="NHD",
    )


def contiguous_rows(table: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """The first `num_reqs` rows of a block table (or entries of `seq_lens`) as XQA reads
    them: contiguous (a device copy when the tensor is a slice of a wider buffer)."""
    rows = first_rows(table, num_reqs)
    return rows if rows.is_contiguous() else rows.contiguous()
