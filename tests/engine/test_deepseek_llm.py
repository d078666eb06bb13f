"""DeepSeek-V2/V3 through the whole engine (TORCH_MLA on the CPU): greedy tokens against
transformers' over chunked prefills with a token budget smaller than the prompts, under KV
pressure that preempts, and `anyattn generate` on a folder with the default model's tokenizer."""

from __future__ import annotations

import shutil

import pytest
import torch

from anyattn.cli import main
from anyattn.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

KINDS = ("deepseek_v2", "deepseek_v2_group", "deepseek_v3", "deepseek_v3_512")
PROMPTS = [[5, 9, 17, 33, 2, 80, 41, 7, 7, 150, 3], [99], [12, 13, 14, 15, 16, 17, 18]]


def _hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """Argmax decoding with transformers, the whole sequence recomputed every token; fails on
    a near-tie (top-2 gap under 1e-4), where two correct paths may part."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = hf_model(input_ids=torch.tensor([ids])).logits[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > 1e-4, f"near-tie after {ids}"
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _greedy(llm, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers_over_chunked_prefill(tiny_llm, kind):
    # a budget of 7 tokens, below the 11-token prompt: it is prefilled in chunks, and decodes
    # share steps with the other prompts' chunks
    llm, hf_model = tiny_llm(kind, max_num_batched_tokens=7)
    assert llm.backend_names == ["TORCH_MLA"]
    for prompt, tokens in zip(PROMPTS, _greedy(llm, PROMPTS, 8), strict=True):
        assert tokens == _hf_greedy(hf_model, prompt, 8)


def test_kv_pressure_preempts_and_still_matches_transformers(tiny_llm):
    prompts = [[3 + i, 40 + i, 7, 9, 11, 60 + i, 2] * 2 for i in range(4)]
    # 4-token blocks of 3 layers x one latent row (48 + 16) x 4 bytes: 3072 bytes a block;
    # 12 blocks hold about two of these 24-token sequences at a time
    llm, hf_model = tiny_llm("deepseek_v3", kv_cache_memory=12 * 3072, max_num_seqs=4)
    assert llm.runner.kv_caches["model.layers.0.self_attn"].shape[0] == 12 + 1  # + null block
    got = _greedy(llm, prompts, 10)
    assert llm.scheduler.num_preemptions > 0
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == _hf_greedy(hf_model, prompt, 10)


@pytest.fixture
def default_tokenizer_folder(tiny_hf_model, tmp_path):
    """A DeepSeek-V2 folder whose vocabulary is the default model's, with its tokenizer."""
    from anyattn.engine.default_model import default_model_path
    from anyattn.engine.gguf_loader import load_gguf_tokenizer

    try:
        gguf = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    folder, hf_model = tiny_hf_model("deepseek_v2_vocab49152")
    target = shutil.copytree(folder, tmp_path / "deepseek")
    tokenizer = load_gguf_tokenizer(gguf, cache_dir=tmp_path / "cache")
    assert len(tokenizer) == hf_model.config.vocab_size
    tokenizer.save_pretrained(target)
    return target, tokenizer, hf_model


def test_generate_runs_a_deepseek_folder_and_names_each_layers_mla_backend(
    default_tokenizer_folder, capsys
):
    folder, tokenizer, hf_model = default_tokenizer_folder
    argv = ["generate", "Hello there", "--model", str(folder), "--max-tokens", "5"]
    assert main([*argv, "--device", "cpu", "-v"]) == 0
    captured = capsys.readouterr()
    assert "model deepseek: 3 attention layers on cpu, float32; attention backend: TORCH_MLA" in (
        captured.err
    )
    assert "backend per layer: 0-2 TORCH_MLA (MLA)\n" in captured.err
    assert "selection for model.layers.0.self_attn (and layers like it):" in captured.err
    assert "  TORCH_MLA: chosen" in captured.err
    prompt = tokenizer.encode("Hello there")
    expected = tokenizer.decode(_hf_greedy(hf_model, prompt, 5))
    assert captured.out == expected + "\n"
