"""The embedded SmolLM2-135M-Instruct GGUF: anyattn against transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from anyattn.engine.default_model import default_model_path
from anyattn.engine.llm import LLM
from anyattn.engine.sampling_params import SamplingParams
from anyattn.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a child in one paragraph.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def both():
    try:
        path = default_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    llm = LLM(path, dtype=torch.float32, device="cpu")
    return llm, hf_model


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_and_logits_agree(both, run_step):
    llm, hf_model = both
    prompts = [llm.encode_prompt(p, chat=True) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        with torch.inference_mode():
            full = torch.tensor([prompt + ours])
            hf_logits = hf_model(input_ids=full).logits[0]
        # transformers' greedy choice at every position we generated
        theirs = hf_logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        if ours != theirs:
            first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
            top2 = hf_logits[len(prompt) - 1 + first].topk(2).values
            gap = float(top2[0] - top2[1])
            pytest.fail(f"token {first} differs (transformers' top-2 gap {gap:.2e})")
        # our logits for the whole sequence's last position, through the engine's own blocks
        # (a prefix-cache hit reuses the KV computed during generation)
        ids = prompt + ours
        seq = Sequence(-1, ids, params)
        assert llm.block_manager.allocate(seq, len(ids))
        try:
            new = len(ids) - seq.num_computed_tokens
            step = run_step(llm.runner, [ids], [seq.num_computed_tokens], [new], [seq.block_table])
        finally:
            llm.block_manager.free(seq)
        assert (step.logits[0] - hf_logits[-1].float()).abs().max().item() < 1e-3


@pytest.mark.slow
def test_chat_stream_produces_text(both):
    llm, _ = both
    params = SamplingParams(temperature=0, max_tokens=8)
    text = "".join(llm.stream("Say hello.", params, chat=True))
    assert text.strip()
