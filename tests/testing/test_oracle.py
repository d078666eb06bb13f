"""The float64 oracle against hand-worked tiny cases and against torch SDPA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from anyattn.testing import attention_oracle

E = math.e


def _tiny(**kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row at position 1 over two keys: scores (before modifiers) [1, 0].

    q = [1, 0]; k0 = [1, 0], k1 = [0, 0]; v0 = [1, 0], v1 = [0, 1]: the output is the
    probability vector itself.
    """
    query = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    key = torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]]], dtype=torch.float64)
    value = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
    kwargs.setdefault("scale", 1.0)
    return attention_oracle(query, key, value, [1], [2], **kwargs)


def test_two_keys_known_softmax() -> None:
    out, lse = _tiny()
    expected = torch.tensor([E / (E + 1), 1 / (E + 1)], dtype=torch.float64)
    torch.testing.assert_close(out[0, 0], expected, rtol=0, atol=1e-15)
    assert lse.shape == (1, 1)
    assert lse.item() == pytest.approx(math.log(E + 1), abs=1e-15)


def test_scale_multiplies_scores() -> None:
    out, _ = _tiny(scale=2.0)
    assert out[0, 0, 0].item() == pytest.approx(E**2 / (E**2 + 1), abs=1e-15)


def test_soft_cap() -> None:
    cap = 0.5
    s0 = cap * math.tanh(1.0 / cap)
    out, lse = _tiny(logits_soft_cap=cap)
    assert out[0, 0, 0].item() == pytest.approx(math.exp(s0) / (math.exp(s0) + 1), abs=1e-15)
    assert lse.item() == pytest.approx(math.log(math.exp(s0) + 1), abs=1e-15)


def test_soft_cap_zero_means_none() -> None:
    torch.testing.assert_close(_tiny(logits_soft_cap=0.0)[0], _tiny()[0], rtol=0, atol=0)


def test_alibi_adds_slope_times_distance() -> None:
    # Query at p = 1: key 0 gets slope * (0 - 1) = -0.5, key 1 gets 0.
    out, lse = _tiny(alibi_slopes=[0.5])
    s = [1.0 - 0.5, 0.0]
    denom = math.exp(s[0]) + math.exp(s[1])
    assert out[0, 0, 0].item() == pytest.approx(math.exp(s[0]) / denom, abs=1e-15)
    assert lse.item() == pytest.approx(math.log(denom), abs=1e-15)


def test_sliding_window_of_one_keeps_only_the_current_key() -> None:
    out, lse = _tiny(sliding_window=1)
    torch.testing.assert_close(out[0, 0], torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert lse.item() == pytest.approx(0.0, abs=1e-15)


def test_sliding_window_covers_w_keys() -> None:
    # 1 query at position 4 over 5 keys with unit scores: W = 3 keeps keys 2, 3, 4.
    query = torch.ones(1, 1, 1, dtype=torch.float64)
    key = torch.ones(5, 1, 1, dtype=torch.float64)
    value = torch.arange(5, dtype=torch.float64).view(5, 1, 1)
    out, lse = attention_oracle(query, key, value, [1], [5], scale=1.0, sliding_window=3)
    assert out.item() == pytest.approx(3.0, abs=1e-15)
    assert lse.item() == pytest.approx(1.0 + math.log(3), abs=1e-15)


def test_sink_enlarges_denominator_only_and_counts_in_lse() -> None:
    out, lse = _tiny(sinks=torch.tensor([0.0]))
    expected = torch.tensor([E / (E + 2), 1 / (E + 2)], dtype=torch.float64)
    torch.testing.assert_close(out[0, 0], expected, rtol=0, atol=1e-15)
    # The sink is a key with a zero value: lse is the log of the whole denominator.
    assert lse.item() == pytest.approx(math.log(E + 2), abs=1e-15)
    # Hence output == sum_j exp(s_j - lse) v_j, the identity merging relies on.
    scores = torch.tensor([1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(out[0, 0], torch.exp(scores - lse.item()), rtol=0, atol=1e-15)


@pytest.mark.parametrize("sinks", [None, torch.tensor([0.7])])
def test_row_without_keys_outputs_zeros(sinks: torch.Tensor | None) -> None:
    query = torch.randn(2, 1, 4, dtype=torch.float64)
    key = value = torch.zeros(0, 1, 4, dtype=torch.float64)
    out, lse = attention_oracle(query, key, value, [2], [0], scale=1.0, causal=False, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    expected = -math.inf if sinks is None else 0.7
    assert lse.flatten().tolist() == pytest.approx([expected, expected])


def test_fully_masked_rows_in_a_window_output_zeros() -> None:
    # Causal with more query rows than keys: the first rows sit at negative positions.
    query = torch.randn(3, 2, 4, dtype=torch.float64)
    key = value = torch.randn(1, 2, 4, dtype=torch.float64)
    out, lse = attention_oracle(query, key, value, [3], [1], scale=1.0)
    assert not torch.isnan(out).any()
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isinf(lse[:, :2]).all() and (lse[:, :2] < 0).all()
    torch.testing.assert_close(out[2], value[0])


def test_gqa_maps_query_head_to_kv_head_integer_division() -> None:
    # One key: every head's output is its KV head's value exactly.
    num_heads, num_kv_heads = 6, 2
    query = torch.randn(1, num_heads, 3, dtype=torch.float64)
    key = torch.randn(1, num_kv_heads, 3, dtype=torch.float64)
    value = torch.arange(num_kv_heads, dtype=torch.float64).view(1, num_kv_heads, 1).expand(1, 2, 3)
    out, _ = attention_oracle(query, key, value.contiguous(), [1], [1], scale=1.0)
    assert out[0, :, 0].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def _sdpa_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    causal: bool,
) -> torch.Tensor:
    outs = []
    q0 = k0 = 0
    for q_len, s_len in zip(query_lens, seq_lens, strict=True):
        q = query[q0 : q0 + q_len].transpose(0, 1)  # [H, q_len, D]
        k = key[k0 : k0 + s_len].transpose(0, 1)
        v = value[k0 : k0 + s_len].transpose(0, 1)
        mask = None
        if causal:
            # Bottom-right aligned: query i sits at position s_len - q_len + i.
            positions = torch.arange(q_len).view(-1, 1) + (s_len - q_len)
            mask = torch.arange(s_len).view(1, -1) <= positions
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        q0, k0 = q0 + q_len, k0 + s_len
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_matches_sdpa_in_float64(causal: bool, num_kv_heads: int) -> None:
    g = torch.Generator().manual_seed(0)
    query_lens, seq_lens = [1, 7, 5, 1], [9, 7, 40, 1]
    query = torch.randn(sum(query_lens), 4, 16, generator=g, dtype=torch.float64)
    key = torch.randn(sum(seq_lens), num_kv_heads, 16, generator=g, dtype=torch.float64)
    value = torch.randn(sum(seq_lens), num_kv_heads, 16, generator=g, dtype=torch.float64)
    out, lse = attention_oracle(query, key, value, query_lens, seq_lens, scale=0.3, causal=causal)
    ref = _sdpa_reference(query, key, value, query_lens, seq_lens, 0.3, causal)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert out.dtype == torch.float64 and lse.shape == (4, sum(query_lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_runs_in_a_low_precision_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    query = torch.randn(8, 2, 32, generator=g).to(dtype)
    key = torch.randn(20, 1, 32, generator=g).to(dtype)
    value = torch.randn(20, 1, 32, generator=g).to(dtype)
    kwargs = dict(scale=0.2, logits_soft_cap=5.0, alibi_slopes=[0.1, 0.05])
    out, lse = attention_oracle(query, key, value, [3, 5], [8, 12], compute_dtype=dtype, **kwargs)
    ref, ref_lse = attention_oracle(query, key, value, [3, 5], [8, 12], **kwargs)
    assert out.dtype == dtype
    assert lse.dtype == torch.float32  # like kernels: LSE at least float32
    error = (out.double() - ref).abs().max().item()
    assert 0 < error < 50 * torch.finfo(dtype).eps  # rounded, but only by that dtype's noise
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=50 * torch.finfo(dtype).eps)


def test_rejects_window_without_causal() -> None:
    with pytest.raises(ValueError, match="sliding window"):
        _tiny(causal=False, sliding_window=4)


def test_rejects_lengths_that_do_not_match() -> None:
    query = torch.zeros(2, 1, 4)
    key = value = torch.zeros(3, 1, 4)
    with pytest.raises(ValueError, match="lengths do not match"):
        attention_oracle(query, key, value, [1], [3], scale=1.0)
    two_heads = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attention_oracle(torch.zeros(1, 3, 4), two_heads, two_heads, [1], [3], scale=1.0)
