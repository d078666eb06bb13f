"""What TORCH_MLA reads: a decode row reads only its own request's blocks and keys (block-table
entries past them and unwritten rows may hold anything), and the bounded work split (decode
rows in groups, queries in tiles) gives the result of one pass, against the float64 reference
of mla_case.py."""

from __future__ import annotations

import math

import pytest
import torch
from mla_case import (
    HIDDEN,
    LIMITS,
    SIZES,
    STEP1,
    STEP2,
    Schedule,
    bound,
    make_layer,
    reference,
    rope,
)

from anyattn.backends import torch_mla
from anyattn.metadata import make_common_attn_metadata

L, R = SIZES["kv_lora_rank"], SIZES["qk_rope_head_dim"]


def test_decode_reads_only_its_own_blocks_and_keys():
    """A long and a short request decode together; the short one's spare table entries are
    out of the cache, and every row not written (the null block, the tails of blocks) is NaN."""
    block_size, dtype = 4, torch.float32
    layer = make_layer(dtype, block_size=block_size)
    builder = layer.backend.get_builder_cls()(
        layer.kv_cache_spec(), {layer.layer_name: layer.impl.layer_params()}, LIMITS, "cpu"
    )
    cache = torch.full((9, block_size, L + R), math.nan, dtype=dtype)
    table = torch.tensor([[5, 2, 7, 3], [6, 999, 999, 999]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    hidden = [torch.randn(13, HIDDEN, generator=gen), torch.randn(3, HIDDEN, generator=gen)]
    # Step 1: both requests prefill all but their last token; step 2 decodes both.
    for query_lens, seq_lens in (([12, 2], [12, 2]), ([1, 1], [13, 3])):
        md = builder.build(0, make_common_attn_metadata(query_lens, seq_lens, table, block_size))
        rows = [x[s - q : s] for x, q, s in zip(hidden, query_lens, seq_lens, strict=True)]
        lens = zip(query_lens, seq_lens, strict=True)
        positions = torch.cat([torch.arange(s - q, s) for q, s in lens])
        out = layer(torch.cat(rows), rope(positions), cache, md)
    assert md.num_decode_tokens == 2
    for request, x in enumerate(hidden):
        ref64 = reference(layer, x, torch.float64)[-1:]
        ref32 = reference(layer, x, dtype)[-1:]
        err = (out[request : request + 1].double() - ref64).abs().max().item()
        assert err <= bound(ref64, ref32, dtype), (request, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bounded_work_split_gives_the_one_pass_result(monkeypatch, dtype):
    """With a tiny work bound every decode row is its own group and every query its own tile;
    the outputs match the unbounded run's and the reference's."""
    outputs = {}
    for budget in (torch_mla.MAX_WORK_ELEMENTS, 1):
        monkeypatch.setattr(torch_mla, "MAX_WORK_ELEMENTS", budget)
        layer = make_layer(dtype)
        schedule = Schedule(layer, dtype)
        outputs[budget] = [schedule.run(STEP1)[1], schedule.run(STEP2)[1]]
    default, tiny = outputs.values()
    for step_default, step_tiny in zip(default, tiny, strict=True):
        for request, rows in step_default.items():
            # The same sums, grouped differently: equal up to a few roundings of `dtype` at
            # the output's magnitude.
            atol = 16 * torch.finfo(dtype).eps * rows.float().abs().max().item()
            torch.testing.assert_close(step_tiny[request].float(), rows.float(), rtol=0,
                                       atol=atol)  # fmt: skip
    # And the tiled run matches the float64 reference of each request's whole sequence.
    for request, rows in tiny[1].items():
        seq = schedule.done[request]
        x = schedule.hidden[request][:seq]
        start = seq - STEP2[request]
        ref64 = reference(layer, x, torch.float64)[start:]
        ref_lowp = reference(layer, x, dtype)[start:]
        err = (rows.double() - ref64).abs().max().item()
        assert err <= bound(ref64, ref_lowp, dtype), (request, err)


def test_decode_groups_stay_within_the_key_bound():
    assert list(torch_mla._groups([3, 9, 2, 2, 30], max_keys=20)) == [(0, 2), (2, 4), (4, 5)]
    assert list(torch_mla._groups([], max_keys=20)) == []


def test_the_layer_hands_over_the_documented_strides():
    """docs/mla.md, "Strides": q_latent, q_pe, q and the outputs contiguous; kv_c_normed
    contiguous rows; k_pe a view with unit stride in its last dimension."""
    layer = make_layer(torch.float32)
    impl, seen = layer.impl, {}

    def recorder(name, method):
        def record(*args):
            seen[name] = [a.stride() for a in args if isinstance(a, torch.Tensor)]
            seen[name + ".contiguous"] = [
                a.is_contiguous() for a in args if isinstance(a, torch.Tensor)
            ]
            return method(*args)

        return record

    for name in ("forward_mqa", "forward_mha", "do_kv_cache_update"):
        setattr(impl, name, recorder(name, getattr(impl, name)))
    schedule = Schedule(layer, torch.float32)
    md = schedule.metadata(STEP1)  # a decode and prefills
    assert md.num_decode_tokens and md.num_prefill_tokens
    hidden = torch.randn(md.num_actual_tokens, HIDDEN)
    # A rope that returns its inputs: k_pe stays a view of the latent projection.
    layer(hidden, lambda q_pe, k_pe: (q_pe, k_pe), schedule.kv_cache, md)
    # forward_mqa(q_latent, q_pe, kv_cache, output): all contiguous.
    assert seen["forward_mqa.contiguous"] == [True] * 4
    # forward_mha(q, kv_c_normed, k_pe, kv_cache, output): k_pe a column slice of [T, L + R].
    assert seen["forward_mha.contiguous"] == [True, True, False, True, True]
    assert seen["forward_mha"][2] == (L + R, 1)
    assert seen["do_kv_cache_update"][1] == (L + R, 1)
