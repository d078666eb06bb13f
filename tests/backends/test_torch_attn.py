"""TORCH backend behaviour beyond the conformance kit: cascade counting, no host syncs in the
builder, spec-decode groups, and rejected calls that leave the cache unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anyattn.backends.torch_attn import (
    TorchAttentionBackend,
    TorchAttentionImpl,
    TorchAttentionMetadataBuilder,
)
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.layer import Attention
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing import layer_records

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 32, 16


def _builder(
    num_speculative_tokens: int = 0, names: tuple[str, ...] = ("layer.0",)
) -> TorchAttentionMetadataBuilder:
    spec = AttentionSpec(BLOCK, KV_HEADS, HEAD_SIZE, torch.float32)
    limits = BatchLimits(64, 4096, 2048, num_speculative_tokens=num_speculative_tokens)
    layers = layer_records(spec, names, num_heads=HEADS)
    return TorchAttentionMetadataBuilder(spec, layers, limits, "cpu")


def _filled_cache(num_blocks: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    cache = allocate_kv_cache(
        TorchAttentionBackend, num_blocks, BLOCK, KV_HEADS, HEAD_SIZE, torch.float32
    )
    cache.copy_(torch.randn(cache.shape, generator=gen))
    return cache


def _layer(layer_name: str = "layer.0", **kwargs) -> Attention:
    return Attention(
        HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS, backend=TorchAttentionBackend,
        layer_name=layer_name, **kwargs,
    )  # fmt: skip


def _shared_prefix_batch(num_reqs: int = 16, prefix: int = 512, seed: int = 0):
    """`num_reqs` requests whose first `prefix` tokens live in the same physical blocks."""
    gen = torch.Generator().manual_seed(seed)
    prefix_blocks = prefix // BLOCK
    query_lens = [1 + (r % 3) * 5 for r in range(num_reqs)]  # decodes and short prefills
    seq_lens = [prefix + 7 + r + q for r, q in enumerate(query_lens)]
    width = max(-(-s // BLOCK) for s in seq_lens)
    num_blocks = 1 + prefix_blocks + num_reqs * (width - prefix_blocks) + 8
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    table[:, :prefix_blocks] = ids[:prefix_blocks]
    own = ids[prefix_blocks:].tolist()
    for r, s in enumerate(seq_lens):
        n = -(-s // BLOCK) - prefix_blocks
        table[r, prefix_blocks : prefix_blocks + n] = torch.tensor(own[:n], dtype=torch.int32)
        own = own[n:]
    # decodes first, as the builder asks
    order = sorted(range(num_reqs), key=lambda r: query_lens[r] != 1)
    query_lens = [query_lens[r] for r in order]
    seq_lens = [seq_lens[r] for r in order]
    table = table[order]
    return query_lens, seq_lens, table, num_blocks


def test_cascade_runs_the_prefix_once_per_layer_and_matches_the_plain_path(monkeypatch):
    query_lens, seq_lens, table, num_blocks = _shared_prefix_batch()
    cm = make_common_attn_metadata(query_lens, seq_lens, table, BLOCK)
    builder = _builder(names=("layer.0", "layer.1", "layer.2"))
    plain_md = builder.build(0, cm)
    cascade_md = builder.build(512, cm)
    calls = []
    original = TorchAttentionImpl._cascade_prefix

    def counting(self, run):
        calls.append(self)
        return original(self, run)

    monkeypatch.setattr(TorchAttentionImpl, "_cascade_prefix", counting)
    gen = torch.Generator().manual_seed(1)
    num_tokens = sum(query_lens)
    layers = [_layer(layer_name=f"layer.{i}") for i in range(3)]
    for layer in layers:
        cache = _filled_cache(num_blocks, seed=id(layer) % 1000)
        q = torch.randn(num_tokens, HEADS, HEAD_SIZE, generator=gen)
        k = torch.randn(num_tokens, KV_HEADS, HEAD_SIZE, generator=gen)
        v = torch.randn(num_tokens, KV_HEADS, HEAD_SIZE, generator=gen)
        expected = layer(q, k, v, cache, plain_md)
        got = layer(q, k, v, cache, cascade_md)
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
    assert len(calls) == len(layers)
    assert [id(c) for c in calls] == [id(layer.impl) for layer in layers]


def test_use_cascade_attention_heuristic():
    import numpy as np

    builder = _builder()
    lens = np.ones(16, dtype=np.int32)
    args = dict(num_query_heads=HEADS, num_kv_heads=KV_HEADS, num_sms=0)
    assert builder.use_cascade_attention(512, lens, use_alibi=False, use_sliding_window=False,
                                         **args)  # fmt: skip
    assert not builder.use_cascade_attention(128, lens, use_alibi=False,
                                             use_sliding_window=False, **args)  # fmt: skip
    assert not builder.use_cascade_attention(512, lens, use_alibi=True,
                                             use_sliding_window=False, **args)  # fmt: skip
    assert not builder.use_cascade_attention(512, lens[:4], use_alibi=False,
                                             use_sliding_window=False, **args)  # fmt: skip


@pytest.mark.parametrize("bad_prefix", [8, 1024])
def test_cascade_prefix_must_be_block_aligned_and_inside_every_context(bad_prefix):
    query_lens, seq_lens, table, _ = _shared_prefix_batch(num_reqs=4, prefix=512)
    cm = make_common_attn_metadata(query_lens, seq_lens, table, BLOCK)
    with pytest.raises(ValueError, match="common_prefix_len"):
        _builder().build(bad_prefix, cm)


def test_builder_reads_only_cpu_mirrors():
    """Device tensors on the meta device hold no values: any read of them would raise."""
    gen = torch.Generator().manual_seed(0)
    query_lens, seq_lens = [1, 1, 9, 4], [20, 33, 9, 40]
    table = (torch.randperm(30, generator=gen)[:12] + 1).view(4, 3).int()
    cm = make_common_attn_metadata(query_lens, seq_lens, table, BLOCK, device="meta")
    md = _builder().build(0, cm)
    assert md.num_decodes == 2 and [s.q_len for s in md.segments] == [9, 4]
    md = _builder().build(0, make_common_attn_metadata(
        [1, 1], [40, 33], table[:2], BLOCK, device="meta"
    ))  # fmt: skip
    assert md.decode_block_ids.shape[1] == 3


def test_spec_decode_group_matches_running_requests_one_by_one():
    """With 2 draft tokens, requests of 3 query tokens join the batched decode group."""
    builder = _builder(num_speculative_tokens=2)
    assert builder.reorder_batch_threshold == 3
    gen = torch.Generator().manual_seed(3)
    query_lens, seq_lens = [3, 1, 2, 3, 12], [50, 17, 64, 3, 40]
    table = (torch.randperm(60, generator=gen)[:20] + 1).view(5, 4).int()
    cache = _filled_cache(64)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, HEADS, HEAD_SIZE, generator=gen)
    layer = _layer()
    md = builder.build(0, make_common_attn_metadata(query_lens, seq_lens, table, BLOCK))
    assert md.num_decodes == 4 and md.decode_token_ids.shape[1] == 3
    got = layer(q, None, None, cache, md)
    one_by_one = _builder()  # threshold 1: every multi-token request is a segment
    start = 0
    for r, n in enumerate(query_lens):
        cm = make_common_attn_metadata([n], [seq_lens[r]], table[r : r + 1], BLOCK)
        alone = layer(q[start : start + n], None, None, cache, one_by_one.build(0, cm))
        torch.testing.assert_close(got[start : start + n], alone, atol=2e-6, rtol=2e-6)
        start += n


def _bad_call_inputs():
    gen = torch.Generator().manual_seed(5)
    query_lens, seq_lens = [1, 5], [9, 5]
    table = torch.tensor([[3, 0], [7, 0]], dtype=torch.int32)
    cm = make_common_attn_metadata(query_lens, seq_lens, table, BLOCK)
    q = torch.randn(6, HEADS, HEAD_SIZE, generator=gen)
    k = torch.randn(6, KV_HEADS, HEAD_SIZE, generator=gen)
    return cm, q, k, k.clone()


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("query_heads", ValueError, "query must be"),
        ("key_tokens", ValueError, "key and query differ"),
        ("key_dtype", ValueError, "key dtype"),
        ("cache_dtype", ValueError, "kv_cache dtype"),
        ("slot_beyond_cache", ValueError, "slot"),
        ("lse_shape", ValueError, "output_lse"),
    ],
)
def test_rejected_call_leaves_the_cache_unchanged(case, error, match):
    cm, q, k, v = _bad_call_inputs()
    cache = _filled_cache(10)
    lse = None
    if case == "query_heads":
        q = q[:, :2]
    elif case == "key_tokens":
        k, v = k[:5], v[:5]
    elif case == "key_dtype":
        k, v = k.double(), v.double()
    elif case == "cache_dtype":
        cache = cache.half()
    elif case == "slot_beyond_cache":
        cm.slot_mapping[0] = 10 * BLOCK
    elif case == "lse_shape":
        lse = torch.empty(HEADS + 1, 6)
    md = _builder().build(0, cm)
    before = cache.clone()
    with pytest.raises(error, match=match):
        _layer()(q, k, v, cache, md, output_lse=lse)
    assert torch.equal(cache, before)


def test_block_table_too_narrow_is_rejected_by_the_builder():
    cm = make_common_attn_metadata([1], [9], torch.tensor([[3]], dtype=torch.int32), 16)
    lens = torch.tensor([40], dtype=torch.int32)  # more keys than the table's one column holds
    cm = dataclasses.replace(
        cm, seq_lens=lens, seq_lens_cpu=lens, num_computed_tokens_cpu=lens - 1, max_seq_len=40
    )
    with pytest.raises(ValueError, match="block_table too narrow"):
        _builder().build(0, cm)


def test_forward_refuses_a_layer_the_builder_was_not_given():
    cm, q, k, v = _bad_call_inputs()
    md = _builder(names=("layer.0", "layer.1")).build(0, cm)
    assert md.layer_names == frozenset({"layer.0", "layer.1"})
    cache = _filled_cache(10)
    before = cache.clone()
    stranger = _layer("layer.9")
    with pytest.raises(ValueError) as raised:
        stranger.impl.forward(stranger, q, k, v, cache, md, torch.empty_like(q))
    assert str(raised.value).startswith(
        "TORCH forward: layer 'layer.9' is not one of the layers the metadata builder was made "
        "for (got 'layer.9', expected one of ['layer.0', 'layer.1'])."
    )
    assert torch.equal(cache, before)
    # Through the layer the call is refused before its K/V are written.
    with pytest.raises(ValueError, match=r"TorchAttentionImpl.forward: layer 'layer\.9' is not"):
        stranger(q, k, v, cache, md)
    assert torch.equal(cache, before)


def test_metadata_is_frozen_and_forward_adds_nothing_to_it():
    query_lens, seq_lens, table, num_blocks = _shared_prefix_batch(num_reqs=4, prefix=64)
    md = _builder().build(0, make_common_attn_metadata(query_lens, seq_lens, table, BLOCK))
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.causal = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.segments[0].k_len = 0
    before = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(query_lens), HEADS, HEAD_SIZE, generator=gen)
    _layer()(q, None, None, _filled_cache(num_blocks), md)
    assert not hasattr(md, "__dict__") or not set(vars(md)) - set(before)
    assert all(getattr(md, name) is value for name, value in before.items())


@pytest.mark.parametrize("seq_lens", [[1, 17, 40, 33], [20, 20]])
def test_plain_decode_steps_take_one_gather_and_match_a_float64_reference(monkeypatch, seq_lens):
    """Single-token decodes on a layer without score modifiers go to `plain_decode_attention`
    (one gather, one SDPA, the lengths as an additive mask) and agree with float64 attention
    over the same cache rows."""
    from anyattn.backends import torch_attn

    calls = []
    plain = torch_attn.plain_decode_attention
    monkeypatch.setattr(
        torch_attn, "plain_decode_attention", lambda *args: calls.append(1) or plain(*args)
    )
    gen = torch.Generator().manual_seed(4)
    num_reqs = len(seq_lens)
    table = (torch.randperm(40, generator=gen)[: num_reqs * 3] + 1).view(num_reqs, 3).int()
    cache = _filled_cache(64)
    q = torch.randn(num_reqs, HEADS, HEAD_SIZE, generator=gen)
    md = _builder().build(0, make_common_attn_metadata([1] * num_reqs, seq_lens, table, BLOCK))
    got = _layer()(q, None, None, cache, md)
    assert calls == [1]
    group = HEADS // KV_HEADS
    for r, length in enumerate(seq_lens):
        pos = torch.arange(length)
        rows = cache[table[r, pos // BLOCK].long(), :, pos % BLOCK].double()  # [L, 2, KVH, D]
        k, v = rows[:, 0].repeat_interleave(group, 1), rows[:, 1].repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[r].double(), k) * HEAD_SIZE**-0.5
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(got[r].double(), ref, atol=2e-6, rtol=2e-6)
