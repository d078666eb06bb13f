"""The kit's MLA batch: latent cache writes and reads, shuffled blocks, decodes first, and the
latents the oracle is given (as stored for the decode path, as given for new prefill tokens)."""

from __future__ import annotations

import pytest
import torch

from anyattn.ops.fp8_quant import quantize_fp8
from anyattn.testing import (
    MLA_SHAPES,
    BatchSpec,
    MLAShape,
    build_mla_batch,
    read_latents,
    write_latents,
)

torch_mla = pytest.importorskip("anyattn.backends.torch_mla")

SMALL = MLA_SHAPES[-1]


def test_write_latents_stores_rows_at_their_slots_and_skips_minus_one() -> None:
    cache = torch.zeros(4, 2, 5)  # 4 blocks of 2 rows of L + R = 3 + 2
    kv_c = torch.arange(9.0).view(3, 3)
    k_pe = -torch.arange(6.0).view(3, 2)
    write_latents(cache, kv_c, k_pe, torch.tensor([5, -1, 2]))
    assert cache[2, 1].tolist() == [0.0, 1.0, 2.0, -0.0, -1.0]  # slot 5 = block 2, offset 1
    assert cache[1, 0].tolist() == [6.0, 7.0, 8.0, -4.0, -5.0]  # slot 2
    assert int((cache != 0).any(-1).sum()) == 2  # row 1 (slot -1) is nowhere


def test_fp8_latents_store_the_quantised_row_and_read_back_dequantised() -> None:
    cache = torch.zeros(2, 4, 6, dtype=torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(0)
    kv_c, k_pe = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g) * 100
    scale = torch.tensor(0.375)
    write_latents(cache, kv_c, k_pe, torch.tensor([4, 5, 0]), "fp8_e4m3", scale)
    expected = quantize_fp8(torch.cat([kv_c, k_pe], -1), scale, torch.float8_e4m3fn)
    stored = torch.stack([cache[1, 0], cache[1, 1], cache[0, 0]])
    assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    table = torch.tensor([[1, 0]])
    read = read_latents(cache, table, [2], "fp8_e4m3", scale)
    assert read.dtype == torch.float64
    assert torch.equal(read, expected[:2].double() * 0.375)


def test_latent_cache_io_rejects_a_standard_cache() -> None:
    standard = torch.zeros(4, 2, 16, 1, 8)
    with pytest.raises(ValueError, match=r"kv_cache must be an MLA cache .* \(got shape"):
        write_latents(standard, torch.zeros(1, 6), torch.zeros(1, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"must fill rows of 8 \(got \(1, 6\) and \(1, 1\)\)"):
        write_latents(torch.zeros(4, 2, 8), torch.zeros(1, 6), torch.zeros(1, 1), torch.tensor([0]))


def _batch(kv_cache_dtype: str = "auto", **kwargs):
    impl = torch_mla.TorchMLAImpl(
        4,
        0.1,
        kv_lora_rank=SMALL.kv_lora_rank,
        qk_rope_head_dim=SMALL.qk_rope_head_dim,
        qk_nope_head_dim=SMALL.qk_nope_head_dim,
        v_head_dim=SMALL.v_head_dim,
        kv_cache_dtype=kv_cache_dtype,
    )
    spec = BatchSpec("t", (5, 1, 3, 1), (5, 20, 40, 17))
    return build_mla_batch(
        torch_mla.TorchMLABackend,
        spec,
        shape=SMALL,
        num_heads=4,
        dtype=torch.float32,
        kv_cache_dtype=kv_cache_dtype,
        layers={"layer.0": impl.layer_params()},
        **kwargs,
    )


def test_batch_is_decodes_first_over_shuffled_blocks_with_the_context_written() -> None:
    batch = _batch(num_padding_tokens=3)
    assert batch.spec.query_lens == (1, 1, 3, 5) and batch.order == [3, 1, 2, 0]
    assert batch.attn_metadata.num_decodes == 2
    assert batch.q_nope.shape == (10 + 3, 4, SMALL.qk_nope_head_dim)
    assert batch.kv_c.shape == (13, SMALL.kv_lora_rank) and batch.k_pe.shape == (13, 16)
    assert batch.common_attn_metadata.slot_mapping[10:].tolist() == [-1, -1, -1]
    table = batch.block_table
    used = torch.cat([table[r, : -(-s // 16)] for r, s in enumerate(batch.spec.seq_lens)])
    assert 0 not in used.tolist() and len(set(used.tolist())) == used.numel()
    assert used.tolist() != sorted(used.tolist())
    # The kit wrote the contexts; the expected cache also holds the new rows; block 0 is empty.
    for cache, lens in (
        (batch.kv_cache, batch.spec.context_lens),
        (batch.expected_kv_cache, batch.spec.seq_lens),
    ):
        rows = read_latents(cache, table, lens)
        given = torch.cat([g[:n] for g, n in zip(batch.given_rows, lens, strict=True)])
        assert torch.equal(rows, given)
        assert not cache[0].any()
    assert int(batch.kv_cache.any(-1).sum()) == sum(batch.spec.context_lens)


def test_oracle_latents_follow_the_path_each_request_takes() -> None:
    batch = _batch("fp8_e5m2", k_scale=torch.tensor(0.375))
    kv_c, k_pe = batch.oracle_latents(num_decodes=2)
    rows = torch.cat([kv_c, k_pe], -1)
    assert batch.spec.seq_lens == (17, 20, 40, 5) and batch.spec.context_lens == (16, 19, 37, 0)
    stored, given = batch.stored_rows, batch.given_rows
    assert not torch.equal(stored[0], given[0])  # fp8 rounds
    # Decodes read every row from the cache.
    assert torch.equal(rows[0:17], stored[0]) and torch.equal(rows[17:37], stored[1])
    # Prefills: context as stored, new tokens as given.
    third = rows[37:77]
    assert torch.equal(third[:37], stored[2][:37]) and torch.equal(third[37:], given[2][37:])
    assert torch.equal(rows[77:], given[3])  # a fresh prefill has no context


def test_weights_give_unit_sized_keys_and_values() -> None:
    shape = MLAShape(512, 64, 128, 128)
    impl = torch_mla.TorchMLAImpl(
        2, 0.1, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
    )
    batch = build_mla_batch(
        torch_mla.TorchMLABackend,
        BatchSpec("t", (64,), (64,)),
        shape=shape,
        num_heads=2,
        dtype=torch.float32,
        layers={"layer.0": impl.layer_params()},
    )
    k_nope = torch.einsum("nl,hpl->nhp", batch.kv_c[:64], batch.w_uk)
    assert 0.7 < k_nope.std().item() < 1.3
    assert batch.kv_c.pow(2).mean(-1).sqrt().allclose(torch.ones(64))  # RMS-normalised
