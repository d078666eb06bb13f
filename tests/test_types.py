"""anyattn.types: enums, MultipleOf, dtype parsing and DeviceInfo."""

from __future__ import annotations

import random

import pytest
import torch

from anyattn.types import (
    CACHE_DTYPES,
    AttentionCGSupport,
    AttentionType,
    DeviceInfo,
    KVCacheLayout,
    MultipleOf,
    cache_torch_dtype,
    is_fp8_cache,
    parse_cache_dtype,
    parse_dtype,
)

CG = AttentionCGSupport


def test_attention_type_values_and_str():
    assert [t.value for t in AttentionType] == [
        "decoder",
        "encoder",
        "encoder_only",
        "encoder_decoder",
    ]
    assert str(AttentionType.ENCODER_DECODER) == "encoder_decoder"
    assert AttentionType("decoder") is AttentionType.DECODER


def test_cudagraph_support_order():
    assert CG.ALWAYS > CG.UNIFORM_BATCH > CG.UNIFORM_SINGLE_TOKEN_DECODE > CG.NEVER
    assert CG.NEVER < CG.ALWAYS and CG.NEVER <= CG.NEVER and CG.ALWAYS >= CG.UNIFORM_BATCH
    levels = list(CG)
    random.Random(0).shuffle(levels)
    assert sorted(levels) == [CG.NEVER, CG.UNIFORM_SINGLE_TOKEN_DECODE, CG.UNIFORM_BATCH, CG.ALWAYS]
    assert max(levels) is CG.ALWAYS and min(levels) is CG.NEVER


def test_cudagraph_support_does_not_compare_with_ints():
    with pytest.raises(TypeError):
        _ = CG.ALWAYS < 5


def test_multiple_of():
    assert MultipleOf(16).base == 16
    assert str(MultipleOf(16)) == "multiple of 16"
    assert MultipleOf(16) == MultipleOf(16) and hash(MultipleOf(16)) == hash(MultipleOf(16))


@pytest.mark.parametrize("base", [0, -16, 1.5, "16", None])
def test_multiple_of_rejects_bad_base(base):
    with pytest.raises(ValueError, match=r"MultipleOf: base must be a positive int \(got"):
        MultipleOf(base)


def test_kv_cache_layout():
    assert KVCacheLayout("NHD") is KVCacheLayout.NHD
    assert str(KVCacheLayout.HND) == "HND"


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_parse_dtype(text, dtype):
    assert parse_dtype(text) is dtype


def test_parse_dtype_errors_name_argument_value_and_choices():
    with pytest.raises(ValueError) as error:
        parse_dtype("float8", argument="--dtype")
    assert str(error.value) == (
        "--dtype: unknown dtype (got 'float8', expected one of float32, float16, bfloat16, "
        "fp32, fp16, half, bf16)."
    )
    with pytest.raises(ValueError, match=r"dtype: unsupported model dtype \(got torch.float64"):
        parse_dtype(torch.float64)
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype(16)  # type: ignore[arg-type]


def test_parse_cache_dtype():
    assert CACHE_DTYPES == ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    assert parse_cache_dtype(None) == "auto"
    for name in CACHE_DTYPES:
        assert parse_cache_dtype(name) == name
    with pytest.raises(ValueError) as error:
        parse_cache_dtype("fp4", argument="--kv-cache-dtype")
    assert str(error.value) == (
        "--kv-cache-dtype: unknown KV-cache dtype (got 'fp4', expected one of auto, float16, "
        "bfloat16, fp8, fp8_e4m3, fp8_e5m2)."
    )


def test_cache_dtypes():
    assert [name for name in CACHE_DTYPES if is_fp8_cache(name)] == ["fp8", "fp8_e4m3", "fp8_e5m2"]
    assert cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert cache_torch_dtype("float16", torch.bfloat16) is torch.float16
    assert cache_torch_dtype("fp8", torch.float16) is torch.float8_e4m3fn
    assert cache_torch_dtype("fp8_e4m3", torch.float16) is torch.float8_e4m3fn
    assert cache_torch_dtype("fp8_e5m2", torch.float16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="unknown KV-cache dtype"):
        cache_torch_dtype("int8", torch.float16)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu", DeviceInfo("cpu")),
        ("CPU", DeviceInfo("cpu")),
        ("sm80", DeviceInfo("cuda", (8, 0))),
        ("sm90", DeviceInfo("cuda", (9, 0))),
        ("sm100", DeviceInfo("cuda", (10, 0))),
        ("sm120", DeviceInfo("cuda", (12, 0))),
        ("sm_89", DeviceInfo("cuda", (8, 9))),
        (" SM86 ", DeviceInfo("cuda", (8, 6))),
        ("9.0", DeviceInfo("cuda", (9, 0))),
        ("10.3", DeviceInfo("cuda", (10, 3))),
    ],
)
def test_device_info_parse(text, expected):
    assert DeviceInfo.parse(text) == expected


@pytest.mark.parametrize("text", ["", "sm", "sm9", "gpu", "cuda:0", "sm-90", "9.x", "sm90a"])
def test_device_info_parse_rejects(text):
    with pytest.raises(ValueError) as error:
        DeviceInfo.parse(text)
    assert str(error.value) == (
        f"device: cannot read a device from {text!r} (expected cpu, cuda, or a compute "
        "capability such as sm80, sm90, sm100, 9.0)."
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_device_info_parse_cuda_without_gpu():
    with pytest.raises(ValueError, match="'cuda' names this machine's GPU, but torch sees none"):
        DeviceInfo.parse("cuda")


def test_device_info_constructors_and_str():
    assert DeviceInfo.cpu() == DeviceInfo("cpu")
    assert DeviceInfo.cuda(9) == DeviceInfo("cuda", (9, 0))
    assert str(DeviceInfo.cpu()) == "cpu"
    assert str(DeviceInfo.cuda(9, 0)) == "cuda sm90"
    assert str(DeviceInfo.cuda(9, 0, "NVIDIA H200")) == "cuda sm90 (NVIDIA H200)"
    assert DeviceInfo.cuda(8, 0).is_cuda and not DeviceInfo.cpu().is_cuda
    # Frozen and hashable: selection results are cached on it.
    assert len({DeviceInfo.cuda(9, 0), DeviceInfo.parse("sm90")}) == 1


def test_device_info_validation():
    with pytest.raises(ValueError, match="unknown device type"):
        DeviceInfo("tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a cuda device needs its compute capability"):
        DeviceInfo("cuda")
    with pytest.raises(ValueError, match="a cpu device has no compute capability"):
        DeviceInfo("cpu", (9, 0))


def test_device_info_current():
    assert DeviceInfo.current("cpu") == DeviceInfo.cpu()
    if not torch.cuda.is_available():
        assert DeviceInfo.current() == DeviceInfo.cpu()
    with pytest.raises(ValueError, match="unsupported device type"):
        DeviceInfo.current("meta")


@pytest.mark.gpu
def test_device_info_current_gpu():
    info = DeviceInfo.current()
    assert info.is_cuda
    assert info.capability == torch.cuda.get_device_capability()
    assert info.name == torch.cuda.get_device_name()
