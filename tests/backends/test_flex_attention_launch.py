"""FLEX_ATTENTION's kernel launch settings (`flex_attention_launch`), rule by rule: what each
call gets on which GPU, dtype, head size and page size. Their speed was measured on an H200
(benchmarks/RESULTS.md); the GPU tests run every call with them."""

from __future__ import annotations

from anyattn.backends.flex_attention_launch import paged_decode_options, rows_kernel_options


def test_pages_get_pipelined_kernel_options_within_the_shared_memory_budget():
    deep, wide = {"num_stages": 4, "num_warps": 2}, {"num_stages": 2, "num_warps": 4}
    # stages x (K + V) x key tile x head size (rounded up to a power of two) x bytes <= 64 KiB,
    # the key tile being the page up to 64 tokens; pages under 64 tokens take 4 stages where
    # they fit, else 2, as larger pages do
    assert paged_decode_options(16, 128, 2) == deep  # 32 KiB
    assert paged_decode_options(32, 128, 2) == deep  # 64 KiB
    assert paged_decode_options(16, 256, 2) == deep
    assert paged_decode_options(16, 128, 4) == deep
    assert paged_decode_options(16, 80, 2) == deep  # 80 -> 128
    assert paged_decode_options(32, 144, 2) == wide  # 144 -> 256: 128 KiB at 4 stages, 64 at 2
    assert paged_decode_options(32, 256, 2) == wide
    assert paged_decode_options(16, 256, 4) == wide
    assert paged_decode_options(64, 64, 2) == wide  # 32 KiB; 64-token pages take 2 stages
    assert paged_decode_options(64, 128, 2) == wide  # 64 KiB
    assert paged_decode_options(64, 256, 2) is None  # 128 KiB: FlexAttention's defaults
    assert paged_decode_options(128, 128, 2) == wide  # a key tile of 64: 64 KiB
    assert paged_decode_options(256, 128, 2) == wide
    assert paged_decode_options(128, 256, 2) is None
    assert paged_decode_options(32, 256, 4) is None


def test_rows_take_64_row_tiles_only_where_measured():
    narrow = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    assert rows_kernel_options((9, 0), 128, 2) == narrow  # bf16 / fp16 on an H100 / H200
    assert rows_kernel_options((9, 0), 96, 2) is None  # FlexAttention's default: the same
    assert rows_kernel_options((9, 0), 128, 4) is None  # float32
    assert rows_kernel_options((9, 0), 64, 2) is None
    assert rows_kernel_options((9, 0), 256, 2) is None
    assert rows_kernel_options((8, 0), 128, 2) is None  # not measured off sm90
    assert rows_kernel_options((10, 0), 128, 2) is None
    assert rows_kernel_options(None, 128, 2) is None  # the CPU
    # a fresh dict each call: a caller's change never reaches the next layer
    rows_kernel_options((9, 0), 128, 2)["BLOCK_M"] = 128
    assert rows_kernel_options((9, 0), 128, 2) == narrow


def test_wide_fp32_rows_take_small_single_stage_tiles_on_every_gpu():
    # FlexAttention's default launch for these asks for more shared memory than an H200 has.
    small = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    for head_size in (144, 160, 176, 192, 208, 224, 240):
        assert rows_kernel_options((9, 0), head_size, 4) == small
        assert rows_kernel_options((8, 0), head_size, 4) == small
    assert rows_kernel_options((9, 0), 256, 4) is None  # FlexAttention's own entry fits
    assert rows_kernel_options((9, 0), 160, 2) is None  # 16-bit: the default fits
    assert rows_kernel_options(None, 160, 4) is None  # the CPU
