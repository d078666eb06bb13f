"""SamplingParams: defaults, normalisation, and a clear error for every bad field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from anyattn.engine.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_tokens) == (1.0, 0, 1.0, None, 16)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ((), (), False)
    assert not p.is_greedy


def test_frozen_and_hashable() -> None:
    p = SamplingParams(temperature=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(temperature=0.0))
    assert p.is_greedy and isinstance(p.temperature, float)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, ()), ("###", ("###",)), (["a", "b"], ("a", "b")), (("a",), ("a",))],
)
def test_stop_normalised_to_tuple(stop: object, expected: tuple[str, ...]) -> None:
    assert SamplingParams(stop=stop).stop == expected  # type: ignore[arg-type]


def test_lists_and_off_values_normalised() -> None:
    p = SamplingParams(stop_token_ids=[2, 7], top_k=-1, seed=np.int64(3))  # type: ignore[arg-type]
    assert p.stop_token_ids == (2, 7)
    assert p.top_k == 0
    assert p.seed == 3 and type(p.seed) is int
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # type: ignore[arg-type]
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": False}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_invalid_field_rejected_with_clear_message(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams: {field} must be .* \(got .*\)\."):
        SamplingParams(**kwargs)


def test_valid_edges_accepted() -> None:
    SamplingParams(temperature=0, top_k=1, top_p=1e-9, seed=-(2**63), max_tokens=1)
    SamplingParams(temperature=100.0, top_k=1_000_000, top_p=1, seed=2**64 - 1)
