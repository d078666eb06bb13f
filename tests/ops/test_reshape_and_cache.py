"""reshape_and_cache against its reference (exact), fp8 round trips, and every rejected input."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anyattn.ops.reshape_and_cache import (
    dequantize_cache,
    reshape_and_cache,
    reshape_and_cache_ref,
    reshape_and_cache_unchecked,
)
from anyattn.types import cache_torch_dtype, is_fp8_cache

MODEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8_CACHE_DTYPES = ["fp8", "fp8_e4m3", "fp8_e5m2"]
# Relative rounding step of each fp8 format, and its smallest subnormal (the absolute step).
FP8_STEP = {torch.float8_e4m3fn: (2.0**-3, 2.0**-9), torch.float8_e5m2: (2.0**-2, 2.0**-16)}


# --- helpers ----------------------------------------------------------------------------------


def make_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    layout: str,
    gen: torch.Generator,
    device: str = "cpu",
) -> torch.Tensor:
    """A cache full of random values (so stray writes show), logical shape, NHD or HND strides."""
    if layout == "NHD":
        physical = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=gen)
        cache = physical
    else:
        physical = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_size, generator=gen)
        cache = physical.permute(0, 1, 3, 2, 4)
    return cache.to(device=device, dtype=dtype)


def make_slots(
    num_tokens: int, num_blocks: int, block_size: int, num_padding: int, gen: torch.Generator
) -> torch.Tensor:
    """Slots of `num_tokens` tokens in shuffled blocks 1.. (block 0 is the null block), in shuffled
    token order, with `num_padding` of them replaced by -1."""
    blocks = torch.randperm(num_blocks - 1, generator=gen) + 1
    token = torch.arange(num_tokens)
    slots = blocks[token // block_size] * block_size + token % block_size
    slots = slots[torch.randperm(num_tokens, generator=gen)]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    return slots


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of x (so NaN and -0.0 compare exactly, and fp8 can be compared at all)."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def run_both(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """Run the op on `cache` and the ref on a clone (same strides); return the ref's cache."""
    expected = cache.clone()
    reshape_and_cache_ref(key, value, expected, slot_mapping, **kwargs)
    reshape_and_cache(key, value, cache, slot_mapping, **kwargs)
    return expected


def one() -> torch.Tensor:
    return torch.ones(())


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size) + 3  # a pool larger than needed, plus block 0


# --- exact writes ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_matches_ref_exactly(layout: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, block_size, num_kv_heads, head_size = 37, 16, 4, 64
    num_blocks = num_blocks_for(num_tokens, block_size)
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, layout, gen)
    before = cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    slots = make_slots(num_tokens, num_blocks, block_size, num_padding=5, gen=gen)
    # Entries past num_tokens are not read, however invalid.
    slot_mapping = torch.cat([slots, torch.tensor([-7, 10**9, 0, 0])])

    expected = run_both(key, value, cache, slot_mapping)

    assert same_bits(cache, expected)
    assert cache.stride() == before.stride()
    assert same_bits(cache[0], before[0])  # the null block
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:  # a direct look, independent of the reference
            block, offset = divmod(slot, block_size)
            assert same_bits(cache[block, 0, offset], key[token])
            assert same_bits(cache[block, 1, offset], value[token])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_layouts_agree_logically(layout: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(9, 2, 8, generator=gen).to(dtype)
    value = torch.randn(9, 2, 8, generator=gen).to(dtype)
    slots = make_slots(9, 6, 4, num_padding=2, gen=gen)
    nhd = torch.zeros(6, 2, 4, 2, 8, dtype=dtype)
    other = make_cache(6, 4, 2, 8, dtype, layout, gen).zero_()
    reshape_and_cache(key, value, nhd, slots)
    reshape_and_cache(key, value, other, slots)
    assert same_bits(nhd, other.contiguous())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_padding_only_and_no_tokens_write_nothing(layout: str) -> None:
    gen = torch.Generator().manual_seed(2)
    cache = make_cache(4, 4, 2, 8, torch.float16, layout, gen)
    before = cache.clone()
    key = torch.randn(3, 2, 8, generator=gen).half()
    reshape_and_cache(key, key.clone(), cache, torch.full((3,), -1))
    assert same_bits(cache, before)
    empty = key[:0]
    reshape_and_cache(empty, empty, cache, torch.empty(0, dtype=torch.int64))
    assert same_bits(cache, before)


def test_non_contiguous_key_and_value() -> None:
    gen = torch.Generator().manual_seed(3)
    # key/value as views into a fused qkv buffer, as a model's projection produces them.
    qkv = torch.randn(6, 3, 2, 8, generator=gen)
    key, value = qkv[:, 1], qkv[:, 2]
    cache = make_cache(5, 2, 2, 8, torch.float32, "HND", gen)
    slots = make_slots(6, 5, 2, num_padding=1, gen=gen)
    expected = run_both(key, value, cache, slots)
    assert same_bits(cache, expected)


@pytest.mark.parametrize("scale_shape", [(), (2,)])
def test_non_fp8_cache_ignores_unit_scales(scale_shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(4)
    cache = make_cache(4, 4, 2, 8, torch.bfloat16, "NHD", gen)
    plain = cache.clone()
    key = torch.randn(5, 2, 8, generator=gen).bfloat16()
    value = torch.randn(5, 2, 8, generator=gen).bfloat16()
    slots = make_slots(5, 4, 4, num_padding=1, gen=gen)
    ones = torch.ones(scale_shape)
    reshape_and_cache(key, value, cache, slots, "bfloat16", k_scale=ones, v_scale=ones)
    reshape_and_cache(key, value, plain, slots)
    assert same_bits(cache, plain)


# --- fp8 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", FP8_CACHE_DTYPES)
@pytest.mark.parametrize("is_per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_matches_ref_and_round_trips(
    layout: str, kv_cache_dtype: str, is_per_head: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(5)
    num_tokens, block_size, num_kv_heads, head_size = 21, 8, 4, 32
    num_blocks = num_blocks_for(num_tokens, block_size)
    fp8 = cache_torch_dtype(kv_cache_dtype, dtype)
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_size, fp8, layout, gen)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = (3 * torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)).to(dtype)
    scale_shape = (num_kv_heads,) if is_per_head else ()
    k_scale = torch.rand(scale_shape, generator=gen) + 0.5
    v_scale = torch.rand(scale_shape, generator=gen) + 1.0
    slots = make_slots(num_tokens, num_blocks, block_size, num_padding=3, gen=gen)

    expected = run_both(
        key, value, cache, slots, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale
    )
    assert same_bits(cache, expected)

    rel, abs_step = FP8_STEP[fp8]
    real = slots >= 0
    block, offset = slots[real] // block_size, slots[real] % block_size
    for index, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        stored = dequantize_cache(cache[:, index], scale, torch.float32)[block, offset]
        x = x[real].float()
        # scale_b: broadcast to [num_kv_heads, 1] (per head) or [] (per tensor)
        scale_b = scale[:, None] if is_per_head else scale
        bound = rel * x.abs() + abs_step * scale_b
        assert bool(((stored - x).abs() <= bound).all())


@pytest.mark.parametrize(("kv_cache_dtype", "fp8_max"), [("fp8", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_saturates(kv_cache_dtype: str, fp8_max: float) -> None:
    key = torch.tensor([1e6, -1e6, math.inf, 1.0]).reshape(1, 1, 4)
    cache = torch.zeros(2, 2, 2, 1, 4, dtype=cache_torch_dtype(kv_cache_dtype, torch.float32))
    one_ = one()
    reshape_and_cache(key, key, cache, torch.tensor([2]), kv_cache_dtype, one_, 0.5 * one_)
    assert cache[1, 0, 0].float().tolist() == [[fp8_max, -fp8_max, fp8_max, 1.0]]
    assert cache[1, 1, 0].float().tolist() == [[fp8_max, -fp8_max, fp8_max, 2.0]]
    expected = torch.zeros_like(cache)
    reshape_and_cache_ref(key, key, expected, torch.tensor([2]), kv_cache_dtype, one_, 0.5 * one_)
    assert same_bits(cache, expected)


def test_dequantize_cache() -> None:
    cache_part = torch.tensor([[[1.0, 2.0], [4.0, -8.0]]]).to(torch.float8_e4m3fn)  # [1, 2, 2]
    per_head = dequantize_cache(cache_part, torch.tensor([0.5, 2.0]), torch.float16)
    assert per_head.dtype == torch.float16
    assert per_head.tolist() == [[[0.5, 1.0], [8.0, -16.0]]]
    per_tensor = dequantize_cache(cache_part, torch.tensor(0.25), torch.float32)
    assert per_tensor.tolist() == [[[0.25, 0.5], [1.0, -2.0]]]
    assert dequantize_cache(cache_part, None, torch.float32).tolist() == [[[1, 2], [4, -8]]]
    with pytest.raises(ValueError, match="dequantize_cache: scale"):
        dequantize_cache(cache_part, torch.ones(3), torch.float32)
    with pytest.raises(TypeError, match="dequantize_cache: scale"):
        dequantize_cache(cache_part, torch.ones(2, dtype=torch.float64), torch.float32)
    with pytest.raises(ValueError, match="dequantize_cache: kv_cache_part"):
        dequantize_cache(cache_part[0, 0], None, torch.float32)


# --- properties --------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    num_tokens=st.integers(0, 40),
    block_size=st.sampled_from([1, 2, 3, 8, 16]),
    num_kv_heads=st.integers(1, 4),
    head_size=st.sampled_from([1, 4, 8, 24]),
    layout=st.sampled_from(["NHD", "HND"]),
    padding_fraction=st.floats(0.0, 1.0),
    kv_cache_dtype=st.sampled_from(["auto", "fp8_e4m3", "fp8_e5m2"]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_ref(
    num_tokens: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    layout: str,
    padding_fraction: float,
    kv_cache_dtype: str,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_blocks_for(num_tokens, block_size)
    cache_dtype = cache_torch_dtype(kv_cache_dtype, torch.float16)
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout, gen)
    before = cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).half()
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).half()
    num_padding = int(padding_fraction * num_tokens)
    slots = make_slots(num_tokens, num_blocks, block_size, num_padding, gen)
    scales = {}
    if is_fp8_cache(kv_cache_dtype):
        scales = {"k_scale": torch.rand(num_kv_heads, generator=gen) + 0.5, "v_scale": one()}

    expected = run_both(key, value, cache, slots, kv_cache_dtype=kv_cache_dtype, **scales)

    assert same_bits(cache, expected)
    assert same_bits(cache[0], before[0])


@settings(max_examples=30, deadline=None)
@given(data=st.data(), num_tokens=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]))
def test_property_arbitrary_slots_are_written_or_rejected(
    data: st.DataObject, num_tokens: int, block_size: int
) -> None:
    num_blocks = 3
    num_slots = num_blocks * block_size
    slot_list = data.draw(
        st.lists(st.integers(-3, num_slots + 2), min_size=num_tokens, max_size=num_tokens)
    )
    gen = torch.Generator().manual_seed(num_tokens)
    cache = make_cache(num_blocks, block_size, 2, 4, torch.float32, "HND", gen)
    before = cache.clone()
    key = torch.randn(num_tokens, 2, 4, generator=gen)
    slots = torch.tensor(slot_list, dtype=torch.int64)
    real = [s for s in slot_list if s >= 0]
    is_valid = all(-1 <= s < num_slots for s in slot_list) and len(set(real)) == len(real)
    if is_valid:
        expected = run_both(key, -key, cache, slots)
        assert same_bits(cache, expected)
    else:
        with pytest.raises(ValueError, match="reshape_and_cache: slot_mapping"):
            reshape_and_cache(key, -key, cache, slots)
        assert same_bits(cache, before)


# --- rejected inputs ---------------------------------------------------------------------------

NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 5, 2, 4, 4, 4


def valid_args(kv_cache_dtype: str = "auto") -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    shape = (NUM_TOKENS, NUM_KV_HEADS, HEAD_SIZE)
    cache_dtype = cache_torch_dtype(kv_cache_dtype, torch.float16)
    return {
        "key": torch.randn(shape, generator=gen).half(),
        "value": torch.randn(shape, generator=gen).half(),
        "kv_cache": make_cache(
            NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, cache_dtype, "HND", gen
        ),
        "slot_mapping": torch.tensor([4, 5, -1, 9, 15]),
        "kv_cache_dtype": kv_cache_dtype,
        "k_scale": one() if is_fp8_cache(kv_cache_dtype) else None,
        "v_scale": torch.full((NUM_KV_HEADS,), 0.5) if is_fp8_cache(kv_cache_dtype) else None,
    }


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# (case id, cache dtype string, changes to the valid arguments, error type, name in message)
BAD_INPUTS: list[tuple[str, str, Callable[[dict[str, Any]], dict[str, Any]], type, str]] = [
    ("key not a tensor", "auto", lambda a: {"key": a["key"].tolist()}, TypeError, "key"),
    ("key rank 2", "auto", lambda a: {"key": a["key"][0]}, ValueError, "key"),
    ("value shape", "auto", lambda a: {"value": a["value"][:4]}, ValueError, "value"),
    (
        "key float64",
        "auto",
        lambda a: {"key": a["key"].double(), "value": a["value"].double()},
        TypeError,
        "key",
    ),
    ("value dtype", "auto", lambda a: {"value": a["value"].float()}, TypeError, "value"),
    ("cache rank 4", "auto", lambda a: {"kv_cache": a["kv_cache"][0]}, ValueError, "kv_cache"),
    (
        "cache dim 1 not 2",
        "auto",
        lambda a: {"kv_cache": a["kv_cache"][:, :1]},
        ValueError,
        "kv_cache",
    ),
    (
        "cache num_kv_heads",
        "auto",
        lambda a: {"kv_cache": a["kv_cache"][:, :, :, :1]},
        ValueError,
        "kv_cache",
    ),
    (
        "cache head_size",
        "auto",
        lambda a: {"kv_cache": a["kv_cache"][..., :3]},
        ValueError,
        "kv_cache",
    ),
    ("cache dtype", "auto", lambda a: {"kv_cache": a["kv_cache"].float()}, TypeError, "kv_cache"),
    (
        "cache dtype vs string",
        "auto",
        lambda a: {"kv_cache_dtype": "bfloat16"},
        TypeError,
        "kv_cache",
    ),
    ("fp8 string, fp16 cache", "auto", lambda a: {"kv_cache_dtype": "fp8"}, TypeError, "kv_cache"),
    (
        "unknown cache dtype",
        "auto",
        lambda a: {"kv_cache_dtype": "fp4"},
        ValueError,
        "kv_cache_dtype",
    ),
    (
        "slot int32",
        "auto",
        lambda a: {"slot_mapping": a["slot_mapping"].int()},
        TypeError,
        "slot_mapping",
    ),
    (
        "slot 2-D",
        "auto",
        lambda a: {"slot_mapping": a["slot_mapping"][None]},
        ValueError,
        "slot_mapping",
    ),
    ("slot short", "auto", lambda a: {"slot_mapping": slots(4, 5)}, ValueError, "slot_mapping"),
    (
        "slot below -1",
        "auto",
        lambda a: {"slot_mapping": slots(4, 5, -2, 9, 15)},
        ValueError,
        "slot_mapping",
    ),
    (
        "slot past end",
        "auto",
        lambda a: {"slot_mapping": slots(4, 5, -1, 9, 16)},
        ValueError,
        "slot_mapping",
    ),
    (
        "duplicate slot",
        "auto",
        lambda a: {"slot_mapping": slots(4, 5, -1, 5, 15)},
        ValueError,
        "slot_mapping",
    ),
    ("fp8 no k_scale", "fp8", lambda a: {"k_scale": None}, ValueError, "k_scale"),
    ("fp8 no v_scale", "fp8_e5m2", lambda a: {"v_scale": None}, ValueError, "v_scale"),
    ("k_scale float64", "fp8", lambda a: {"k_scale": a["k_scale"].double()}, TypeError, "k_scale"),
    ("k_scale not tensor", "fp8", lambda a: {"k_scale": 1.0}, TypeError, "k_scale"),
    ("v_scale shape", "fp8", lambda a: {"v_scale": torch.ones(3)}, ValueError, "v_scale"),
    ("v_scale 2-D", "fp8", lambda a: {"v_scale": torch.ones(1, 2)}, ValueError, "v_scale"),
    ("k_scale zero", "fp8", lambda a: {"k_scale": torch.zeros(())}, ValueError, "k_scale"),
    ("v_scale negative", "fp8", lambda a: {"v_scale": -a["v_scale"]}, ValueError, "v_scale"),
    (
        "v_scale nan",
        "fp8",
        lambda a: {"v_scale": torch.tensor([1.0, math.nan])},
        ValueError,
        "v_scale",
    ),
    ("non-fp8 scale not 1", "auto", lambda a: {"v_scale": 2 * one()}, ValueError, "v_scale"),
    (
        "non-fp8 scale shape",
        "auto",
        lambda a: {"k_scale": torch.ones(NUM_KV_HEADS + 1)},
        ValueError,
        "k_scale",
    ),
    (
        "slot on another device",
        "auto",
        lambda a: {"slot_mapping": a["slot_mapping"].to("meta")},
        ValueError,
        "slot_mapping",
    ),
    (
        "value on another device",
        "auto",
        lambda a: {"value": a["value"].to("meta")},
        ValueError,
        "value",
    ),
    (
        "scale on another device",
        "fp8",
        lambda a: {"k_scale": one().to("meta")},
        ValueError,
        "k_scale",
    ),
]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "change", "error", "name"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_rejects_bad_input_and_leaves_cache_unchanged(
    kv_cache_dtype: str,
    change: Callable[[dict[str, Any]], dict[str, Any]],
    error: type,
    name: str,
) -> None:
    args = valid_args(kv_cache_dtype)
    cache = args["kv_cache"]
    before = cache.clone()
    args |= change(args)
    with pytest.raises(error, match=rf"^reshape_and_cache: .*\b{name}\b") as info:
        reshape_and_cache(**args)
    assert "(got" in str(info.value)
    assert same_bits(cache, before)  # the original cache, not the changed one


def test_valid_args_are_valid() -> None:
    # Guards the table above: each case must fail because of its change alone.
    for kv_cache_dtype in ("auto", "fp8", "fp8_e5m2", "bfloat16"):
        reshape_and_cache(**valid_args(kv_cache_dtype))


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype"), [("bfloat16", torch.float16), ("float16", torch.float32)]
)
def test_named_cache_dtype_casts(kv_cache_dtype: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    cache_dtype = cache_torch_dtype(kv_cache_dtype, dtype)
    cache = make_cache(4, 4, 2, 8, cache_dtype, "HND", gen)
    key = torch.randn(6, 2, 8, generator=gen).to(dtype)
    value = torch.randn(6, 2, 8, generator=gen).to(dtype)
    slots = make_slots(6, 4, 4, num_padding=1, gen=gen)
    expected = run_both(key, value, cache, slots, kv_cache_dtype=kv_cache_dtype)
    assert same_bits(cache, expected)
    block, offset = slots[slots >= 0] // 4, slots[slots >= 0] % 4
    assert same_bits(cache[block, 0, offset], key[slots >= 0].to(cache_dtype))


def test_cache_on_another_device() -> None:
    args = valid_args()
    args["kv_cache"] = args["kv_cache"].to("meta")
    with pytest.raises(ValueError, match="reshape_and_cache: kv_cache is on another device"):
        reshape_and_cache(**args)


# --- values are checked on every call; the caller's tensors are left as they are ---------------


def call_and_compare(args: dict[str, Any]) -> None:
    """Run the op on args (in place) and check its cache against the reference."""
    expected = args["kv_cache"].clone()
    reshape_and_cache_ref(**args | {"kv_cache": expected})
    reshape_and_cache(**args)
    assert same_bits(args["kv_cache"], expected)


def _set_out_of_range(slot_mapping: torch.Tensor) -> None:
    slot_mapping[0] = 10**9


def _set_duplicate(slot_mapping: torch.Tensor) -> None:
    slot_mapping[4] = slot_mapping[1]


def _refill_with_copy(slot_mapping: torch.Tensor) -> None:
    # A persistent engine buffer refilled for the next step.
    slot_mapping.copy_(slots(4, 5, -1, 9, 16))


def _write_through_view(slot_mapping: torch.Tensor) -> None:
    slot_mapping[3:][0] = -2


def _write_through_numpy(slot_mapping: torch.Tensor) -> None:
    # torch does not see a write through numpy; every call reads the values all the same.
    slot_mapping.numpy()[4] = 5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set_out_of_range, "slot_mapping has a slot out of range"),
        (_set_duplicate, "slot_mapping gives the same slot to two tokens"),
        (_refill_with_copy, "slot_mapping has a slot out of range"),
        (_write_through_view, "slot_mapping has a slot out of range"),
        (_write_through_numpy, "slot_mapping gives the same slot to two tokens"),
    ],
)
def test_changed_slot_mapping_is_checked_again(
    change: Callable[[torch.Tensor], None], message: str
) -> None:
    args = valid_args()
    call_and_compare(args)
    change(args["slot_mapping"])
    before = args["kv_cache"].clone()
    with pytest.raises(ValueError, match=rf"^reshape_and_cache: {message}[^(]* \(got"):
        reshape_and_cache(**args)
    assert same_bits(args["kv_cache"], before)


def test_fp8_scales_are_checked_again_when_changed_or_used_otherwise() -> None:
    args = valid_args("fp8")
    call_and_compare(args)
    before = args["kv_cache"].clone()
    args["k_scale"].fill_(0.0)  # the layer's scale, changed in place
    with pytest.raises(ValueError, match=r"^reshape_and_cache: k_scale has a bad value"):
        reshape_and_cache(**args)
    assert same_bits(args["kv_cache"], before)
    # v_scale (0.5) passed the fp8 check; as a scale of a non-fp8 cache it must be 1.
    plain = valid_args() | {"v_scale": args["v_scale"]}
    before = plain["kv_cache"].clone()
    with pytest.raises(ValueError, match=r"^reshape_and_cache: v_scale is not 1"):
        reshape_and_cache(**plain)
    assert same_bits(plain["kv_cache"], before)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_callers_tensors_get_no_attribute_and_stay_loadable(
    kv_cache_dtype: str, tmp_path: Any
) -> None:
    """The checks record nothing on the tensors they read: a slot mapping or a scale that went
    through the op is saved and loaded back with `torch.load`'s default (weights_only)."""
    args = valid_args(kv_cache_dtype) | {"k_scale": one(), "v_scale": torch.ones(NUM_KV_HEADS)}
    call_and_compare(args)
    call_and_compare(args)
    for name in ("slot_mapping", "k_scale", "v_scale", "key", "value"):
        assert vars(args[name]) == {}, name
        torch.save(args[name], tmp_path / f"{name}.pt")
        assert torch.equal(torch.load(tmp_path / f"{name}.pt", weights_only=True), args[name])


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_cuda_matches_ref(layout: str, kv_cache_dtype: str) -> None:
    gen = torch.Generator().manual_seed(8)
    num_tokens, block_size, num_kv_heads, head_size = 300, 16, 8, 128
    num_blocks = num_blocks_for(num_tokens, block_size)
    dtype = cache_torch_dtype(kv_cache_dtype, torch.bfloat16)
    cache = make_cache(
        num_blocks, block_size, num_kv_heads, head_size, dtype, layout, gen, device="cuda"
    )
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).bfloat16().cuda()
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).bfloat16().cuda()
    slots = make_slots(num_tokens, num_blocks, block_size, 17, gen).cuda()
    scales = {}
    if is_fp8_cache(kv_cache_dtype):
        scales = {"k_scale": torch.rand(num_kv_heads).cuda() + 0.5, "v_scale": one().cuda()}
    expected = run_both(key, value, cache, slots, kv_cache_dtype=kv_cache_dtype, **scales)
    assert same_bits(cache, expected)
    bad = slots.clone()
    bad[-1] = bad[0] if int(bad[0]) >= 0 else num_blocks * block_size
    before = cache.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, value, cache, bad, kv_cache_dtype=kv_cache_dtype, **scales)
    assert same_bits(cache, before)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay() -> None:
    gen = torch.Generator().manual_seed(9)
    cache = make_cache(6, 4, 2, 8, torch.float16, "HND", gen, device="cuda")
    key = torch.randn(8, 2, 8, generator=gen).half().cuda()
    value = torch.randn(8, 2, 8, generator=gen).half().cuda()
    slot_mapping = make_slots(8, 6, 4, 2, gen).cuda()
    expected = cache.clone()
    reshape_and_cache_ref(key, value, expected, slot_mapping)
    reshape_and_cache(key, value, cache.clone(), slot_mapping)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reshape_and_cache(key, value, cache, slot_mapping)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(cache, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_cuda_unchecked_write_does_not_sync(impl: str, kv_cache_dtype: str) -> None:
    """The write an impl runs after its host checks never reads the device back; the
    standalone op reads the values of a device slot mapping (and rejects bad ones)."""
    gen = torch.Generator().manual_seed(12)
    num_tokens, block_size, num_kv_heads, head_size = 40, 16, 4, 64
    num_blocks = num_blocks_for(num_tokens, block_size)
    dtype = cache_torch_dtype(kv_cache_dtype, torch.float16)
    cache = make_cache(
        num_blocks, block_size, num_kv_heads, head_size, dtype, "HND", gen, device="cuda"
    )
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).half().cuda()
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).half().cuda()
    slot_mapping = make_slots(num_tokens, num_blocks, block_size, 3, gen).cuda()
    scales = (None, None)
    if is_fp8_cache(kv_cache_dtype):
        scales = ((torch.rand(num_kv_heads, generator=gen) + 0.5).cuda(), one().cuda())
    expected = cache.clone()
    reshape_and_cache_ref(key, value, expected, slot_mapping, kv_cache_dtype, *scales)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        reshape_and_cache_unchecked(
            key, value, cache, slot_mapping, kv_cache_dtype, *scales, impl=impl
        )
        with pytest.raises(RuntimeError):  # the standalone op reads the slots back
            reshape_and_cache(key, value, cache, slot_mapping, kv_cache_dtype, *scales, impl=impl)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert same_bits(cache, expected)
    slot_mapping[-1] = num_blocks * block_size
    with pytest.raises(ValueError, match="slot_mapping has a slot out of range"):
        reshape_and_cache(key, value, cache, slot_mapping, kv_cache_dtype, *scales, impl=impl)
    assert same_bits(cache, expected)
