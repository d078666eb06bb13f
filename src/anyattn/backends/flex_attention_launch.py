"""Launch settings (`kernel_options`) for the FlexAttention kernels FLEX_ATTENTION compiles.

FlexAttention picks a default launch for each kernel by GPU, dtype and head size; for two of
FLEX_ATTENTION's calls another was measured faster on an H200, and is passed as
`kernel_options`. Each launch has compiled functions of its own (`flex_attention._compiled_attend`
keys them by it): under dynamic shapes torch.compile may trace the options' integers as
symbols, and only that key keeps one compiled graph from serving two launches.

The paged decode (`paged_decode_options`, flex_attention_paged): FlexAttention's decoding kernel's
key tile is the page, up to 64 tokens (FlexAttention's default tile, which it lowers to the page and
never raises), and its default launch is a single stage, without software pipelining over the tiles
(read in torch 2.13's source; the H200's torch 2.11 measured as that predicts). That spent 1.79x the
GPU time of its own call over contiguous keys on an H200 at 16-token pages, 1.22x at 32 and
1.00-1.03x at 64 (64 x 4096, 32 / 8 heads of 128, bf16). Pages under 64 tokens get four pipeline
stages and two warps: 0.94x and 0.95x there, 0.29-1.06x over head sizes 64-256 and batches of 8 x
32768 to 256 x 2048 at 16-token pages (benchmarks/RESULTS.md, thirteenth session). Larger pages, and
smaller ones whose four stages do not fit, get two stages and four warps: 0.26-0.98x at 64-token
pages over the same shapes against 0.33-1.08x with the defaults, 0.96x at 128 (1.03x), 1.01x at
32-token pages of head size 256 (1.29x) (fifteenth session). Each is used only where its stages' K
and V tiles fit a shared-memory budget that every GPU this backend declares has (`_STAGED_BYTES`);
elsewhere FlexAttention's defaults (64-token pages of head size 256, some fp32 caches).

The rows (`rows_kernel_options`: prefills, chunked prefills, a mixed step's other requests):
FlexAttention's main kernel, whose default on sm90 for 16-bit inputs of head size 128 is
128-row query tiles over 64-key tiles, eight warps, three stages (torch 2.13's
`template_heuristics`). 64-row query tiles with four warps and the same three stages took
0.91x of its GPU time on an H200 (torch 2.11, bf16, 32 / 8 heads of 128) for a 4 x 4096
prefill (1320 against 1457 us) and 0.92x for the 2 x 512 chunked prefills of a mixed step;
the same 64-key tiles, so each row sums its keys in the same order (no output changed by a
bit). Other settings tried there: TMA loads 0.98x, 128-key tiles 0.97-1.05x, two stages
1.15-1.27x, four warps with 128-row tiles 1.39x (benchmarks/RESULTS.md, sixteenth session).
Used where it was measured, sm90 at head size 128, in bf16 and in fp16 (not swept: the same
tiles and matrix-instruction rate as bf16, assumed to behave alike); elsewhere
FlexAttention's defaults (for head sizes without an entry of their own in that table, 80 to
112 among them, the default is this launch already).
"""

from __future__ import annotations

__all__ = ["paged_decode_options", "rows_kernel_options"]


# Pages under this many tokens get the deeper pipeline (`paged_decode_options`).
_PIPELINED_BELOW = 64
# The decoding kernel's widest key tile: FlexAttention's default BLOCK_N, lowered to the page
# where the page is smaller, never raised (torch/_inductor/kernel/flex/flex_decoding.py).
_MAX_KEY_TILE = 64
# What the pipelined stages' K and V tiles may take of shared memory: with the query tile
# and the rest, within every GPU this backend declares (sm80 and up; sm86 and sm89 have
# about 99 KiB per block), so that a layer never fails to compile for want of it.
_STAGED_BYTES = 64 * 1024


def paged_decode_options(block_size: int, head_size: int, itemsize: int) -> dict | None:
    """FlexAttention `kernel_options` for the in-place paged decode (see the module
    docstring).

    Args:
        block_size: tokens per page (the decoding kernel's key tile, up to `_MAX_KEY_TILE`).
        head_size: the layer's head size.
        itemsize: bytes per element of K and V.

    Returns:
        Pages under 64 tokens: four pipeline stages and two warps; larger pages: two stages
        and four warps; each where its stages' K and V tiles fit `_STAGED_BYTES`. Otherwise
        None (FlexAttention's defaults).
    """
    # (FlexAttention's template sizes its tiles by the head size rounded up to a power of two)
    rounded = 1 << (head_size - 1).bit_length()
    tile = min(block_size, _MAX_KEY_TILE)
    small = block_size < _PIPELINED_BELOW
    for stages, warps in ((4, 2), (2, 4)) if small else ((2, 4),):
        if stages * 2 * tile * rounded * itemsize <= _STAGED_BYTES:  # (K and V per stage)
            return {"num_stages": stages, "num_warps": warps}
    return None


# The rows kernel's launch on sm90 (`rows_kernel_options`).
_SM90_ROWS_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# fp32 rows of head sizes 129-255: FlexAttention's default launch for them (64-row tiles over
# the head size rounded up to 256) asks for 336 KiB of shared memory and fails to compile on an
# H200 (232 KiB per block). 32-row query and key tiles in one stage take about 96 KiB.
_WIDE_FP32_ROWS_OPTIONS = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def rows_kernel_options(
    compute_capability: tuple[int, int] | None, head_size: int, itemsize: int
) -> dict | None:
    """FlexAttention `kernel_options` for the rows' main kernel (see the module docstring).

    Args:
        compute_capability: the GPU's, or None off CUDA.
        head_size: the layer's head size.
        itemsize: bytes per element of the query, K and V (the model dtype).

    Returns:
        On sm90 with 16-bit inputs of head size 128: 64-row query tiles, four warps, three
        stages. On any GPU with fp32 inputs of head size 129-255: 32-row query and key tiles,
        one stage (the default launch does not fit shared memory). A fresh dict; otherwise
        None (FlexAttention's defaults).
    """
    if compute_capability is None:
        return None
    if compute_capability == (9, 0) and itemsize == 2 and head_size == 128:
        return dict(_SM90_ROWS_OPTIONS)
    if itemsize == 4 and 128 < head_size < 256:
        return dict(_WIDE_FP32_ROWS_OPTIONS)
    return None
