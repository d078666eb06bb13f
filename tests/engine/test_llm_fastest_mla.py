"""LLM(backend="fastest") on a DeepSeek model: the static order loads its MLA layers on a slow
registered test MLA backend, the measurement chooses TORCH_MLA, every MLA layer moves onto it
(`MLAAttention.use_backend`), and greedy tokens still match transformers'."""

from __future__ import annotations

import time
from types import MappingProxyType

import pytest

from anyattn.backends.torch_mla import TorchMLAImpl
from anyattn.engine.sampling_params import SamplingParams

pytest.importorskip("transformers")

PROMPTS = [[5, 9, 17, 33, 2, 80, 41, 7, 7, 150, 3], [12, 13, 14, 15, 16, 17, 18]]
MAX_TOKENS = 4


class SlowMLAImpl(TorchMLAImpl):
    """TORCH_MLA's results, 5 ms late on every call: right, and clearly the slower one."""

    def forward_mqa(self, *args, **kwargs):
        time.sleep(0.005)
        super().forward_mqa(*args, **kwargs)

    def forward_mha(self, *args, **kwargs):
        time.sleep(0.005)
        super().forward_mha(*args, **kwargs)


def test_fastest_moves_mla_layers_off_the_static_choice(tiny_llm, register_mla_variant, hf_logits):
    # ranked before TORCH_MLA in the static order
    register_mla_variant("TEST_SLOW_MLA", SlowMLAImpl, priority=MappingProxyType({"cpu": -1}))
    static, _ = tiny_llm("deepseek_v2", max_num_seqs=2, max_num_batched_tokens=8)
    assert static.backend_names == ["TEST_SLOW_MLA"]
    llm, hf_model = tiny_llm(
        "deepseek_v2", backend="fastest", max_num_seqs=2, max_num_batched_tokens=8,
        max_model_len=32,
    )  # fmt: skip
    assert llm.backend_names == ["TORCH_MLA"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        ids = list(prompt)
        for _ in range(MAX_TOKENS):  # transformers' greedy continuation, one token at a time
            top2 = hf_logits(hf_model, ids)[-1].topk(2)
            assert top2.values[0] - top2.values[1] > 1e-4, f"near-tie after {ids}"
            ids.append(int(top2.indices[0]))
        assert output.outputs[0].token_ids == ids[len(prompt) :]
