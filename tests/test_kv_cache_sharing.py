"""`plan_shared_kv_cache`: the kernel block size, layout and cache dtype two backends share,
decided from their declarations alone, or a refusal that names what differs."""

from __future__ import annotations

import pytest

from anyattn.kv_cache_sharing import KVCacheNotShareableError, plan_shared_kv_cache
from anyattn.registry import get_backend_class
from anyattn.types import KVCacheLayout, MultipleOf

TORCH = get_backend_class("TORCH")
FLEX = get_backend_class("FLEX_ATTENTION")
DIMS = {"block_size": 16, "num_kv_heads": 2, "head_size": 64}


def _plan(*backends, **overrides):
    return plan_shared_kv_cache(backends, **(DIMS | overrides))


def test_torch_and_flex_share_in_the_decode_backends_preferred_layout():
    # TORCH prefers HND, FLEX_ATTENTION NHD; both take both
    assert TORCH.supported_kv_cache_layouts()[0] is KVCacheLayout.HND
    assert FLEX.supported_kv_cache_layouts()[0] is KVCacheLayout.NHD
    shared = _plan(TORCH, FLEX)
    assert (shared.kernel_block_size, shared.layout, shared.kv_cache_dtype) == (16, "HND", "auto")
    assert shared.stride_order == TORCH.get_kv_cache_stride_order("HND") == (0, 1, 3, 2, 4)
    assert shared.backends == (TORCH, FLEX)
    assert _plan(FLEX, TORCH).layout is KVCacheLayout.NHD
    fp8 = _plan(TORCH, FLEX, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_cache_dtype == "fp8_e4m3"


def _layouts(*layouts):
    return classmethod(lambda cls: tuple(KVCacheLayout(x) for x in layouts))


def test_the_largest_kernel_block_both_read_is_chosen(make_backend):
    sixteen = make_backend(
        "SIXTEEN", block_sizes=[16, 32], supported_kv_cache_layouts=_layouts("NHD")
    )
    eight = make_backend(
        "EIGHT", block_sizes=[MultipleOf(8)], supported_kv_cache_layouts=_layouts("NHD")
    )
    assert _plan(sixteen, eight, block_size=64).kernel_block_size == 32
    assert _plan(eight, sixteen, block_size=16).kernel_block_size == 16
    with pytest.raises(KVCacheNotShareableError) as refused:
        _plan(sixteen, eight, block_size=8)
    assert str(refused.value) == (
        "KV cache shared by SIXTEEN and EIGHT: no kernel block size all of them read for engine "
        "blocks of 8 (kernel block sizes dividing 8: SIXTEEN: none; EIGHT: 8)."
    )


def test_layouts_no_backend_shares_are_refused(make_backend):
    nhd = make_backend("ONLY_NHD", supported_kv_cache_layouts=_layouts("NHD"))
    hnd = make_backend("ONLY_HND", supported_kv_cache_layouts=_layouts("HND"))
    with pytest.raises(KVCacheNotShareableError) as refused:
        _plan(nhd, hnd)
    assert str(refused.value) == (
        "KV cache shared by ONLY_NHD and ONLY_HND: no KV-cache layout all of them take "
        "(ONLY_NHD: NHD; ONLY_HND: HND)."
    )
    assert isinstance(refused.value, ValueError)
    assert _plan(nhd, TORCH).layout is KVCacheLayout.NHD  # TORCH takes NHD too


def test_a_backend_writing_kv_in_its_forward_or_missing_the_cache_dtype_is_refused(make_backend):
    writes = make_backend("WRITES_IN_FORWARD", forward_includes_kv_cache_update=True)
    with pytest.raises(KVCacheNotShareableError, match=r"WRITES_IN_FORWARD writes K/V inside"):
        _plan(TORCH, writes)
    no_fp8 = make_backend("NO_FP8", supported_kv_cache_layouts=_layouts("NHD"))
    with pytest.raises(KVCacheNotShareableError) as refused:
        _plan(TORCH, no_fp8, kv_cache_dtype="fp8")
    assert str(refused.value) == (
        "KV cache shared by TORCH and NO_FP8: cache dtype not taken by NO_FP8 (got fp8, "
        "expected one of auto, float16, bfloat16)."
    )


def test_one_backend_shares_with_itself():
    shared = _plan(TORCH, TORCH)
    assert shared.backends == (TORCH,) and shared.layout is KVCacheLayout.HND
