"""TORCH_MLA against a float64 MLA reference written from the definitions (mla_case.py):
decodes, fresh prefills and chunked prefills over shuffled blocks, the context read in three
chunks, with bf16 / fp16 / fp32 and fp8 latent caches."""

from __future__ import annotations

import pytest
import torch
from mla_case import (
    HEADS,
    LIMITS,
    SCALE,
    SIZES,
    STEP1,
    STEP2,
    Schedule,
    bound,
    make_layer,
    reference,
)

from anyattn.backends.torch_mla import TorchMLAImpl, TorchMLAMetadataBuilder
from anyattn.config import MLAAttentionSpec
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.ops.concat_and_cache_mla import concat_and_cache_mla, concat_and_cache_mla_ref
from anyattn.testing.blocks import assign_blocks

L, R, P, VD = (SIZES[k] for k in SIZES)


@pytest.mark.parametrize(
    ("dtype", "q_lora_rank"), [(torch.float32, None), (torch.bfloat16, 24), (torch.float16, None)]
)
def test_layer_two_steps_match_reference(dtype, q_lora_rank):
    layer = make_layer(dtype, q_lora_rank=q_lora_rank)
    schedule = Schedule(layer, dtype)
    md1, out1 = schedule.run(STEP1)
    assert (md1.num_decodes, md1.num_prefills, md1.prefill.chunks) == (1, 3, ())
    md2, out2 = schedule.run(STEP2)
    assert (md2.num_decodes, md2.num_decode_tokens, md2.num_prefills) == (2, 2, 3)
    chunks = md2.prefill.chunks
    assert [c.num_tokens for c in chunks] == [8, 8, 6]  # contexts 13 + 9 in a workspace of 8
    assert [(p.request, p.context_start, p.row_len) for c in chunks for p in c.pieces] == [
        (0, 0, 8), (0, 8, 5), (1, 0, 3), (1, 3, 6)
    ]  # fmt: skip
    for step, outputs in ((STEP1, out1), (STEP2, out2)):
        for request, rows in outputs.items():
            seq = schedule.done[request] if step is STEP2 else STEP1[request]
            start = seq - step[request]
            x = schedule.hidden[request][:seq]
            ref64 = reference(layer, x, torch.float64)[start:]
            ref_lowp = reference(layer, x, dtype)[start:]
            err = (rows.double() - ref64).abs().max().item()
            assert err <= bound(ref64, ref_lowp, dtype), (request, err)


class _Layer:
    """What the impl reads of a layer: its name, fp8 scale and up-projection."""

    def __init__(self, kv_b: torch.Tensor, k_scale: float) -> None:
        self.layer_name = "mla"
        self.kv_b = kv_b  # [H, P + Vd, L]
        self.k_scale = torch.tensor(k_scale)
        self.v_scale = torch.tensor(1.0)

    def up_project(self, c_kv: torch.Tensor):
        kv = torch.einsum("nl,hdl->nhd", c_kv, self.kv_b.to(c_kv.dtype))
        return kv.split([P, VD], dim=-1)


def _attend64(q, k, v, causal):
    """float64 attention `q [M, H, D]`, `k [N, H, D]`, `v [N, H, Dv]` -> out, lse `[M, H]`."""
    scores = torch.einsum("mhd,nhd->mhn", q, k) * SCALE
    if causal:
        future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future[:, None], float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.einsum("mhn,nhv->mhv", (scores - lse[..., None]).exp(), v), lse


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [(torch.float32, "fp8_e4m3"), (torch.bfloat16, "fp8_e5m2"), (torch.float32, "float16")],
)
def test_impl_entry_points_over_a_converted_cache(dtype, kv_cache_dtype):
    """forward_mqa (with LSE) and forward_mha straight on the impl, the cache in another
    dtype: cached rows are compared dequantised as the impl reads them (`x.float() * scale`,
    for the up-projection then cast to the model dtype); new prefill rows come from the
    inputs."""
    gen = torch.Generator().manual_seed(3)
    block_size, workspace = 4, 8
    query_lens, context = [1, 1, 6, 4], [5, 0, 11, 7]  # 2 decodes, 2 chunked prefills
    seq_lens = [q + c for q, c in zip(query_lens, context, strict=True)]
    table, num_blocks = assign_blocks(seq_lens, block_size, generator=gen)
    impl = TorchMLAImpl(HEADS, SCALE, **SIZES, kv_cache_dtype=kv_cache_dtype,
                        workspace_tokens=workspace)  # fmt: skip
    layer = _Layer(torch.randn(HEADS, P + VD, L, generator=gen) / L**0.5, k_scale=0.05)
    spec = MLAAttentionSpec(block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                            **SIZES)  # fmt: skip
    builder = TorchMLAMetadataBuilder(spec, {"mla": impl.layer_params()}, LIMITS, "cpu")
    cache = allocate_kv_cache(TorchMLAImpl.backend, num_blocks, block_size, 1, L + R, dtype,
                              kv_cache_dtype)  # fmt: skip
    scale = layer.k_scale if kv_cache_dtype.startswith("fp8") else None

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    # The cached context, written by the op; then the step's rows, by the impl. `expected`
    # gets the same rows from the one-token-at-a-time reference write: the references below
    # read it, so a wrong write cannot cancel out.
    expected = cache.clone()
    ctx_md = builder.build(0, make_common_attn_metadata(context, context, table, block_size))
    ctx_rows = sum(context)
    ctx_latents = (randn(ctx_rows, L), randn(ctx_rows, R))
    concat_and_cache_mla(*ctx_latents, cache, ctx_md.slot_mapping, kv_cache_dtype, scale)
    concat_and_cache_mla_ref(*ctx_latents, expected, ctx_md.slot_mapping, kv_cache_dtype, scale)
    md = builder.build(0, make_common_attn_metadata(query_lens, seq_lens, table, block_size))
    assert len(md.prefill.chunks) == 3  # contexts 11 + 7 in a workspace of 8
    n, dec = md.num_actual_tokens, md.num_decode_tokens
    kv_c, k_pe = randn(n, L), randn(n, R)
    impl.do_kv_cache_update(layer, kv_c, k_pe, cache, md.slot_mapping, md)
    concat_and_cache_mla_ref(kv_c, k_pe, expected, md.slot_mapping, kv_cache_dtype, scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    q_latent, q_pe, q = randn(dec, HEADS, L), randn(dec, HEADS, R), randn(n - dec, HEADS, P + R)
    out_mqa, lse = torch.empty_like(q_latent), torch.full((HEADS, dec + 2), 7.0)
    impl.forward_mqa(layer, q_latent, q_pe, cache, md, out_mqa, lse)
    out_mha = torch.empty(n - dec, HEADS, VD, dtype=dtype)
    impl.forward_mha(layer, q, kv_c[dec:], k_pe[dec:], cache, md, out_mha)
    assert (lse[:, dec:] == 7.0).all()  # columns past the decode rows untouched

    def cached(r, upto, model_dtype):
        """Request r's first `upto` rows of the expected cache, dequantised: [upto, L + R]."""
        pos = torch.arange(upto)
        rows = expected[table[r, pos // block_size].long(), pos % block_size].float()
        rows = rows * layer.k_scale if scale is not None else rows
        return rows.to(model_dtype).double()

    kv_b = layer.kv_b.double()
    for t in range(dec):  # decode t is request t: keys are its whole cache, values the latents
        keys = cached(t, seq_lens[t], torch.float32)[:, None]  # [S, 1, L + R]
        q64 = torch.cat([q_latent[t], q_pe[t]], -1).double()[None]
        ref, ref_lse = _attend64(q64, keys, keys[..., :L], causal=False)
        torch.testing.assert_close(out_mqa[t].double(), ref[0], atol=_atol(dtype), rtol=0)
        torch.testing.assert_close(lse[:, t].double(), ref_lse[0], atol=1e-5, rtol=1e-5)
    start = 0
    for r in range(2, 4):  # prefills: context from the cache, new rows from the inputs
        rows = slice(start, start + query_lens[r])
        ctx = cached(r, context[r], dtype)
        new_c, new_pe = kv_c[dec:][rows].double(), k_pe[dec:][rows].double()
        latent = torch.cat([torch.cat([ctx[:, :L], new_c]), torch.cat([ctx[:, L:], new_pe])], -1)
        k_nope, v = torch.einsum("nl,hdl->nhd", latent[:, :L], kv_b).split([P, VD], -1)
        keys = torch.cat([k_nope, latent[:, None, L:].expand(-1, HEADS, -1)], -1)
        q64 = torch.cat([torch.zeros(context[r], HEADS, P + R, dtype=torch.float64),
                         q[rows].double()])  # fmt: skip
        ref, _ = _attend64(q64, keys, v, causal=True)
        torch.testing.assert_close(out_mha[rows].double(), ref[context[r] :], atol=_atol(dtype),
                                   rtol=0)  # fmt: skip
        start += query_lens[r]


def _atol(dtype: torch.dtype) -> float:
    # docs/semantics.md's starting tolerances for fp32 / bf16 outputs (values of magnitude ~1).
    return {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}[dtype]
