"""The Triton kernels of reshape_and_cache and merge_attn_states against their references.

Triton decides whether a kernel is interpreted when it is defined (when the op modules are
imported), so the CPU cases run in one subprocess with `TRITON_INTERPRET=1` set before anything
is imported: this file run as a script. The interpreter computes bf16 (see docs/semantics.md,
"Tolerance") and fp8 rounding wrongly, so there fp32/fp16 are checked, and fp8 only on values
the format holds exactly (scaling and saturation, no rounding); the `gpu` tests add bf16 and
rounded fp8.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from case_runner import exit_with_report, failures_of

from anyattn.ops.merge_attn_states import merge_attn_states, merge_attn_states_ref
from anyattn.ops.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from anyattn.types import cache_torch_dtype, is_fp8_cache

# --- reshape_and_cache ------------------------------------------------------------------------


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def make_cache(
    shape: tuple[int, int, int, int], dtype: torch.dtype, layout: str, gen: torch.Generator
) -> torch.Tensor:
    """Random cache (so stray writes show) of logical shape (nb, 2, bs, h, d), NHD or HND."""
    num_blocks, block_size, num_kv_heads, head_size = shape
    if layout == "NHD":
        cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size, generator=gen)
    else:
        physical = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_size, generator=gen)
        cache = physical.permute(0, 1, 3, 2, 4)
    return cache.to(dtype)


def check_reshape_and_cache(
    device: str, dtype: torch.dtype, cache_dtype: str, layout: str, per_head: bool = False
) -> None:
    """Triton path == reference, bit for bit: padding, slots past num_tokens, odd head_size,
    non-contiguous key/value, both layouts; fp8 with per-tensor or per-head scales."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_blocks, block_size, num_kv_heads, head_size = 7, 5, 4, 3, 12
    target = cache_torch_dtype(cache_dtype, dtype)
    if device == "cuda" and target == torch.float8_e4m3fn:
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("Triton casts to fp8 e4m3 only from sm89 on")
    cache = make_cache((num_blocks, block_size, num_kv_heads, head_size), target, layout, gen)
    # key/value: every other head_size-wide row of a wider tensor (non-contiguous).
    wide = torch.randn(2, num_tokens, num_kv_heads, 2 * head_size, generator=gen)
    k_scale = v_scale = None
    if is_fp8_cache(cache_dtype):
        # Powers of two: dividing is exact. On the CPU the values are ones the format holds
        # (the interpreter rounds to fp8 wrongly), plus some beyond its range (saturation).
        k_scale = torch.tensor([0.5, 2.0, 4.0]) if per_head else torch.tensor(0.25)
        v_scale = torch.tensor(2.0)
        wide = wide * 300
        if device == "cpu":
            wide = wide.to(target).float()
        wide[:, 0, 0, :3] = torch.tensor([1e6, -1e6, 0.0])
        wide[0] *= k_scale.reshape(-1, 1) if per_head else k_scale
        wide[1] *= v_scale
    wide = wide.to(dtype)
    key, value = wide[0, :, :, ::2], wide[1, :, :, ::2]
    # Token 1 and 5 are padding; entries past num_tokens are never read.
    slot_mapping = torch.tensor([3, -1, 17, 0, 5, -1, 19, -7, 10**9])
    expected = cache.clone()
    reshape_and_cache_ref(key, value, expected, slot_mapping, cache_dtype, k_scale, v_scale)

    def on(x: torch.Tensor | None) -> Any:
        return None if x is None else x.to(device)

    args = (on(key), on(value), on(cache), on(slot_mapping), cache_dtype, on(k_scale))
    reshape_and_cache(*args, on(v_scale), impl="triton")
    assert torch.equal(bits(args[2].cpu()), bits(expected))


def check_reshape_and_cache_writes_nothing(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = make_cache((3, 4, 2, 8), torch.float16, "HND", gen).to(device)
    before = cache.clone()
    key = torch.randn(3, 2, 8, generator=gen).to(device=device, dtype=torch.float16)
    slots = torch.full((3,), -1, device=device)
    reshape_and_cache(key, key, cache, slots, impl="triton")
    reshape_and_cache(key[:0], key[:0], cache, slots, impl="triton")
    assert torch.equal(bits(cache), bits(before))


# --- merge_attn_states ------------------------------------------------------------------------


def check_merge(
    device: str,
    dtype: torch.dtype,
    lse_base_on_e: bool,
    lse_dtype: torch.dtype,
    with_output_lse: bool = True,
    output_dtype: torch.dtype | None = None,
) -> None:
    """Triton path ~= reference: empty sides (-inf, +inf) with garbage rows, rows empty on both
    sides, odd head_size, non-contiguous inputs, both LSE bases and dtypes."""
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_heads, head_size = 5, 3, 12
    outs = torch.randn(2, num_tokens, num_heads, 2 * head_size, generator=gen).to(dtype)
    prefix, suffix = outs[0, ..., :head_size], outs[1, ..., head_size:]
    # LSEs: [num_heads, num_tokens] views of [num_tokens, num_heads] tensors (non-contiguous).
    lse_p = (torch.randn(num_tokens, num_heads, generator=gen) * 4).to(lse_dtype).t()
    lse_s = (torch.randn(num_tokens, num_heads, generator=gen) * 4).to(lse_dtype).t()
    lse_p[0, 0], prefix[0, 0, 0] = -math.inf, math.nan  # an empty side's garbage is ignored
    lse_s[0, 1], suffix[1, 0, :] = math.inf, math.inf
    lse_p[1, 2], lse_s[1, 2] = -math.inf, math.inf  # empty on both sides
    lse_p[2, 3], lse_s[2, 3] = 60.0, -60.0  # one side dominates
    output_dtype = output_dtype or dtype
    expected = torch.empty(num_tokens, num_heads, head_size, dtype=output_dtype)
    expected_lse = torch.empty(num_heads, num_tokens)
    merge_attn_states_ref(expected, prefix, lse_p, suffix, lse_s, expected_lse, lse_base_on_e)

    output = torch.full_like(expected, math.nan, device=device)
    output_lse = torch.full_like(expected_lse, math.nan, device=device) if with_output_lse else None
    merge_attn_states(
        output,
        prefix.to(device),
        lse_p.to(device),
        suffix.to(device),
        lse_s.to(device),
        output_lse,
        lse_base_on_e,
        impl="triton",
    )
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[output_dtype]
    torch.testing.assert_close(output.cpu(), expected, atol=tol, rtol=tol)
    assert torch.equal(output[2, 1].cpu(), torch.zeros(head_size, dtype=output_dtype))
    if output_lse is not None:
        torch.testing.assert_close(output_lse.cpu(), expected_lse, atol=1e-5, rtol=1e-6)
        assert output_lse[1, 2].item() == -math.inf


def check_merge_in_place(device: str, dtype: torch.dtype) -> None:
    """output may be prefix_output, output_lse prefix_lse."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randn(4, 2, 8, generator=gen).to(device=device, dtype=dtype)
    suffix = torch.randn(4, 2, 8, generator=gen).to(device=device, dtype=dtype)
    lse_p = torch.randn(2, 4, generator=gen).to(device)
    lse_s = torch.randn(2, 4, generator=gen).to(device)
    expected, expected_lse = torch.empty_like(prefix), torch.empty_like(lse_p)
    merge_attn_states(expected, prefix, lse_p, suffix, lse_s, expected_lse, impl="torch")
    merge_attn_states(prefix, prefix, lse_p, suffix, lse_s, lse_p, impl="triton")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(prefix, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(lse_p, expected_lse, atol=1e-5, rtol=1e-6)


# --- the cases --------------------------------------------------------------------------------


def cases(device: str) -> list[tuple[Callable[..., None], tuple[Any, ...]]]:
    dtypes = [torch.float32, torch.float16]
    if device == "cuda":
        dtypes.append(torch.bfloat16)
    found: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
    for dtype in dtypes:
        for layout in ("NHD", "HND"):
            found.append((check_reshape_and_cache, (device, dtype, "auto", layout)))
        for other in ("float16", "bfloat16"):
            # Casts to another cache dtype; the interpreter cannot round to bf16.
            if cache_torch_dtype(other, dtype) != dtype and (device, other) != ("cpu", "bfloat16"):
                found.append((check_reshape_and_cache, (device, dtype, other, "HND")))
        for fp8 in ("fp8", "fp8_e5m2"):
            for per_head in (False, True):
                found.append((check_reshape_and_cache, (device, dtype, fp8, "HND", per_head)))
        for base_e in (True, False):
            for lse_dtype in (torch.float32, torch.float64):
                found.append((check_merge, (device, dtype, base_e, lse_dtype)))
        found.append((check_merge, (device, dtype, True, torch.float32, False)))
        found.append((check_merge, (device, dtype, False, torch.float32, True, torch.float32)))
        found.append((check_merge_in_place, (device, dtype)))
    found.append((check_reshape_and_cache_writes_nothing, (device,)))
    return found


def case_id(case: tuple[Callable[..., None], tuple[Any, ...]]) -> str:
    check, args = case
    return "-".join([check.__name__.removeprefix("check_"), *map(str, args[1:])])


def run_cases(device: str) -> list[str]:
    """Run every case, return the ids (and errors) of those that failed."""
    return failures_of(cases(device), lambda case: case[0](*case[1]), case_id)


def test_kernels_under_interpreter(triton_interpreter: Callable[..., str]) -> None:
    stdout = triton_interpreter(__file__)
    assert "ran" in stdout, stdout


def test_unknown_impl_is_rejected_after_validation() -> None:
    key = torch.zeros(2, 1, 4)
    cache = torch.zeros(2, 2, 2, 1, 4)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="unknown impl"):
        reshape_and_cache(key, key, cache, slots, impl="cuda")
    with pytest.raises(TypeError, match="slot_mapping has the wrong dtype"):
        reshape_and_cache(key, key, cache, slots.int(), impl="cuda")
    assert not cache.any()
    lse = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown impl"):
        merge_attn_states(key, key, lse, key, lse, impl="cuda")
    with pytest.raises(TypeError, match="wrong dtype"):
        merge_attn_states(key, key, lse.half(), key, lse, impl="cuda")
    assert not key.any()


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_cpu_impls_match_ref(impl: str) -> None:
    gen = torch.Generator().manual_seed(4)
    key = torch.randn(3, 2, 4, generator=gen)
    cache, expected = torch.zeros(3, 2, 2, 2, 4), torch.zeros(3, 2, 2, 2, 4)
    slots = torch.tensor([4, -1, 1])
    reshape_and_cache(key, key, cache, slots, impl=impl)
    reshape_and_cache_ref(key, key, expected, slots)
    assert torch.equal(cache, expected)
    lse = torch.randn(2, 3, generator=gen)
    out, out_ref = torch.empty_like(key), torch.empty_like(key)
    merge_attn_states(out, key, lse, key * 2, lse + 1, impl=impl)
    merge_attn_states_ref(out_ref, key, lse, key * 2, lse + 1)
    torch.testing.assert_close(out, out_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases("cuda"), ids=case_id)
def test_kernels_on_cuda(case: tuple[Callable[..., None], tuple[Any, ...]]) -> None:
    pytest.importorskip("triton")
    check, args = case
    check(*args)


@pytest.mark.gpu
def test_auto_uses_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from anyattn.ops import merge_attn_states as merge_module
    from anyattn.ops import reshape_and_cache as cache_module

    calls: list[str] = []
    real_write, real_merge = cache_module._write_with_triton, merge_module._merge_with_triton

    def write(*args: Any) -> None:
        calls.append("write")
        real_write(*args)

    def merge(*args: Any) -> None:
        calls.append("merge")
        real_merge(*args)

    monkeypatch.setattr(cache_module, "_write_with_triton", write)
    monkeypatch.setattr(merge_module, "_merge_with_triton", merge)
    key = torch.randn(3, 2, 8, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(2, 2, 4, 2, 8, device="cuda", dtype=torch.bfloat16)
    reshape_and_cache(key, key, cache, torch.tensor([0, 5, -1], device="cuda"))
    lse = torch.randn(2, 3, device="cuda")
    merge_attn_states(torch.empty_like(key), key, lse, key, lse)
    assert calls == ["write", "merge"]


if __name__ == "__main__":
    # Run by test_kernels_under_interpreter with TRITON_INTERPRET=1.
    exit_with_report(run_cases("cpu"), len(cases("cpu")))
