"""merge_attn_states against attention over the union of keys (float64), edge rows, bad inputs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anyattn.ops.merge_attn_states import merge_attn_states, merge_attn_states_ref

LOG2_E = 1 / math.log(2)


# --- helpers ----------------------------------------------------------------------------------


def attention64(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 softmax attention of each query over its allowed keys.

    query: [num_tokens, num_heads, head_size]; key, value: [num_keys, num_heads, head_size];
    allowed: bool [num_tokens, num_keys]. Returns out [num_tokens, num_heads, head_size] (zeros
    for a row with no allowed key) and lse [num_heads, num_tokens] (natural log, -inf there).
    """
    query, key, value = query.double(), key.double(), value.double()
    # scores: [num_heads, num_tokens, num_keys]
    scores = torch.einsum("thd,khd->htk", query, key) / math.sqrt(query.shape[-1])
    scores = scores.masked_fill(~allowed[None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    has_key = torch.isfinite(lse)[..., None]
    probs = torch.where(has_key, torch.exp(scores - torch.where(has_key, lse[..., None], 0)), 0)
    return torch.einsum("htk,khd->thd", probs, value), lse


def split_problem(
    num_tokens: int, num_heads: int, head_size: int, num_keys: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random q/k/v, each token's keys split at random into a prefix and a suffix set; the two
    partial results and attention over all keys, in float64."""
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen, dtype=torch.float64)
    key = torch.randn(num_keys, num_heads, head_size, generator=gen, dtype=torch.float64)
    value = torch.randn(num_keys, num_heads, head_size, generator=gen, dtype=torch.float64)
    in_prefix = torch.rand(num_tokens, num_keys, generator=gen) < 0.5
    prefix_output, prefix_lse = attention64(query, key, value, in_prefix)
    suffix_output, suffix_lse = attention64(query, key, value, ~in_prefix)
    everything = torch.ones(num_tokens, num_keys, dtype=torch.bool)
    union_output, union_lse = attention64(query, key, value, everything)
    return {
        "prefix_output": prefix_output,
        "prefix_lse": prefix_lse,
        "suffix_output": suffix_output,
        "suffix_lse": suffix_lse,
        "union_output": union_output,
        "union_lse": union_lse,
    }


def merge_in_dtype(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The merge formula evaluated entirely in `dtype` (STYLE's "oracle run in the input dtype");
    only for rows with keys on both sides."""
    lse_p, lse_s = prefix_lse.t().to(dtype), suffix_lse.t().to(dtype)
    lse_max = torch.maximum(lse_p, lse_s)
    weight_p = torch.exp(lse_p - lse_max)[..., None]
    weight_s = torch.exp(lse_s - lse_max)[..., None]
    out_p, out_s = prefix_output.to(dtype), suffix_output.to(dtype)
    return (weight_p * out_p + weight_s * out_s) / (weight_p + weight_s)


def tolerance(ref64: torch.Tensor, ref_lowp: torch.Tensor, dtype: torch.dtype) -> float:
    """docs/semantics.md, "Tolerance": 2 * the low-precision oracle's error plus the rounding
    noise of `dtype` (the 16-bit factor 2 for every dtype)."""
    rounded = ref64.to(dtype)
    floor = 2 * float(((rounded + 0.3) - 0.3).double().sub(rounded.double()).abs().max())
    return 2 * float((ref_lowp.double() - ref64).abs().max()) + floor


def run(
    output: torch.Tensor,
    problem: dict[str, torch.Tensor],
    dtype: torch.dtype,
    output_lse: torch.Tensor | None = None,
    lse_base_on_e: bool = True,
) -> None:
    """Merge the problem's two sides, given to the op in `dtype` (outputs) and float32 (LSEs)."""
    lse_factor = 1.0 if lse_base_on_e else LOG2_E
    merge_attn_states(
        output,
        problem["prefix_output"].to(dtype),
        (problem["prefix_lse"] * lse_factor).float(),
        problem["suffix_output"].to(dtype),
        (problem["suffix_lse"] * lse_factor).float(),
        output_lse=output_lse,
        lse_base_on_e=lse_base_on_e,
    )


# --- agreement with attention over all keys ----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lse_base_on_e", [True, False])
def test_matches_attention_over_union(dtype: torch.dtype, lse_base_on_e: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    problem = split_problem(num_tokens=33, num_heads=4, head_size=64, num_keys=97, gen=gen)
    output = torch.empty(33, 4, 64, dtype=dtype)
    output_lse = torch.empty(4, 33)

    run(output, problem, dtype, output_lse, lse_base_on_e)

    ref64 = problem["union_output"]
    ref_lowp = merge_in_dtype(
        problem["prefix_output"],
        problem["prefix_lse"],
        problem["suffix_output"],
        problem["suffix_lse"],
        dtype,
    )
    error = float((output.double() - ref64).abs().max())
    assert error <= tolerance(ref64, ref_lowp, dtype)
    expected_lse = problem["union_lse"] * (1.0 if lse_base_on_e else LOG2_E)
    torch.testing.assert_close(output_lse.double(), expected_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lse_base_on_e", [True, False])
def test_matches_ref(dtype: torch.dtype, lse_base_on_e: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    problem = split_problem(num_tokens=9, num_heads=3, head_size=16, num_keys=12, gen=gen)
    output, expected = torch.empty(9, 3, 16, dtype=dtype), torch.empty(9, 3, 16, dtype=dtype)
    output_lse, expected_lse = torch.empty(3, 9), torch.empty(3, 9)
    run(output, problem, dtype, output_lse, lse_base_on_e)
    lse_factor = 1.0 if lse_base_on_e else LOG2_E
    merge_attn_states_ref(
        expected,
        problem["prefix_output"].to(dtype),
        (problem["prefix_lse"] * lse_factor).float(),
        problem["suffix_output"].to(dtype),
        (problem["suffix_lse"] * lse_factor).float(),
        expected_lse,
        lse_base_on_e,
    )
    # Float32 against float64 arithmetic, then one rounding to dtype: at most one ulp apart.
    ulp = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(output, expected, atol=ulp, rtol=ulp)
    torch.testing.assert_close(output_lse, expected_lse, atol=1e-6, rtol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    num_tokens=st.integers(0, 12),
    num_heads=st.integers(1, 4),
    head_size=st.sampled_from([1, 8, 24]),
    num_keys=st.integers(0, 20),
    lse_base_on_e=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_union(
    num_tokens: int,
    num_heads: int,
    head_size: int,
    num_keys: int,
    lse_base_on_e: bool,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    problem = split_problem(num_tokens, num_heads, head_size, num_keys, gen)
    output = torch.empty(num_tokens, num_heads, head_size)
    output_lse = torch.empty(num_heads, num_tokens)
    run(output, problem, torch.float32, output_lse, lse_base_on_e)
    # With no keys at all every row is empty on both sides: zeros and -inf, as the oracle says.
    torch.testing.assert_close(output.double(), problem["union_output"], atol=1e-5, rtol=1e-5)
    expected_lse = problem["union_lse"] * (1.0 if lse_base_on_e else LOG2_E)
    torch.testing.assert_close(output_lse.double(), expected_lse, atol=1e-5, rtol=1e-6)


# --- empty sides -------------------------------------------------------------------------------


@pytest.mark.parametrize("empty_mark", [-math.inf, math.inf])
@pytest.mark.parametrize("lse_base_on_e", [True, False])
def test_empty_side_contributes_nothing(empty_mark: float, lse_base_on_e: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    prefix_output = torch.randn(4, 2, 8, generator=gen)
    suffix_output = torch.randn(4, 2, 8, generator=gen)
    prefix_lse = torch.randn(2, 4, generator=gen)
    suffix_lse = torch.randn(2, 4, generator=gen)
    # token 0: prefix empty; token 1: suffix empty; token 2: both empty; token 3: both present.
    prefix_lse[:, 0] = empty_mark
    suffix_lse[:, 1] = empty_mark
    prefix_lse[:, 2] = suffix_lse[:, 2] = empty_mark
    # An empty side's rows may hold anything (an impl can leave them unwritten).
    prefix_output[0] = prefix_output[2] = math.nan
    suffix_output[1] = suffix_output[2] = math.inf
    output = torch.full((4, 2, 8), 7.0)
    output_lse = torch.full((2, 4), 7.0)

    merge_attn_states(
        output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, lse_base_on_e
    )

    assert not output.isnan().any() and not output_lse.isnan().any()
    assert torch.equal(output[0], suffix_output[0])
    assert torch.equal(output_lse[:, 0], suffix_lse[:, 0])
    assert torch.equal(output[1], prefix_output[1])
    assert torch.equal(output_lse[:, 1], prefix_lse[:, 1])
    assert torch.equal(output[2], torch.zeros(2, 8))
    assert torch.equal(output_lse[:, 2], torch.full((2,), -math.inf))
    expected = torch.empty(4, 2, 8)
    merge_attn_states_ref(
        expected, prefix_output, prefix_lse, suffix_output, suffix_lse, None, lse_base_on_e
    )
    torch.testing.assert_close(output, expected, atol=1e-6, rtol=1e-6)


def test_both_sides_empty_everywhere() -> None:
    lse = torch.full((3, 5), -math.inf)
    output = torch.full((5, 3, 4), math.nan, dtype=torch.bfloat16)
    output_lse = torch.zeros(3, 5)
    garbage = torch.full((5, 3, 4), math.nan, dtype=torch.bfloat16)
    merge_attn_states(output, garbage, lse, garbage, lse.clone().fill_(math.inf), output_lse)
    assert torch.equal(output, torch.zeros_like(output))
    assert torch.equal(output_lse, lse)


def test_no_tokens() -> None:
    empty = torch.empty(0, 2, 8)
    lse = torch.empty(2, 0)
    merge_attn_states(empty, empty.clone(), lse, empty.clone(), lse.clone(), lse.clone())


# --- aliasing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["prefix", "suffix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_output_may_alias_an_input(alias: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    problem = split_problem(num_tokens=7, num_heads=2, head_size=16, num_keys=15, gen=gen)
    prefix_output = problem["prefix_output"].to(dtype)
    suffix_output = problem["suffix_output"].to(dtype)
    prefix_lse = problem["prefix_lse"].float()
    suffix_lse = problem["suffix_lse"].float()
    expected, expected_lse = torch.empty_like(prefix_output), torch.empty_like(prefix_lse)
    merge_attn_states(expected, prefix_output, prefix_lse, suffix_output, suffix_lse, expected_lse)

    output = prefix_output if alias == "prefix" else suffix_output
    output_lse = prefix_lse if alias == "prefix" else suffix_lse
    merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)

    assert torch.equal(output, expected)
    assert torch.equal(output_lse, expected_lse)


def test_output_dtype_may_differ_from_inputs() -> None:
    gen = torch.Generator().manual_seed(4)
    problem = split_problem(num_tokens=5, num_heads=2, head_size=8, num_keys=9, gen=gen)
    output32 = torch.empty(5, 2, 8)
    output16 = torch.empty(5, 2, 8, dtype=torch.bfloat16)
    run(output32, problem, torch.float32)
    run(output16, problem, torch.float32)
    assert torch.equal(output16, output32.bfloat16())


# --- rejected inputs ---------------------------------------------------------------------------


def valid_args() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {
        "output": torch.zeros(6, 4, 8, dtype=torch.float16),
        "prefix_output": torch.randn(6, 4, 8, generator=gen).half(),
        "prefix_lse": torch.randn(4, 6, generator=gen),
        "suffix_output": torch.randn(6, 4, 8, generator=gen).half(),
        "suffix_lse": torch.randn(4, 6, generator=gen),
        "output_lse": torch.zeros(4, 6),
    }


# (case id, changes to the valid arguments, error type, name in message)
BAD_INPUTS: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], type, str]] = [
    ("output not a tensor", lambda a: {"output": None}, TypeError, "output"),
    ("output rank 2", lambda a: {"output": a["output"][0]}, ValueError, "output"),
    ("prefix shape", lambda a: {"prefix_output": a["prefix_output"][:5]}, ValueError, "prefix"),
    (
        "suffix shape",
        lambda a: {"suffix_output": a["suffix_output"][..., :4]},
        ValueError,
        "suffix",
    ),
    ("output float64", lambda a: {"output": a["output"].double()}, TypeError, "output"),
    ("suffix dtype", lambda a: {"suffix_output": a["suffix_output"].float()}, TypeError, "suffix"),
    ("prefix_lse shape", lambda a: {"prefix_lse": a["prefix_lse"].t()}, ValueError, "prefix_lse"),
    ("suffix_lse 1-D", lambda a: {"suffix_lse": a["suffix_lse"][0]}, ValueError, "suffix_lse"),
    ("lse float16", lambda a: {"prefix_lse": a["prefix_lse"].half()}, TypeError, "prefix_lse"),
    ("output_lse shape", lambda a: {"output_lse": torch.zeros(4, 5)}, ValueError, "output_lse"),
    (
        "output_lse dtype",
        lambda a: {"output_lse": torch.zeros(4, 6).half()},
        TypeError,
        "output_lse",
    ),
    (
        "lse on another device",
        lambda a: {"suffix_lse": a["suffix_lse"].to("meta")},
        ValueError,
        "suffix_lse",
    ),
]


@pytest.mark.parametrize(
    ("change", "error", "name"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_rejects_bad_input_and_writes_nothing(
    change: Callable[[dict[str, Any]], dict[str, Any]], error: type, name: str
) -> None:
    args = valid_args()
    output, output_lse = args["output"], args["output_lse"]
    args |= change(args)
    with pytest.raises(error, match=rf"^merge_attn_states: .*\b{name}") as info:
        merge_attn_states(**args)
    assert "(got" in str(info.value)
    assert torch.equal(output, torch.zeros_like(output))
    assert torch.equal(output_lse, torch.zeros_like(output_lse))


def test_valid_args_are_valid() -> None:
    merge_attn_states(**valid_args())


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_union(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    problem = split_problem(num_tokens=65, num_heads=8, head_size=128, num_keys=200, gen=gen)
    problem = {name: x.cuda() for name, x in problem.items()}
    output = torch.empty(65, 8, 128, dtype=dtype, device="cuda")
    output_lse = torch.empty(8, 65, device="cuda")
    run(output, problem, dtype, output_lse)
    atol = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}[dtype]
    torch.testing.assert_close(
        output.double(), problem["union_output"], atol=atol, rtol=atol, check_device=False
    )
    torch.testing.assert_close(output_lse.double(), problem["union_lse"], atol=1e-5, rtol=1e-6)
