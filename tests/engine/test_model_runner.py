"""ModelRunner: KV-cache groups, one metadata build per group per step, batch order."""

from __future__ import annotations

import torch

from anyattn.engine.sampling_params import SamplingParams


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


def test_decodes_run_first_and_logits_come_back_in_batch_order(tiny_llm):
    llm, _ = tiny_llm("llama")
    runner = llm.runner
    assert runner.groups[0].builder.reorder_batch_threshold == 1
    # request 0: a 6-token prefill; request 1: a decode with 5 tokens of context
    token_ids = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    tables = [[1, 2], [3, 4]]
    alone = [
        runner.execute([token_ids[0]], [0], [6], [tables[0]], [True]).logits[0],
    ]
    runner.execute([token_ids[1]], [0], [5], [tables[1]], [False])  # fill request 1's context
    alone.append(runner.execute([token_ids[1]], [5], [1], [tables[1]], [True]).logits[0])
    out = runner.execute(token_ids, [0, 5], [6, 1], tables, [True, True])
    assert out.order == [1, 0]  # the decode was moved to the front
    assert out.sample_rows == [1, 0]
    by_request = dict(zip(out.sample_rows, out.logits, strict=True))
    for request in (0, 1):
        torch.testing.assert_close(by_request[request], alone[request], atol=1e-5, rtol=1e-5)
