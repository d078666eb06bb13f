"""TORCH against the float64 oracle on random batch layouts (hypothesis).

Each example draws a batch (decodes, fresh and chunked prefills, spec-decode-sized queries),
a block size, a layout, head counts and score modifiers; the kit builds the shuffled paged
cache (a fresh block permutation per seed) and judges the output with docs/semantics.md's tolerance.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyattn.backends.torch_attn import TorchAttentionBackend
from anyattn.testing import BatchSpec, run_case
from anyattn.testing.cases import Case
from anyattn.types import KVCacheLayout


@st.composite
def _batches(draw) -> BatchSpec:
    num_reqs = draw(st.integers(1, 6))
    query_lens, seq_lens = [], []
    for _ in range(num_reqs):
        kind = draw(st.sampled_from(["decode", "spec", "fresh", "chunked"]))
        query_len = {"decode": 1, "spec": draw(st.integers(2, 4))}.get(kind)
        if query_len is None:
            query_len = draw(st.integers(1, 40))
        context = 0 if kind == "fresh" else draw(st.integers(0, 70))
        query_lens.append(query_len)
        seq_lens.append(context + query_len)
    return BatchSpec("random", tuple(query_lens), tuple(seq_lens))


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    spec=_batches(),
    block_size=st.sampled_from([1, 3, 16, 64]),
    layout=st.sampled_from(list(KVCacheLayout)),
    heads=st.sampled_from([(4, 4), (4, 2), (8, 1)]),
    head_size=st.sampled_from([16, 64]),
    modifier=st.sampled_from(["none", "window", "soft_cap", "alibi", "sinks", "non_causal"]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    check_lse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_torch_matches_the_oracle_on_random_layouts(
    spec, block_size, layout, heads, head_size, modifier, dtype, check_lse, seed
):
    num_heads, num_kv_heads = heads
    case = Case(
        "random",
        modifier,
        spec,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        layout=layout,
        sliding_window=5 if modifier == "window" else None,
        logits_soft_cap=3.0 if modifier == "soft_cap" else None,
        use_alibi=modifier == "alibi",
        use_sinks=modifier == "sinks",
        causal=modifier != "non_causal",
        check_lse=check_lse,
        num_padding_tokens=seed % 3,
    )
    results = run_case(TorchAttentionBackend, case, "cpu", dtype, seed=seed)
    failed = [r for r in results if not r.passed]
    assert not failed, [(r.name, r.max_error, r.bound, r.detail) for r in failed]
