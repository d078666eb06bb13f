"""anyattn.measure.steps: the timed steps come from the engine's limits, exactly."""

from __future__ import annotations

import pytest

from anyattn.config import AttentionSelectorConfig, BatchLimits
from anyattn.measure import Phase, measurement_steps

CONFIG = AttentionSelectorConfig(head_size=64, dtype="float32", num_heads=4, num_kv_heads=2)


def shapes(limits: BatchLimits) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    return [(s.phase.value, s.query_lens, s.seq_lens) for s in measurement_steps(CONFIG, limits)]


def test_engine_default_limits_give_the_issue_recipe():
    # decode at 1, max/4 and max requests x contexts 1024 and max_model_len / 2; one prefill
    # of the token budget; one mixed step of max/2 decodes and a chunk filling the budget.
    assert shapes(BatchLimits(16, 1024, 4096)) == [
        ("decode", (1,), (1025,)),
        ("decode", (1,), (2049,)),
        ("decode", (1,) * 4, (1025,) * 4),
        ("decode", (1,) * 4, (2049,) * 4),
        ("decode", (1,) * 16, (1025,) * 16),
        ("decode", (1,) * 16, (2049,) * 16),
        ("prefill", (1024,), (1024,)),
        ("mixed", (1,) * 8 + (1016,), (2049,) * 8 + (2040,)),
    ]


def test_small_limits_clip_lengths_and_drop_duplicates():
    assert shapes(BatchLimits(4, 32, 64)) == [
        ("decode", (1,), (64,)),
        ("decode", (1,), (33,)),
        ("decode", (1,) * 4, (64,) * 4),
        ("decode", (1,) * 4, (33,) * 4),
        ("prefill", (32,), (32,)),
        ("mixed", (1, 1, 30), (33, 33, 46)),
    ]
    # One request per step: max/4 == max == 1, and the mixed step is a chunk alone.
    assert shapes(BatchLimits(1, 8, 16)) == [
        ("decode", (1,), (16,)),
        ("decode", (1,), (9,)),
        ("prefill", (8,), (8,)),
        ("mixed", (8,), (12,)),
    ]


def test_budget_over_model_len_prefills_several_requests_and_respects_every_limit():
    limits = BatchLimits(8, 100, 40, num_speculative_tokens=1)
    steps = measurement_steps(CONFIG, limits)
    prefill = next(s for s in steps if s.phase is Phase.PREFILL)
    assert prefill.query_lens == (40, 40, 20) == prefill.seq_lens
    decodes = [s for s in steps if s.phase is Phase.DECODE]
    assert {q for s in decodes for q in s.query_lens} == {2}  # 1 + num_speculative_tokens
    for step in steps:
        assert step.num_reqs <= limits.max_num_reqs
        assert step.num_tokens <= limits.max_num_tokens
        assert max(step.seq_lens) <= limits.max_model_len
        assert len({s.name for s in steps}) == len(steps)


def test_encoder_attention_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="attn_type encoder, expected decoder"):
        measurement_steps(CONFIG.replace(attn_type="encoder"), BatchLimits(4, 32, 64))
