"""BatchSpec validation and the catalogue's curated shapes."""

from __future__ import annotations

import pytest

from anyattn.testing import CATALOGUE, QUICK_CATALOGUE, BatchSpec, get_spec


def test_catalogue_covers_the_curated_shapes() -> None:
    names = [s.name for s in CATALOGUE]
    assert names == [s.name for s in QUICK_CATALOGUE]
    assert len(set(names)) == len(names)
    assert {1, 7, 97, 1025} <= set(get_spec("odd_lengths").seq_lens)
    assert get_spec("long_prefill").query_lens == (1025,)
    assert all(q == 1 for q in get_spec("many_decodes").query_lens)
    chunked = get_spec("chunked_prefill")
    pairs = zip(chunked.query_lens, chunked.context_lens, strict=True)
    assert any(q > 1 and c >= 512 for q, c in pairs)
    mixed = get_spec("mixed")
    assert 1 in mixed.query_lens and max(mixed.query_lens) > 1
    assert mixed.query_lens != tuple(sorted(mixed.query_lens))  # interleaved: reorder matters
    cascade = get_spec("cascade")
    assert cascade.num_reqs == 16 and cascade.common_prefix_len == 512
    assert len(set(cascade.seq_lens)) > 1


def test_quick_catalogue_is_small() -> None:
    assert max(max(s.seq_lens) for s in QUICK_CATALOGUE) <= 128
    assert sum(s.num_tokens for s in QUICK_CATALOGUE) < sum(s.num_tokens for s in CATALOGUE)


def test_cross_attention_first_step_is_no_decoder_context() -> None:
    spec = get_spec("encoder_decoder")
    assert spec.encoder_seq_lens is not None
    pairs = zip(spec.query_lens, spec.seq_lens, strict=True)
    assert spec.is_first_step == tuple(s == q for q, s in pairs)
    assert any(spec.is_first_step) and not all(spec.is_first_step)


def test_permuted_moves_every_field() -> None:
    spec = BatchSpec("x", (3, 1, 2), (3, 8, 9), encoder_seq_lens=(4, 5, 6))
    moved = spec.permuted([1, 2, 0])
    assert moved.query_lens == (1, 2, 3) and moved.seq_lens == (8, 9, 3)
    assert moved.encoder_seq_lens == (5, 6, 4) and moved.name == "x"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(query_lens=(), seq_lens=()), "at least one request"),
        (dict(query_lens=(1, 2), seq_lens=(3,)), "differ in length"),
        (dict(query_lens=(4,), seq_lens=(3,)), "query_len <= seq_len"),
        (dict(query_lens=(0,), seq_lens=(3,)), "query_len <= seq_len"),
        (dict(query_lens=(1,), seq_lens=(3,), encoder_seq_lens=(0,)), "encoder_seq_lens"),
        (dict(query_lens=(1, 1), seq_lens=(9, 4), common_prefix_len=4), "common_prefix_len"),
    ],
)
def test_rejects_inconsistent_specs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchSpec("bad", **kwargs)


def test_get_spec_unknown_name() -> None:
    with pytest.raises(KeyError, match="no catalogue entry"):
        get_spec("nope")
