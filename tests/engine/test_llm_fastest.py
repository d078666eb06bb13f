"""LLM(backend="fastest"): each layer config is measured under the engine's limits (real CPU
timing, cached), the layers run on the choice, and greedy tokens still match transformers."""

from __future__ import annotations

import torch

from anyattn.engine.sampling_params import SamplingParams
from anyattn.measure import cache_dir

PROMPTS = [[5, 9, 17, 33, 2, 80, 41, 7, 7, 150, 3], [99], [12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """Argmax decoding with transformers' model, one token at a time (no EOS handling)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids.append(int(hf_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_fastest_measures_once_caches_and_matches_transformers(tiny_llm):
    kwargs = dict(backend="fastest", max_num_batched_tokens=7, max_num_seqs=3, max_model_len=64)
    llm, hf_model = tiny_llm("llama", **kwargs)
    assert set(llm.backend_names) <= {"TORCH", "FLEX_ATTENTION"}
    entries = list((cache_dir() / "measure").glob("*.json"))
    assert len(entries) == 1  # one distinct layer config
    stamp = entries[0].stat().st_mtime_ns
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.outputs[0].token_ids == _hf_greedy(hf_model, prompt, 6)
    again, _ = tiny_llm("llama", **kwargs)  # read from the cache: nothing rewritten
    assert again.backend_names == llm.backend_names
    assert entries[0].stat().st_mtime_ns == stamp
