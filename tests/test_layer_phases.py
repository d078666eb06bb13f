"""A layer with a decode and a prefill backend over one cache: a mixed step (decodes, a chunk
over a context, a fresh prefill) against the float64 oracle, K/V written once by the layer,
LSEs in natural base whatever base an impl writes, and refused calls that write nothing."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from anyattn.backends.torch_attn import TorchAttentionBackend, TorchAttentionImpl
from anyattn.config import BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.kv_cache_sharing import plan_shared_kv_cache
from anyattn.layer import Attention
from anyattn.metadata import CommonAttentionMetadata, make_common_attn_metadata
from anyattn.phase_metadata import PhaseSplitMetadata, split_by_phase
from anyattn.registry import get_backend_class
from anyattn.testing import assign_blocks, attention_oracle, error_bound, write_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 16, 4
SCALE = HEAD_SIZE**-0.5
# two decodes over contexts, a chunk of 6 over a context of 9, a fresh prefill of 7
QUERY_LENS, SEQ_LENS = [1, 1, 6, 7], [5, 13, 15, 7]
NUM_DECODES = 2
LIMITS = BatchLimits(max_num_reqs=8, max_num_tokens=64, max_model_len=64)


class Log2TorchImpl(TorchAttentionImpl):
    """TORCH's impl returning base-2 LSEs (as FlashInfer does), for the reconciliation."""

    lse_base_on_e = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
        if kwargs.get("output_lse") is not None:
            kwargs["output_lse"].div_(math.log(2.0))
        return output


class Log2TorchBackend(TorchAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TORCH_LOG2"

    @staticmethod
    def get_impl_cls() -> type:
        return Log2TorchImpl


def _layer(decode: str | type, prefill: str | type) -> Attention:
    layer = Attention(NUM_HEADS, HEAD_SIZE, SCALE, NUM_KV_HEADS, block_size=BLOCK, device="cpu")
    as_class = lambda b: get_backend_class(b) if isinstance(b, str) else b  # noqa: E731
    layer.use_backend(as_class(decode), prefill_backend=as_class(prefill))
    return layer


def _step(layer: Attention, generator: torch.Generator):
    """The step's inputs, a cache holding the contexts, its metadata split by phase."""
    total = sum(SEQ_LENS)
    keys = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    values = torch.randn(total, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    query = torch.randn(sum(QUERY_LENS), NUM_HEADS, HEAD_SIZE, generator=generator)
    table, num_blocks = assign_blocks(SEQ_LENS, BLOCK, generator=generator)
    shared = plan_shared_kv_cache(
        (layer.backend, layer.prefill_backend),
        block_size=BLOCK,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
    )
    cache = allocate_kv_cache(
        layer.backend, num_blocks, BLOCK, NUM_KV_HEADS, HEAD_SIZE, torch.float32,
        layout=shared.layout,
    )  # fmt: skip
    context = make_common_attn_metadata(
        [s - q for s, q in zip(SEQ_LENS, QUERY_LENS, strict=True)],
        [s - q for s, q in zip(SEQ_LENS, QUERY_LENS, strict=True)],
        table,
        BLOCK,
    )
    new_rows, context_rows, start = [], [], 0
    for q, s in zip(QUERY_LENS, SEQ_LENS, strict=True):
        context_rows += range(start, start + s - q)
        new_rows += range(start + s - q, start + s)
        start += s
    write_kv(cache, keys[context_rows], values[context_rows], context.slot_mapping)
    common = make_common_attn_metadata(QUERY_LENS, SEQ_LENS, table, BLOCK)
    return query, keys, values, new_rows, cache, _split(layer, common)


def _split(layer: Attention, common: CommonAttentionMetadata) -> PhaseSplitMetadata:
    """`common` split by phase, each part built by its backend's builder."""
    decode, prefill = split_by_phase(common, NUM_DECODES)
    built = []
    for backend, impl, part in (
        (layer.backend, layer.impl, decode),
        (layer.prefill_backend, layer.prefill_impl, prefill),
    ):
        records = {layer.layer_name: impl.layer_params()}  # each builder gets its impl's record
        builder = backend.get_builder_cls()(layer.kv_cache_spec(BLOCK), records, LIMITS, "cpu")
        built.append(builder.build(0, part))
    return PhaseSplitMetadata(common, int(common.query_start_loc_cpu[NUM_DECODES]), *built)


@pytest.mark.parametrize(
    ("decode", "prefill", "has_lse"),
    # (FLEX_ATTENTION returns no LSE on the CPU)
    [
        ("TORCH", "FLEX_ATTENTION", False),
        ("FLEX_ATTENTION", "TORCH", False),
        ("TORCH", Log2TorchBackend, True),
        (Log2TorchBackend, "TORCH", True),
    ],
    ids=["torch+flex", "flex+torch", "torch+log2", "log2+torch"],
)
def test_mixed_step_matches_the_oracle_and_writes_kv_once(decode, prefill, has_lse, monkeypatch):
    layer = _layer(decode, prefill)
    generator = torch.Generator().manual_seed(7)
    query, keys, values, new_rows, cache, split = _step(layer, generator)
    writes = []
    import anyattn.ops.reshape_and_cache as writer

    original = writer.reshape_and_cache_unchecked
    monkeypatch.setattr(
        writer,
        "reshape_and_cache_unchecked",
        lambda key, *args: writes.append(key.shape[0]) or original(key, *args),
    )
    query_in, key_in, value_in = query.clone(), keys[new_rows].clone(), values[new_rows].clone()
    lse = torch.full((NUM_HEADS, query.shape[0]), float("nan")) if has_lse else None
    out = layer(query_in, key_in, value_in, cache, split, output_lse=lse)
    assert writes == [query.shape[0]]  # one write, of the whole step
    # the caller's tensors are unchanged
    assert torch.equal(query_in, query) and torch.equal(key_in, keys[new_rows])
    # the cache holds every key and value at its slot, exactly
    expected = cache.clone()
    write_kv(expected, keys[new_rows], values[new_rows], split.slot_mapping)
    assert torch.equal(cache, expected)
    ref64, lse64 = attention_oracle(
        query.double(), keys.double(), values.double(), QUERY_LENS, SEQ_LENS, scale=SCALE
    )
    ref32, _ = attention_oracle(
        query, keys, values, QUERY_LENS, SEQ_LENS, scale=SCALE, compute_dtype=torch.float32
    )
    bound = error_bound(ref64, ref32, torch.float32)
    assert (out.double() - ref64).abs().max() <= bound
    if has_lse:  # natural-log LSEs from both parts (a base-2 impl's converted)
        torch.testing.assert_close(lse.double(), lse64, atol=1e-5, rtol=1e-5)


def test_a_refused_part_writes_nothing():
    layer = _layer("TORCH", "FLEX_ATTENTION")
    query, keys, values, new_rows, cache, split = _step(layer, torch.Generator().manual_seed(3))
    before = cache.clone()
    with pytest.raises(ValueError, match="query"):
        layer(query[:, :, :8].contiguous(), keys[new_rows], values[new_rows], cache, split)
    assert torch.equal(cache, before)


def test_a_prefill_part_needs_a_prefill_backend():
    layer = _layer("TORCH", "FLEX_ATTENTION")
    query, keys, values, new_rows, cache, split = _step(layer, torch.Generator().manual_seed(3))
    layer.use_backend(get_backend_class("TORCH"))
    assert layer.prefill_impl is None
    before = cache.clone()
    with pytest.raises(ValueError, match=r"prefill part but the layer runs one backend \(TORCH\)"):
        layer(query, keys[new_rows], values[new_rows], cache, split)
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    ("decode", "prefill"), [("TORCH", "FLEX_ATTENTION"), ("FLEX_ATTENTION", "TORCH")]
)
def test_a_bad_entry_is_reported_with_the_steps_own_indices(decode, prefill):
    """A bad block id or slot in the prefill part names the request and token of the whole
    step, not their indices within the part; nothing is written."""
    layer = _layer(decode, prefill)
    query, keys, values, new_rows, cache, split = _step(layer, torch.Generator().manual_seed(3))
    common = split.common_attn_metadata
    request = NUM_DECODES  # the prefill part's first request
    table = common.block_table_cpu.clone()
    table[request, 0] = -4
    bad_table = dataclasses.replace(common, block_table_tensor=table, block_table_cpu=table)
    token = int(common.query_start_loc_cpu[request]) + 1
    slots = common.slot_mapping_cpu.clone()
    slots[token] = cache.shape[0] * BLOCK + 1
    bad_slots = dataclasses.replace(common, slot_mapping=slots, slot_mapping_cpu=slots)
    before = cache.clone()
    with pytest.raises(ValueError, match=rf"for request {request}, column 0 \(got -4"):
        layer(query, keys[new_rows], values[new_rows], cache, _split(layer, bad_table))
    with pytest.raises(ValueError, match=rf"at token {token} \(request {request}\)"):
        layer(query, keys[new_rows], values[new_rows], cache, _split(layer, bad_slots))
    assert torch.equal(cache, before)


def test_a_cache_of_another_shape_is_reported_as_such():
    layer = _layer("TORCH", "FLEX_ATTENTION")
    query, keys, values, new_rows, cache, split = _step(layer, torch.Generator().manual_seed(3))
    flat = cache.flatten(2)[..., :8].reshape(cache.shape[0], -1, 8)[:, :16]
    for bad, error, message in (
        (flat, ValueError, r"TORCH forward: kv_cache must be \['num_blocks', 2, 4, 2, 16\]"),
        (None, TypeError, r"TORCH forward: kv_cache must be a torch.Tensor"),
    ):
        with pytest.raises(error, match=message):
            layer(query, keys[new_rows], values[new_rows], bad, split)
