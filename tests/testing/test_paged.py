"""The kit's batch builder: shuffled blocks, the null block, cache contents, metadata."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from anyattn.backend import AttentionBackend, AttentionMetadataBuilder
from anyattn.testing import (
    BatchSpec,
    assign_blocks,
    build_batch,
    dequantize_kv,
    get_spec,
    quantize_kv,
    read_kv,
    write_kv,
)
from anyattn.types import AttentionType, MultipleOf

SHAPE = dict(num_heads=4, num_kv_heads=2, head_size=8)


class EchoBuilder(AttentionMetadataBuilder[object]):
    """Returns the common metadata itself, so tests can look at what the backend would get."""

    def build(self, common_prefix_len, common_attn_metadata):
        return (common_prefix_len, common_attn_metadata)


class DecodesFirstBuilder(EchoBuilder):
    reorder_batch_threshold = 1


@pytest.fixture
def backend(make_backend: Callable[..., type[AttentionBackend]]) -> type[AttentionBackend]:
    return make_backend(
        "KIT",
        kv_cache_dtypes=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        supported_attn_types=tuple(AttentionType),
        get_builder_cls=staticmethod(lambda: EchoBuilder),
    )


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(_bits(a), _bits(b))


def test_assign_blocks_shuffled_sparse_and_never_null() -> None:
    table, num_blocks = assign_blocks([1, 17, 40], 16, generator=torch.Generator().manual_seed(0))
    assert table.dtype == torch.int32 and table.shape == (3, 3)
    used = [table[0, :1], table[1, :2], table[2, :3]]
    ids = torch.cat(used).tolist()
    assert 0 not in ids and len(set(ids)) == 6
    assert num_blocks > 7 and max(ids) < num_blocks  # a pool larger than needed
    assert ids != sorted(ids)  # shuffled, not handed out in order
    assert table[0, 1:].tolist() == [0, 0] and table[1, 2].item() == 0  # unused entries: null


def test_assign_blocks_shares_prefix_blocks() -> None:
    table, _ = assign_blocks(
        [70, 50, 33], 16, common_prefix_len=32, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(table[0, :2], table[1, :2]) and torch.equal(table[0, :2], table[2, :2])
    own = table[0, 2:5].tolist() + table[1, 2:4].tolist() + table[2, 2:3].tolist()
    assert len(set(own + table[0, :2].tolist())) == len(own) + 2
    with pytest.raises(ValueError, match="multiple of block_size"):
        assign_blocks([70], 16, common_prefix_len=20)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_write_then_read_back(backend, layout: str, kv_cache_dtype: str) -> None:
    from anyattn.kv_cache import allocate_kv_cache

    cache = allocate_kv_cache(backend, 6, 4, 2, 8, torch.float16, kv_cache_dtype, layout)
    key = torch.randn(5, 2, 8).half()
    value = torch.randn(5, 2, 8).half()
    scale = torch.tensor([0.5, 0.25])
    slots = torch.tensor([9, -1, 4, 23, 10])
    write_kv(cache, key, value, slots, kv_cache_dtype, scale, scale)
    block_table = torch.tensor([[2, 1, 5]], dtype=torch.int32)  # positions 0-3: slots 8-11 ...
    k, v = read_kv(cache, block_table, [12])
    stored_k = quantize_kv(key, kv_cache_dtype, cache.dtype, scale)
    _assert_same_bits(k[1], stored_k[0])  # slot 9 = block 2, offset 1 -> position 1
    _assert_same_bits(k[2], stored_k[4])  # slot 10 -> position 2
    _assert_same_bits(k[4], stored_k[2])  # slot 4 = block 1 -> position 4
    _assert_same_bits(k[11], stored_k[3])  # slot 23 = block 5, offset 3
    assert not _bits(cache[0]).any() and not _bits(cache[3]).any()  # nothing else written
    expected_v = dequantize_kv(
        quantize_kv(value, kv_cache_dtype, cache.dtype, scale), kv_cache_dtype, scale
    )
    torch.testing.assert_close(dequantize_kv(v[1:3], kv_cache_dtype, scale), expected_v[[0, 4]])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decoder_batch_cache_holds_context_and_expects_new_tokens(
    backend, layout: str, kv_cache_dtype: str
) -> None:
    spec = get_spec("mixed", quick=True)
    scale = torch.tensor(0.375)
    batch = build_batch(
        backend,
        spec,
        dtype=torch.bfloat16,
        layout=layout,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=scale,
        v_scale=scale,
        seed=3,
        **SHAPE,
    )
    table, cm = batch.block_table, batch.common_attn_metadata
    assert batch.query.shape == (spec.num_tokens, 4, 8)
    assert batch.key.shape == (spec.num_tokens, 2, 8)
    assert cm.num_actual_tokens == spec.num_tokens and cm.causal
    # The expected cache read back and dequantised is exactly what the oracle attends to.
    k_all, v_all = read_kv(batch.expected_kv_cache, table, spec.seq_lens)
    assert torch.equal(dequantize_kv(k_all, kv_cache_dtype, scale), batch.oracle_key)
    assert torch.equal(dequantize_kv(v_all, kv_cache_dtype, scale), batch.oracle_value)
    # Writing the step's key/value at the metadata's slots turns the cache into the expected one.
    write_kv(batch.kv_cache, batch.key, batch.value, cm.slot_mapping, kv_cache_dtype, scale, scale)
    _assert_same_bits(batch.kv_cache, batch.expected_kv_cache)
    assert not _bits(batch.expected_kv_cache[0]).any()  # the null block stays empty
    used = torch.cat([table[r, : -(-s // 16)] for r, s in enumerate(spec.seq_lens)]).tolist()
    assert 0 not in used and len(set(used)) == len(used)


def test_context_is_written_new_tokens_are_not(backend) -> None:
    spec = BatchSpec("two", (3, 1), (10, 5))
    batch = build_batch(backend, spec, dtype=torch.float32, **SHAPE)
    k, _ = read_kv(batch.kv_cache, batch.block_table, spec.seq_lens)
    # rows: request 0 positions 0-9 (context 0-6), request 1 positions 0-4 (context 0-3)
    context = torch.cat([batch.oracle_key[:7], batch.oracle_key[10:14]]).float()
    assert torch.equal(torch.cat([k[:7], k[10:14]]), context)
    assert not k[7:10].any() and not k[14].any()
    assert torch.equal(
        batch.key.double(), torch.cat([batch.oracle_key[7:10], batch.oracle_key[14:]])
    )


def test_reorders_decodes_first_when_the_builder_asks(backend) -> None:
    reordering = type("Reordering", (backend,), {})
    reordering.get_builder_cls = staticmethod(lambda: DecodesFirstBuilder)
    spec = BatchSpec("interleaved", (5, 1, 3, 1), (5, 9, 20, 2))
    plain = build_batch(backend, spec, dtype=torch.float32, seed=7, **SHAPE)
    moved = build_batch(reordering, spec, dtype=torch.float32, seed=7, **SHAPE)
    assert plain.order == [0, 1, 2, 3]
    assert moved.spec.query_lens == (1, 1, 3, 5)
    assert [spec.query_lens[i] for i in moved.order] == list(moved.spec.query_lens)

    # The same requests with the same values, only moved.
    def rows(batch, tensor, lens):  # original request id -> its rows
        starts = [sum(lens[:i]) for i in range(len(lens))]
        return {batch.order[r]: tensor[s : s + lens[r]] for r, s in enumerate(starts)}

    for name, lens_of in (("query", "query_lens"), ("oracle_key", "seq_lens")):
        a = rows(plain, getattr(plain, name), getattr(plain.spec, lens_of))
        b = rows(moved, getattr(moved, name), getattr(moved.spec, lens_of))
        assert all(torch.equal(a[r], b[r]) for r in range(4))


def test_cross_attention_batch(backend) -> None:
    spec = get_spec("encoder_decoder")
    batch = build_batch(
        backend, spec, dtype=torch.float16, attn_type=AttentionType.ENCODER_DECODER, **SHAPE
    )
    cm = batch.common_attn_metadata
    first = [r for r, f in enumerate(batch.spec.is_first_step) if f]
    num_encoder_written = sum(batch.spec.encoder_seq_lens[r] for r in first)
    assert batch.key.shape == (num_encoder_written, 2, 8)
    assert cm.slot_mapping.shape == (num_encoder_written,) and not cm.causal
    assert cm.encoder_seq_lens_cpu.tolist() == list(batch.spec.encoder_seq_lens)
    assert cm.seq_lens_cpu.tolist() == list(batch.spec.seq_lens)  # the decoder's own lengths
    write_kv(batch.kv_cache, batch.key, batch.value, cm.slot_mapping)
    _assert_same_bits(batch.kv_cache, batch.expected_kv_cache)
    k, _ = read_kv(batch.expected_kv_cache, batch.block_table, batch.spec.encoder_seq_lens)
    assert torch.equal(k.double(), batch.oracle_key)


def test_cross_attention_without_first_steps_passes_no_key(backend) -> None:
    spec = BatchSpec("later", (1, 2), (4, 9), encoder_seq_lens=(5, 30))
    batch = build_batch(backend, spec, dtype=torch.float32, attn_type="encoder_decoder", **SHAPE)
    assert batch.key is None and batch.value is None
    assert batch.common_attn_metadata.slot_mapping.numel() == 0
    _assert_same_bits(batch.kv_cache, batch.expected_kv_cache)


@pytest.mark.parametrize("attn_type", ["encoder", "encoder_only"])
def test_encoder_batch_leaves_the_cache_alone(backend, attn_type: str) -> None:
    spec = get_spec("encoder", quick=True)
    batch = build_batch(backend, spec, dtype=torch.float32, attn_type=attn_type, **SHAPE)
    assert not batch.kv_cache.any() and not batch.expected_kv_cache.any()
    assert not batch.common_attn_metadata.causal
    assert torch.equal(batch.key.double(), batch.oracle_key)


def test_padding_rows_get_slot_minus_one(backend) -> None:
    spec = get_spec("mixed", quick=True)
    batch = build_batch(backend, spec, dtype=torch.float32, num_padding_tokens=5, **SHAPE)
    slots = batch.common_attn_metadata.slot_mapping
    assert batch.query.shape[0] == batch.key.shape[0] == slots.shape[0] == spec.num_tokens + 5
    assert slots[spec.num_tokens :].tolist() == [-1] * 5 and (slots[: spec.num_tokens] >= 0).all()


def test_engine_blocks_split_into_kernel_blocks(make_backend) -> None:
    small_kernel = make_backend(
        "SMALL", block_sizes=(16,), get_builder_cls=staticmethod(lambda: EchoBuilder)
    )
    spec = get_spec("chunked_prefill", quick=True)
    batch = build_batch(small_kernel, spec, dtype=torch.float32, block_size=32, **SHAPE)
    assert batch.block_size == 16 and batch.kv_cache.shape[2] == 16
    assert batch.builder.kv_cache_spec.block_size == 16
    table = batch.block_table
    assert torch.equal(table[:, 1::2], table[:, ::2] + 1)  # engine block b -> 2b, 2b + 1
    write_kv(batch.kv_cache, batch.key, batch.value, batch.common_attn_metadata.slot_mapping)
    _assert_same_bits(batch.kv_cache, batch.expected_kv_cache)


def test_cascade_prefix_is_shared(backend) -> None:
    spec = get_spec("cascade", quick=True)
    batch = build_batch(backend, spec, dtype=torch.float32, **SHAPE)
    prefix_blocks = spec.common_prefix_len // 16
    table = batch.block_table
    assert (table[:, :prefix_blocks] == table[0, :prefix_blocks]).all()
    assert batch.attn_metadata[0] == spec.common_prefix_len
    k, _ = read_kv(batch.expected_kv_cache, table, spec.seq_lens)
    starts = [sum(spec.seq_lens[:r]) for r in range(spec.num_reqs)]
    for s in starts[1:]:
        assert torch.equal(k[s : s + spec.common_prefix_len], k[: spec.common_prefix_len])


def test_same_seed_same_batch(backend) -> None:
    spec = get_spec("mixed", quick=True)
    a, b = (build_batch(backend, spec, dtype=torch.float32, seed=5, **SHAPE) for _ in range(2))
    c = build_batch(backend, spec, dtype=torch.float32, seed=6, **SHAPE)
    assert torch.equal(a.query, b.query) and torch.equal(a.block_table, b.block_table)
    assert not torch.equal(a.query, c.query)


def test_block_size_must_be_declared(make_backend) -> None:
    only16 = make_backend("ONLY16", block_sizes=(16,))
    with pytest.raises(ValueError, match="block_size not supported"):
        build_batch(only16, get_spec("mixed"), dtype=torch.float32, block_size=8, **SHAPE)


def test_multiple_of_one_takes_odd_block_sizes(make_backend) -> None:
    odd = make_backend(
        "ODD", block_sizes=(MultipleOf(1),), get_builder_cls=staticmethod(lambda: EchoBuilder)
    )
    batch = build_batch(
        odd, get_spec("odd_lengths", quick=True), dtype=torch.float32, block_size=5, **SHAPE
    )
    write_kv(batch.kv_cache, batch.key, batch.value, batch.common_attn_metadata.slot_mapping)
    _assert_same_bits(batch.kv_cache, batch.expected_kv_cache)
