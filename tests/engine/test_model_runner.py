"""ModelRunner: KV-cache groups, one metadata build per group per step, batch order, layers
registered with their builders, what the cascade decision is told."""

from __future__ import annotations

import pytest
import torch

from anyattn.config import BatchLimits
from anyattn.engine.model_runner import ModelRunner
from anyattn.engine.sampling_params import SamplingParams
from anyattn.layer import Attention


def test_gemma2_alternating_windows_make_two_groups_each_built_once_per_step(tiny_llm):
    llm, _ = tiny_llm("gemma2")
    groups = llm.runner.groups
    assert sorted(g.spec.sliding_window or 0 for g in groups) == [0, 4]
    assert sorted(len(g.layer_names) for g in groups) == [2, 2]
    builds = []
    for group in groups:
        build = group.builder.build

        def counting(*args, _build=build, _group=group, **kwargs):
            builds.append(_group)
            return _build(*args, **kwargs)

        group.builder.build = counting
    steps = []
    step = llm.step
    llm.step = lambda: steps.append(1) or step()
    llm.generate([[5, 6, 7, 8, 9], [11, 12]], SamplingParams(temperature=0, max_tokens=3))
    assert len(builds) == len(groups) * len(steps)


def test_decodes_run_first_and_logits_come_back_in_batch_order(tiny_llm, run_step):
    llm, _ = tiny_llm("llama")
    runner = llm.runner
    assert runner.groups[0].builder.reorder_batch_threshold == 1
    # request 0: a 6-token prefill; request 1: a decode with 5 tokens of context
    token_ids = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    tables = [[1, 2], [3, 4]]
    alone = [
        run_step(runner, [token_ids[0]], [0], [6], [tables[0]]).logits[0],
    ]
    run_step(runner, [token_ids[1]], [0], [5], [tables[1]])  # fill request 1's context
    alone.append(run_step(runner, [token_ids[1]], [5], [1], [tables[1]]).logits[0])
    out = run_step(runner, token_ids, [0, 5], [6, 1], tables)
    assert out.order == [1, 0]  # the decode was moved to the front
    assert out.sample_rows == [1, 0]
    by_request = dict(zip(out.sample_rows, out.logits, strict=True))
    for request in (0, 1):
        torch.testing.assert_close(by_request[request], alone[request], atol=1e-5, rtol=1e-5)


def test_each_builder_gets_the_record_of_every_layer_it_serves(tiny_llm):
    llm, _ = tiny_llm("gemma2")
    runner = llm.runner
    layers = {layer.layer_name: layer for layer in runner.model.attention_layers()}
    assert sum(len(group.builder.layers) for group in runner.groups) == len(layers) == 4
    for group in runner.groups:
        assert group.builder.layers == {
            name: layers[name].impl.layer_params() for name in group.layer_names
        }


def test_cascade_decision_gets_the_query_heads_and_the_sm_count(tiny_llm, run_step):
    llm, hf_model = tiny_llm("llama")
    runner = llm.runner
    builder = runner.groups[0].builder
    asked = []
    use_cascade_attention = builder.use_cascade_attention

    def spy(*args, **kwargs):
        asked.append(kwargs)
        return use_cascade_attention(*args, **kwargs)

    builder.use_cascade_attention = spy
    # two decodes whose contexts share engine block 1 (4 tokens): a common prefix of 4
    tokens = [[3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 9, 10]]
    run_step(runner, tokens, [5, 5], [1, 1], [[1, 2], [1, 3]])
    assert len(asked) == 1
    assert asked[0]["num_query_heads"] == hf_model.config.num_attention_heads == 4
    assert asked[0]["num_kv_heads"] == hf_model.config.num_key_value_heads == 1
    assert asked[0]["num_sms"] == runner.num_sms == 0  # CPU: no SM count
    assert asked[0]["use_alibi"] is False
    # a group with an ALiBi layer says so (a position-dependent bias rules cascade out)
    runner.groups[0].has_alibi = True
    run_step(runner, tokens, [5, 5], [1, 1], [[1, 2], [1, 3]])
    assert asked[1]["use_alibi"] is True


class _TwoLayers(torch.nn.Module):
    """Just what ModelRunner reads at set-up: the attention layers."""

    def __init__(self, alibi: list[list[float] | None]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            Attention(2, 8, 8**-0.5, 1, layer_name=f"l{i}", alibi_slopes=slopes, backend="TORCH")
            for i, slopes in enumerate(alibi)
        )

    def attention_layers(self):
        return iter(self.layers)


def make_runner(model: torch.nn.Module) -> ModelRunner:
    limits = BatchLimits(max_num_reqs=2, max_num_tokens=16, max_model_len=16)
    return ModelRunner(
        model, num_blocks=4, block_size=4, limits=limits, device=torch.device("cpu"),
        dtype=torch.float32,
    )  # fmt: skip


def test_a_group_has_alibi_when_any_of_its_layers_does():
    assert [g.has_alibi for g in make_runner(_TwoLayers([None, None])).groups] == [False]
    # (ALiBi is not part of the KV-cache spec: both layers share one group)
    assert [g.has_alibi for g in make_runner(_TwoLayers([None, [0.5, 0.25]])).groups] == [True]


def test_two_layers_of_one_name_are_refused():
    model = _TwoLayers([None, None])
    for layer in model.layers:
        layer.layer_name = "same"
    with pytest.raises(ValueError, match="names must be unique"):
        make_runner(model)
