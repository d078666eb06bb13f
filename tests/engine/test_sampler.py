"""Sampler: greedy is argmax, filters reduce to greedy at their limits, seeds are per request,
and many draws follow the filtered softmax (chi-square bound, fixed seeds)."""

from __future__ import annotations

import pytest
import torch

from anyattn.engine.sampler import Sampler, make_generator
from anyattn.engine.sampling_params import SamplingParams

sampler = Sampler()


def random_logits(num_reqs: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_reqs, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def chi_square(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * samples.numel()
    assert torch.all(counts[expected == 0] == 0), "sampled a token of probability 0"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def draw_many(logits_row: torch.Tensor, params: SamplingParams, num_samples: int) -> torch.Tensor:
    """num_samples draws for one row: a batch of identical rows, each with its own seed."""
    logits = logits_row.expand(num_samples, -1).contiguous()
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(num_samples)]
    return torch.tensor(sampler(logits, [params] * num_samples, generators))


# With 5 degrees of freedom, P(chi2 > 30) is about 1.5e-5; the draws are seeded, so this is
# a fixed check, not a flaky one. A wrong distribution scores in the hundreds (checked below).
CHI2_BOUND_5_DOF = 30.0


def test_greedy_is_argmax_with_first_index_on_ties() -> None:
    logits = random_logits(8, 100)
    logits[3, 10] = logits[3, 70] = logits[3].max() + 1.0
    tokens = sampler(logits, [SamplingParams(temperature=0)] * 8, [None] * 8)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[3] == 10


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_k=1, temperature=5.0, top_p=0.9),
        SamplingParams(top_p=1e-6),
        SamplingParams(temperature=1e-7),
    ],
    ids=["top_k_1", "top_k_1_hot", "top_p_tiny", "tiny_temperature"],
)
def test_limits_reduce_to_greedy(params: SamplingParams) -> None:
    logits = random_logits(16, 500, seed=1)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1.0  # a tie: same winner as argmax
    generators = [torch.Generator().manual_seed(i) for i in range(16)]
    assert sampler(logits, [params] * 16, generators) == logits.argmax(dim=-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = random_logits(6, 50, seed=2)
    params = [SamplingParams(temperature=0), SamplingParams(seed=1)] * 3
    generators = [make_generator(p, "cpu") for p in params]
    tokens = sampler(logits, params, generators)
    assert tokens[0::2] == logits[0::2].argmax(dim=-1).tolist()
    assert all(0 <= t < 50 for t in tokens)


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    vocab = 64
    target = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    row = random_logits(1, vocab, seed=3)
    alone_gen = make_generator(target, "cpu")
    alone = [sampler(row, [target], [alone_gen])[0] for _ in range(20)]
    # Same request at another position, among greedy, unseeded and differently seeded rows.
    others = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(seed=7, top_p=0.5)]
    batched_gen = make_generator(target, "cpu")
    other_gens = [None, None, make_generator(others[2], "cpu")]
    batched = []
    for step in range(20):
        logits = torch.cat([random_logits(2, vocab, seed=100 + step), row, random_logits(1, vocab)])
        params = [others[0], others[1], target, others[2]]
        gens = [other_gens[0], other_gens[1], batched_gen, other_gens[2]]
        batched.append(sampler(logits, params, gens)[2])
    assert batched == alone
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_rows_sample_valid_tokens() -> None:
    tokens = sampler(random_logits(4, 30), [SamplingParams()] * 4, [None] * 4)
    assert len(tokens) == 4 and all(0 <= t < 30 for t in tokens)


def test_distribution_matches_tempered_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    params = SamplingParams(temperature=0.7)
    samples = draw_many(logits, params, 12_000)
    assert chi_square(samples, torch.softmax(logits / 0.7, dim=-1)) < CHI2_BOUND_5_DOF
    # The check has power: the untempered softmax is rejected by a wide margin.
    assert chi_square(samples, torch.softmax(logits, dim=-1)) > 10 * CHI2_BOUND_5_DOF


def test_top_k_distribution_renormalised_over_the_k_best() -> None:
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9, 1.2, 0.1])
    samples = draw_many(logits, SamplingParams(top_k=3), 9_000)
    expected = torch.zeros(7)
    expected[[1, 3, 5]] = torch.softmax(logits[[1, 3, 5]], dim=-1)
    assert set(samples.tolist()) == {1, 3, 5}
    assert chi_square(samples, expected) < CHI2_BOUND_5_DOF  # 2 dof: an even looser bound


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    # 0.5 < 0.7 <= 0.5 + 0.3: the nucleus is {1, 3}, renormalised to 0.625 / 0.375.
    samples = draw_many(logits, SamplingParams(top_p=0.7), 8_000)
    expected = torch.tensor([0.0, 0.625, 0.0, 0.375])
    assert set(samples.tolist()) == {1, 3}
    assert chi_square(samples, expected) < CHI2_BOUND_5_DOF
    # top_k first, then top_p over the survivors: {1, 3} -> 0.625, 0.375; p 0.6 keeps only 1.
    two = draw_many(logits, SamplingParams(top_k=2, top_p=0.6), 200)
    assert set(two.tolist()) == {1}


def test_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="one entry per logits row"):
        sampler(random_logits(2, 10), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"float tensor \[num_reqs, vocab_size\]"):
        sampler(torch.zeros(10), [SamplingParams()], [None])
    assert sampler(torch.zeros(0, 10), [], []) == []


def test_make_generator() -> None:
    assert make_generator(SamplingParams(), "cpu") is None
    a = make_generator(SamplingParams(seed=5), "cpu")
    b = make_generator(SamplingParams(seed=5), "cpu")
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
