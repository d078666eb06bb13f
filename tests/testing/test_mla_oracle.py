"""The float64 MLA oracle against a hand-worked case, torch SDPA over explicitly up-projected
keys and values, and the absorbed form computed separately."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from anyattn.testing import mla_oracle, mla_up_project

E = math.e


def _draw(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 3,
    rank: int = 24,
    rope: int = 8,
    nope: int = 16,
    v_dim: int = 12,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    num_tokens, num_keys = sum(query_lens), sum(seq_lens)
    return dict(
        q_nope=randn(num_tokens, num_heads, nope),
        q_pe=randn(num_tokens, num_heads, rope),
        kv_c=randn(num_keys, rank),
        k_pe=randn(num_keys, rope),
        w_uk=randn(num_heads, nope, rank) / math.sqrt(rank),
        w_uv=randn(num_heads, v_dim, rank) / math.sqrt(rank),
    )


def _sdpa_up_projected(x: dict[str, torch.Tensor], query_lens, seq_lens, scale) -> torch.Tensor:
    """kv_b_proj as one Linear weight (per head: nope rows, then value rows), K/V built from
    it explicitly, then causal SDPA per request (bottom-right aligned)."""
    num_heads, nope, rank = x["w_uk"].shape
    v_dim = x["w_uv"].shape[1]
    kv_b_weight = torch.cat([x["w_uk"], x["w_uv"]], dim=1).reshape(-1, rank)
    kv = F.linear(x["kv_c"], kv_b_weight).view(-1, num_heads, nope + v_dim)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k = torch.cat([k_nope, x["k_pe"][:, None, :].expand(-1, num_heads, -1)], dim=-1)
    q = torch.cat([x["q_nope"], x["q_pe"]], dim=-1)
    outs, q0, k0 = [], 0, 0
    for q_len, s_len in zip(query_lens, seq_lens, strict=True):
        positions = torch.arange(q_len).view(-1, 1) + (s_len - q_len)
        mask = torch.arange(s_len).view(1, -1) <= positions
        o = F.scaled_dot_product_attention(
            q[q0 : q0 + q_len].transpose(0, 1),
            k[k0 : k0 + s_len].transpose(0, 1),
            v[k0 : k0 + s_len].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        outs.append(o.transpose(0, 1))
        q0, k0 = q0 + q_len, k0 + s_len
    return torch.cat(outs)


def test_one_head_two_tokens_by_hand() -> None:
    # Latents [1, 0] and [0, 1]; W_UK = I, W_UV = I: keys/values are the latents themselves.
    # q_nope = [1, 0] scores the first token 1 from the nope part; the rope part adds
    # q_pe . k_pe = [1] . [1] = 1 to the second: scores [1, 1] + nope [1, 0] = [2, 1].
    eye = torch.eye(2, dtype=torch.float64).view(1, 2, 2)
    out, lse = mla_oracle(
        q_nope=torch.tensor([[[1.0, 0.0]]], dtype=torch.float64),
        q_pe=torch.tensor([[[1.0]]], dtype=torch.float64),
        kv_c=torch.eye(2, dtype=torch.float64),
        k_pe=torch.tensor([[1.0], [1.0]], dtype=torch.float64),
        w_uk=eye,
        w_uv=eye,
        query_lens=[1],
        seq_lens=[2],
        scale=1.0,
    )
    expected = torch.tensor([E**2, E], dtype=torch.float64) / (E**2 + E)
    torch.testing.assert_close(out[0, 0], expected, rtol=0, atol=1e-15)
    assert lse.item() == pytest.approx(math.log(E**2 + E), abs=1e-15)


@pytest.mark.parametrize(
    "dims",
    [(24, 8, 16, 12), (24, 8, 16, 24), (20, 4, 8, 8)],
    ids=["v_dim<nope+rope", "v_dim=nope+rope", "small"],
)
def test_matches_sdpa_over_explicitly_up_projected_kv(dims: tuple[int, int, int, int]) -> None:
    rank, rope, nope, v_dim = dims
    query_lens, seq_lens = [1, 7, 5, 1, 9], [9, 7, 40, 1, 9]
    x = _draw(query_lens, seq_lens, rank=rank, rope=rope, nope=nope, v_dim=v_dim)
    scale = 1.25 / math.sqrt(nope + rope)
    out, lse = mla_oracle(**x, query_lens=query_lens, seq_lens=seq_lens, scale=scale)
    ref = _sdpa_up_projected(x, query_lens, seq_lens, scale)
    assert out.shape == (sum(query_lens), 3, v_dim) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert lse.shape == (3, sum(query_lens))


def test_equals_the_absorbed_form_in_float64() -> None:
    """q_nope . (W_UK c) == (W_UK^T q_nope) . c: the identity decode kernels rely on."""
    x = _draw([1, 1, 1], [5, 17, 1])
    q_lat = torch.einsum("thp,hpl->thl", x["q_nope"], x["w_uk"])
    outs, lses, k0 = [], [], 0
    for t, s_len in enumerate([5, 17, 1]):
        c, pe = x["kv_c"][k0 : k0 + s_len], x["k_pe"][k0 : k0 + s_len]
        scores = 0.2 * (q_lat[t] @ c.T + x["q_pe"][t] @ pe.T)  # [num_heads, s_len]
        probs = torch.softmax(scores, dim=-1)
        o_lat = probs @ c  # [num_heads, rank]
        outs.append(torch.einsum("hl,hvl->hv", o_lat, x["w_uv"]))
        lses.append(torch.logsumexp(scores, dim=-1))
        k0 += s_len
    out, lse = mla_oracle(**x, query_lens=[1, 1, 1], seq_lens=[5, 17, 1], scale=0.2)
    torch.testing.assert_close(out, torch.stack(outs), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.stack(lses, dim=1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_run_rounds_only_by_that_dtype(dtype: torch.dtype) -> None:
    x = {k: v.to(dtype) for k, v in _draw([3, 1], [8, 12], seed=1).items()}
    out, lse = mla_oracle(**x, query_lens=[3, 1], seq_lens=[8, 12], scale=0.3, compute_dtype=dtype)
    ref, ref_lse = mla_oracle(**x, query_lens=[3, 1], seq_lens=[8, 12], scale=0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32
    error = (out.double() - ref).abs().max().item()
    assert 0 < error < 50 * torch.finfo(dtype).eps
    lse_error = (lse.double() - ref_lse).abs().max().item()
    assert lse_error < 50 * torch.finfo(dtype).eps


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("w_uv", lambda t: t[:, :, :-1], r"w_uv must be \[3, v_head_dim, 24\]"),
        ("q_nope", lambda t: t[:, :, :-1], r"q_nope must be \[num_tokens, 3, 16\]"),
        ("q_pe", lambda t: t[:-1], r"q_pe must be \[4, 3, qk_rope_head_dim\]"),
        ("kv_c", lambda t: t[:, :-1], r"kv_c must be \[num_keys, 24\]"),
        ("k_pe", lambda t: t[:-1], r"k_pe must be \[20, 8\]"),
        ("w_uk", lambda t: t[0], r"w_uk must be \[num_heads, qk_nope_head_dim, kv_lora_rank\]"),
    ],
)
def test_rejects_shapes_that_do_not_fit(name, change, message) -> None:
    x = _draw([3, 1], [8, 12])
    x[name] = change(x[name])
    with pytest.raises(ValueError, match=message):
        mla_oracle(**x, query_lens=[3, 1], seq_lens=[8, 12], scale=1.0)


def test_rejects_lengths_that_do_not_match() -> None:
    x = _draw([3, 1], [8, 12])
    with pytest.raises(ValueError, match=r"sum\(seq_lens\)=19 for 20 latents"):
        mla_oracle(**x, query_lens=[3, 1], seq_lens=[8, 11], scale=1.0)


def test_up_projection_rejects_latents_of_another_rank() -> None:
    x = _draw([1], [4])
    with pytest.raises(ValueError, match=r"mla_up_project: kv_c must be \[num_keys, L\]"):
        mla_up_project(x["kv_c"][:, :-1], x["w_uk"], x["w_uv"])
    k_nope, v = mla_up_project(x["kv_c"], x["w_uk"], x["w_uv"])
    assert k_nope.shape == (4, 3, 16) and v.shape == (4, 3, 12)
    torch.testing.assert_close(k_nope[2, 1], x["w_uk"][1] @ x["kv_c"][2], rtol=1e-12, atol=1e-12)
