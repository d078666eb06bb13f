"""The shared MLA builder's plan, compared exactly with what the definitions give: context
chunks with their per-request row offsets, requests without new tokens left out of the chunks,
and the hooks a backend's builder overrides to add its own plan."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from anyattn import BatchLimits
from anyattn.backends.mla_builder import MLAMetadataBuilder
from anyattn.backends.mla_metadata import MLADecodeMetadata, MLAMetadata, extend_metadata
from anyattn.backends.torch_mla import TorchMLAImpl, TorchMLAMetadataBuilder
from anyattn.config import MLAAttentionSpec
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing.blocks import assign_blocks

SIZES = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10}
LIMITS = BatchLimits(max_num_reqs=8, max_num_tokens=128, max_model_len=64)
BLOCK_SIZE, WORKSPACE = 4, 8


def _build(builder_cls, query_lens, seq_lens):
    impl = TorchMLAImpl(2, 0.5, **SIZES, workspace_tokens=WORKSPACE)
    spec = MLAAttentionSpec(block_size=BLOCK_SIZE, dtype=torch.float32, **SIZES)
    builder = builder_cls(spec, {"mla": impl.layer_params()}, LIMITS, "cpu")
    gen = torch.Generator().manual_seed(0)
    table, _ = assign_blocks(seq_lens, BLOCK_SIZE, generator=gen)
    cm = make_common_attn_metadata(query_lens, seq_lens, table, BLOCK_SIZE)
    return builder.build(0, cm), table


def _slots(table, request, positions):
    return [int(table[request, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def test_chunks_say_each_prefill_requests_rows():
    # One decode, then prefills with contexts 5, 0, 11 and 2: 18 rows in chunks of 8.
    query_lens, context = [1, 3, 2, 4, 1], [6, 5, 0, 11, 2]
    seq_lens = [q + c for q, c in zip(query_lens, context, strict=True)]
    md, table = _build(TorchMLAMetadataBuilder, query_lens, seq_lens)
    chunks = md.prefill.chunks
    # Prefill requests 0..3 are step requests 1..4; their contexts in order, 8 rows a chunk.
    rows = [(1, p) for p in range(5)] + [(3, p) for p in range(11)] + [(4, p) for p in range(2)]
    assert [c.num_tokens for c in chunks] == [8, 8, 2]
    for i, chunk in enumerate(chunks):
        expected = [_slots(table, r, [p])[0] for r, p in rows[8 * i : 8 * i + 8]]
        assert chunk.slots_cpu.tolist() == expected
        assert torch.equal(chunk.slots, chunk.slots_cpu)
        assert torch.equal(chunk.cu_seq_lens, chunk.cu_seq_lens_cpu)
    assert [c.cu_seq_lens_cpu.tolist() for c in chunks] == [
        [0, 5, 5, 8, 8],  # request 0's 5 rows, request 2's first 3
        [0, 0, 0, 8, 8],  # request 2's next 8
        [0, 0, 0, 0, 2],  # request 3's 2 (request 2 has none here)
    ]
    assert [c.max_seq_len for c in chunks] == [5, 8, 2]
    assert all(c.cu_seq_lens_cpu.dtype == torch.int32 for c in chunks)
    # The offsets agree with the pieces.
    for chunk in chunks:
        for piece in chunk.pieces:
            start, end = chunk.cu_seq_lens_cpu[piece.request : piece.request + 2].tolist()
            assert (start, end - start) == (piece.row_start, piece.row_len)


def test_a_request_without_new_tokens_has_no_context_read():
    # Prefill region: a request with 7 cached tokens and no new one between two others.
    query_lens, seq_lens = [3, 0, 2], [9, 7, 6]
    md, table = _build(TorchMLAMetadataBuilder, query_lens, seq_lens)
    assert md.num_prefills == 3
    pieces = [p for c in md.prefill.chunks for p in c.pieces]
    assert [(p.request, p.context_start, p.row_len) for p in pieces] == [
        (0, 0, 6),
        (2, 0, 2),
        (2, 2, 2),
    ]
    slots = np.concatenate([c.slots_cpu.numpy() for c in md.prefill.chunks]).tolist()
    assert slots == _slots(table, 0, range(6)) + _slots(table, 2, range(4))


@dataclasses.dataclass(frozen=True)
class _TaggedDecode(MLADecodeMetadata):
    tag: str = ""


@dataclasses.dataclass(frozen=True)
class _TaggedMetadata(MLAMetadata):
    tag: str = ""


def test_plan_hooks_are_overridable():
    class PublicHooks(MLAMetadataBuilder):
        def plan_decodes(self, cm, num_decodes):
            base = super().plan_decodes(cm, num_decodes)
            return _TaggedDecode(**{f.name: getattr(base, f.name)
                                    for f in dataclasses.fields(base)}, tag="public")  # fmt: skip

        def plan_prefills(self, cm, num_decodes):
            base = super().plan_prefills(cm, num_decodes)
            return dataclasses.replace(base, max_query_len=-1)

    class WrapsBuild(MLAMetadataBuilder):
        def build(self, common_prefix_len, common_attn_metadata):
            base = super().build(common_prefix_len, common_attn_metadata)
            return extend_metadata(base, _TaggedMetadata, tag="built")

    query_lens, seq_lens = [1, 3], [5, 7]
    reference, _ = _build(MLAMetadataBuilder, query_lens, seq_lens)
    public, _ = _build(PublicHooks, query_lens, seq_lens)
    assert isinstance(public.decode, _TaggedDecode) and public.decode.tag == "public"
    assert torch.equal(public.decode.seq_lens, reference.decode.seq_lens)
    assert public.prefill.max_query_len == -1
    wrapped, _ = _build(WrapsBuild, query_lens, seq_lens)
    assert isinstance(wrapped, _TaggedMetadata) and wrapped.tag == "built"
    assert wrapped.prefill is not None and wrapped.num_decodes == reference.num_decodes == 1


def test_extend_metadata_refuses_other_classes():
    md, _ = _build(MLAMetadataBuilder, [2], [2])
    with pytest.raises(
        TypeError, match=r"^extend_metadata: metadata_cls must be a subclass of MLAMetadata"
    ):
        extend_metadata(md, MLADecodeMetadata)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        extend_metadata(md, _TaggedMetadata, colour="red")
