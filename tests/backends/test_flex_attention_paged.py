"""FLEX_ATTENTION's paged decode (`flex_attention_paged`): the views of the cache and the
BlockMask exactly on the CPU (the kernel itself runs on CUDA only: marked `gpu`), which
layers and caches take it, and that a decode step read in place copies no key.

FlexAttention evaluates a mask_mod only inside the blocks a BlockMask lists, and this plan
relies on that (its mask_mod alone would keep other requests' blocks), so the CPU checks
evaluate the plan the same way: the listed blocks, then the mask_mod within them, against
keys read straight out of the cache by block table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from anyattn.backends import flex_attention
from anyattn.backends import flex_attention_plan as plan
from anyattn.backends.flex_attention import (
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadataBuilder,
)
from anyattn.backends.flex_attention_masks import FROM_KV_BLOCKS_TAKES_COMPUTE_Q
from anyattn.backends.flex_attention_paged import (
    PagedDecodePlan,
    make_paged_decode_plan,
    paged_kv_views,
)
from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing import Case, KitLayer, get_spec, layer_records, run_case
from anyattn.types import KVCacheLayout

needs_compute_q = pytest.mark.skipif(
    not FROM_KV_BLOCKS_TAKES_COMPUTE_Q,
    reason="this torch's BlockMask.from_kv_blocks has no compute_q_blocks",
)


def test_paged_batch_buckets_are_few_and_tight():
    buckets = {plan.pad_paged_batch(n) for n in range(1, 257)}
    assert len(buckets) == 18
    for n in range(0, 2049):
        padded = plan.pad_paged_batch(n)
        assert padded >= max(n, 1)
        assert padded <= 32 or padded <= 1.25 * n
        # a bucket is its own bucket (padding never pads again)
        assert plan.pad_paged_batch(padded) == padded


@settings(max_examples=150, deadline=None)
@given(
    key_lens=st.lists(st.integers(0, 300), min_size=0, max_size=12),
    block_size=st.sampled_from([16, 32, 64]),
    window=st.one_of(st.none(), st.integers(1, 200)),
    padding=st.integers(0, 5),
)
def test_paged_decode_lists_exactly(key_lens, block_size, window, padding):
    lens = np.array(key_lens, dtype=np.int32)
    n = lens.shape[0]
    out = tuple(np.full(n + padding, 99, np.int32) for _ in range(5))
    num_blocks, first_col, first_off, last_col, last_len = plan.paged_decode_lists(
        lens, block_size, window, out=out
    )
    for b, length in enumerate(key_lens):
        # the kept keys, brute force: positions lo ... length - 1
        kept = [j for j in range(length) if window is None or j > length - 1 - window]
        if not kept:
            assert num_blocks[b] == 0
            continue
        blocks = sorted({j // block_size for j in kept})
        assert (first_col[b], last_col[b]) == (blocks[0], blocks[-1])
        assert num_blocks[b] == len(blocks) == blocks[-1] - blocks[0] + 1
        assert first_off[b] == kept[0] % block_size
        assert last_len[b] == kept[-1] % block_size + 1
    for array in out:
        assert (array[n:] == 0).all()


@pytest.mark.parametrize("sliced", [False, True], ids=["alone", "sliced"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_views_read_every_cached_token(layout, block_size, sliced):
    """Alone (`allocate_kv_cache`) or sliced out of a larger buffer (a nonzero storage
    offset, as an engine allocating every layer at once would have)."""
    num_blocks, kv_heads, size = 7, 3, 16
    if sliced:
        inner = (block_size, kv_heads) if layout == "NHD" else (kv_heads, block_size)
        buffer = torch.randn(3, num_blocks, 2, *inner, size)
        cache = buffer[1] if layout == "NHD" else buffer[1].transpose(2, 3)
    else:
        cache = allocate_kv_cache(
            FlexAttentionBackend, num_blocks, block_size, kv_heads, size, torch.float32,
            layout=layout,
        )  # fmt: skip
        cache.copy_(torch.randn(cache.shape))
    paged = paged_kv_views(cache)
    m = paged.blocks_per_cache_block
    assert m == (2 if layout == "NHD" else 2 * kv_heads)
    assert paged.key.shape == (1, kv_heads, ((num_blocks - 1) * m + 1) * block_size, size)
    for p in range(num_blocks):
        rows = slice(m * p * block_size, (m * p + 1) * block_size)
        # key[0, h, row] is token (row % block_size) of cache block p, head h
        assert torch.equal(paged.key[0, :, rows], cache[p, 0].transpose(0, 1))
        assert torch.equal(paged.value[0, :, rows], cache[p, 1].transpose(0, 1))
    # the views stay inside the cache
    last = paged.value[0, -1, -1, -1].data_ptr() - cache.data_ptr()
    assert last == (cache.numel() - 1) * cache.element_size()


def test_caches_the_kernel_cannot_read_in_place_have_no_views():
    backend = FlexAttentionBackend
    # block sizes the decoding kernel cannot tile: under its 16-key tile, or no power of two
    # (its template fails to compile blocks of 48 or 96)
    for block_size in (8, 48, 96):
        assert (
            paged_kv_views(allocate_kv_cache(backend, 4, block_size, 2, 16, torch.float32)) is None
        )
    # K and V planes apart ((2, blocks, ...) in memory) are rows evenly spaced: fine
    planes = torch.zeros(2, 4, 16, 2, 16).permute(1, 0, 2, 3, 4)
    assert paged_kv_views(planes).blocks_per_cache_block == 1
    # head size not innermost
    assert paged_kv_views(torch.zeros(4, 2, 16, 16, 2).transpose(3, 4)) is None
    # every block the same memory (an expanded tensor)
    assert paged_kv_views(torch.zeros(1, 2, 16, 2, 16).expand(4, -1, -1, -1, -1)) is None


def _sparse_attention(block_mask, key, value, query, block_size, scale):
    """FlexAttention's semantics over a block-sparse mask, evaluated in float64: entry b
    attends to the keys of its listed blocks that the mask_mod keeps there."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b in range(query.shape[0]):
        rows = [
            kv
            for j in range(int(block_mask.kv_num_blocks[b, 0, 0]))
            for block in [int(block_mask.kv_indices[b, 0, 0, j])]
            for kv in range(block * block_size, (block + 1) * block_size)
            if bool(block_mask.mask_mod(torch.tensor(b), 0, 0, torch.tensor(kv)))
        ]
        if rows:
            k, v = (x[0][:, rows].double() for x in (key, value))
            scores = torch.einsum("hgd,hkd->hgk", query[b].double(), k) * scale
            out[b] = torch.einsum("hgk,hkd->hgd", scores.softmax(-1), v)
    return out


@needs_compute_q
@pytest.mark.parametrize("window", [None, 1, 20, 40])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_plan_keeps_exactly_each_requests_keys(layout, block_size, window):
    """Lengths at, below and above block boundaries, shuffled blocks, a block table wider than
    any request needs, batch padding, windows within a block and across blocks: each entry
    attends to its own kept keys alone."""
    gen = torch.Generator().manual_seed(3)
    kv_heads, group, size = 2, 4, 16
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 5]
    width, num_blocks = 5, 40
    cache = allocate_kv_cache(
        FlexAttentionBackend, num_blocks, block_size, kv_heads, size, torch.float32, layout=layout
    )
    cache.copy_(torch.randn(cache.shape, generator=gen))
    ids = torch.randperm(num_blocks - 1, generator=gen)[: len(seq_lens) * width] + 1
    table = ids.int().view(len(seq_lens), width)
    cm = make_common_attn_metadata([1] * len(seq_lens), seq_lens, table, block_size)
    spec = AttentionSpec(block_size, kv_heads, size, torch.float32)
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["l"]), BatchLimits(8, 64, 256), "cpu"
    )
    md = builder.build(0, cm)
    paged = paged_kv_views(cache)
    cpu = torch.device("cpu")
    # Both plans of a step with global and windowed layers, made before either is read: each
    # keeps block lists of its own.
    plans = {w: make_paged_decode_plan(md, paged, group, w, cpu) for w in {None, window}}
    query = torch.randn(8, kv_heads, group, size, generator=gen)
    for w, decodes in plans.items():
        assert (decodes.num_decodes, decodes.batch) == (5, 8)
        # lists as wide as a request of max_model_len (256 tokens), past the table's width
        assert decodes.block_mask.kv_indices.shape[-1] == 256 // block_size
        got = _sparse_attention(decodes.block_mask, paged.key, paged.value, query, block_size, 0.25)
        for b, length in enumerate(seq_lens):
            blocks = table[b, : -(-length // block_size)].long()
            lo = 0 if w is None else max(0, length - w)
            k, v = (cache[blocks, i].reshape(-1, kv_heads, size)[lo:length] for i in (0, 1))
            scores = torch.einsum("hgd,khd->hgk", query[b].double(), k.double()) * 0.25
            want = torch.einsum("hgk,khd->hgd", scores.softmax(-1), v.double())
            torch.testing.assert_close(got[b], want, rtol=0, atol=1e-12)
        assert (got[len(seq_lens) :] == 0).all()  # padding entries visit nothing


def _impl(**kwargs) -> FlexAttentionImpl:
    return FlexAttentionImpl(8, 16, 0.25, 2, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "in_place"),
    [
        ({}, True),
        ({"logits_soft_cap": 30.0}, True),
        ({"alibi_slopes": [0.5] * 8}, False),
        ({"sinks": torch.zeros(8)}, False),
        ({"sliding_window": 64}, True),
        ({"kv_cache_dtype": "fp8"}, False),
        ({"attn_type": "encoder_decoder"}, False),
    ],
)
def test_which_layers_may_read_the_cache_in_place(kwargs, in_place):
    # ALiBi needs a key's position, a sink a key of its own; fp8 needs dequantising
    assert _impl(**kwargs)._may_read_in_place is in_place


def test_the_cpu_copies_decode_keys():
    """On the CPU (whose FlexAttention template cannot compile the paged plan, torch 2.13)
    decodes take the copying decode layout."""
    cache = allocate_kv_cache(FlexAttentionBackend, 8, 16, 2, 16, torch.float32)
    cm = make_common_attn_metadata([1, 1], [5, 20], torch.tensor([[1, 2], [3, 4]]).int(), 16)
    spec = AttentionSpec(16, 2, 16, torch.float32)
    md = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["l"]), BatchLimits(8, 64, 256), "cpu"
    ).build(0, cm)
    assert _impl()._in_place(cache, md, torch.float32) is None


# --- on the GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_compute_q
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [16, 32, 64])  # 16, 32: the pipelined kernel options
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decodes_read_in_place_match_the_oracle_and_copy_no_key(
    layout, block_size, dtype, monkeypatch
):
    """A decode step takes the paged plan (no key copied) and matches the float64 oracle, with
    and without a window; a mixed step copies only the prefills' keys and matches it too."""
    copies = []
    gather = flex_attention.gather_kv_rows

    def counting(*args, **kwargs):
        copies.append((kwargs["first_row"], kwargs["num_keys"], kwargs["max_key_len"]))
        return gather(*args, **kwargs)

    monkeypatch.setattr(flex_attention, "gather_kv_rows", counting)
    cache = {"block_size": block_size, "layout": KVCacheLayout(layout)}
    decodes = get_spec("many_decodes")
    # the kit puts decodes first (in `mixed`, keys of 40, 1 and 129): the other requests'
    # keys (17 + 70 + 33, the longest 70) are copied alone, from the workspace's first key
    # row, not after rows left for the decodes
    for case, first_rows in (
        (Case("paged_decodes", "decode", decodes, **cache), set()),
        (Case("paged_window", "sliding_window", decodes, sliding_window=20, **cache), set()),
        (
            Case("paged_mixed", "mixed", get_spec("mixed"), **cache),
            {(plan.FIRST_KEY_ROW, 17 + 70 + 33, 70)},
        ),
    ):
        copies.clear()
        (result,) = run_case(FlexAttentionBackend, case, "cuda", dtype)
        assert result.passed, result
        assert set(copies) == first_rows, case.name


@pytest.mark.gpu
@needs_compute_q
def test_paged_plan_is_used_for_cuda_decodes():
    device = torch.device("cuda")
    cache = allocate_kv_cache(FlexAttentionBackend, 8, 16, 2, 16, torch.bfloat16, device=device)
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    cm = make_common_attn_metadata([1, 1], [5, 20], table, 16, device=device)
    spec = AttentionSpec(16, 2, 16, torch.bfloat16)
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["l"]), BatchLimits(8, 64, 256), device
    )
    md = builder.build(0, cm)
    impl = _impl()
    paged = impl._in_place(cache, md, torch.bfloat16)
    assert paged is not None
    decodes, rows = impl._plans(md, False, device, paged)
    assert isinstance(decodes, PagedDecodePlan) and rows is None


@pytest.mark.gpu
@needs_compute_q
@pytest.mark.parametrize("window", [None, 100])
def test_steps_on_one_cache_reuse_one_graph_and_match_the_oracle(window):
    """An engine's decode steps: one cache, batches of one bucket (5 to 8 requests), block
    tables of other widths (the engine's grows with its longest request) and lengths: one
    compile in all, and every step against a float64 reference read out of the cache."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    block_size, kv_heads, group, size = 16, 2, 4, 64
    gen = torch.Generator().manual_seed(5)
    cache = allocate_kv_cache(
        FlexAttentionBackend, 600, block_size, kv_heads, size, dtype, device=device
    )
    cache.copy_(torch.randn(cache.shape, generator=gen))
    spec = AttentionSpec(block_size, kv_heads, size, dtype)
    builder = FlexAttentionMetadataBuilder(
        spec, layer_records(spec, ["l"]), BatchLimits(64, 4096, 1024), device
    )
    impl = FlexAttentionImpl(kv_heads * group, size, size**-0.5, kv_heads, sliding_window=window)
    one = torch.ones((), device=device)
    layer = KitLayer("l", one, one)
    graphs = None
    for n, longest in ((5, 300), (6, 600), (7, 100), (8, 1000), (5, 290)):
        seq_lens = [int(x) for x in torch.randint(1, longest + 1, (n,), generator=gen)]
        width = -(-max(seq_lens) // block_size)
        table = (torch.randperm(599, generator=gen)[: n * width] + 1).int().view(n, width)
        md = builder.build(0, make_common_attn_metadata([1] * n, seq_lens, table, block_size,
                                                        device))  # fmt: skip
        query = torch.randn(n, kv_heads * group, size, generator=gen).to(device, dtype)
        output = torch.zeros_like(query)
        impl.forward(layer, query, None, None, cache, md, output)
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]  # the first step compiles
        for b, length in enumerate(seq_lens):
            lo = 0 if window is None else max(0, length - window)
            blocks = table[b, : -(-length // block_size)].long().to(device)
            k, v = (cache[blocks, i].reshape(-1, kv_heads, size)[lo:length] for i in (0, 1))
            k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
            scores = torch.einsum("hd,khd->hk", query[b].double(), k) * size**-0.5
            want = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
            torch.testing.assert_close(output[b].double(), want, atol=2e-2, rtol=2e-2)
    assert counters["stats"]["unique_graphs"] == graphs
