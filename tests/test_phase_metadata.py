"""`split_by_phase`: a decodes-first step cut into its decode and prefill parts, each exactly
the metadata of its requests alone; bad splits refused."""

from __future__ import annotations

import pytest
import torch

from anyattn.metadata import make_common_attn_metadata
from anyattn.phase_metadata import split_by_phase

BLOCK = 4
QUERY_LENS, SEQ_LENS = [1, 1, 5, 3], [6, 9, 12, 3]
TABLE = torch.tensor([[3, 7, 0], [5, 2, 9], [4, 8, 6], [1, 0, 0]], dtype=torch.int32)


def _fields(common):
    tensors = (
        "query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu",
        "num_computed_tokens_cpu", "block_table_tensor", "block_table_cpu", "slot_mapping",
        "slot_mapping_cpu",
    )  # fmt: skip
    ints = ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal")
    return {n: getattr(common, n).tolist() for n in tensors} | {n: getattr(common, n) for n in ints}


@pytest.mark.parametrize("num_decodes", [0, 1, 2, 4])
def test_each_part_is_the_metadata_of_its_requests_alone(num_decodes):
    common = make_common_attn_metadata(QUERY_LENS, SEQ_LENS, TABLE, BLOCK)
    decode, prefill = split_by_phase(common, num_decodes)
    parts = [(decode, slice(0, num_decodes)), (prefill, slice(num_decodes, 4))]
    for part, rows in parts:
        if rows.start == rows.stop:
            assert part is None
            continue
        alone = make_common_attn_metadata(QUERY_LENS[rows], SEQ_LENS[rows], TABLE[rows], BLOCK)
        assert _fields(part) == _fields(alone)
    # the parts' slots are the step's, in order
    slots = [s for p, _ in parts if p is not None for s in p.slot_mapping.tolist()]
    assert slots == common.slot_mapping.tolist()


def test_padding_past_the_real_tokens_stays_with_the_prefill_part():
    common = make_common_attn_metadata(QUERY_LENS, SEQ_LENS, TABLE, BLOCK, num_padded_tokens=14)
    decode, prefill = split_by_phase(common, 2)
    assert decode.slot_mapping.shape[0] == 2 and decode.num_actual_tokens == 2
    assert prefill.num_actual_tokens == 8 and prefill.slot_mapping.tolist()[-4:] == [-1] * 4


@pytest.mark.parametrize(
    ("num_decodes", "error", "match"),
    [
        (5, ValueError, r"num_decodes outside the step \(got 5, expected 0 <= num_decodes <= "
         r"num_reqs = 4\)"),
        (-1, ValueError, r"got -1"),
        (1.0, TypeError, r"num_decodes must be an int \(got 1.0\)"),
        (True, TypeError, r"num_decodes must be an int"),
    ],
)  # fmt: skip
def test_bad_splits_are_refused(num_decodes, error, match):
    common = make_common_attn_metadata(QUERY_LENS, SEQ_LENS, TABLE, BLOCK)
    with pytest.raises(error, match=match):
        split_by_phase(common, num_decodes)


def test_cross_attention_steps_are_not_split():
    common = make_common_attn_metadata(
        [1, 2], [3, 4], TABLE[:2], BLOCK, causal=False, encoder_seq_lens=[3, 4]
    )
    with pytest.raises(ValueError, match=r"cross-attention steps are not split by phase"):
        split_by_phase(common, 1)
