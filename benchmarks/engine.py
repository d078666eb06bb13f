"""anyattn's engine against `transformers.generate` on the default model, on this machine.

Same GGUF weights (dequantised to float32), greedy decoding with EOS ignored, 128 new tokens,
batch 1 and batch 8 (eight different prompts). Prints the best tokens/s of each over
`--repeats` interleaved runs, and the ratio.

Run: `.venv/bin/python benchmarks/engine.py [--new-tokens N] [--batches 1 8]`.
"""

from __future__ import annotations

import argparse
import time

import torch

from anyattn.engine.default_model import default_model_path
from anyattn.engine.llm import LLM
from anyattn.engine.sampling_params import SamplingParams

PROMPTS = [
    "The history of the printing press",
    "Write a short poem about the sea.",
    "Explain how a compiler works.",
    "List three facts about Mars.",
    "What makes a good cup of coffee?",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "Give advice to a new programmer.",
]


def _hf_tokens_per_s(model, tokenizer, prompts: list[str], new_tokens: int) -> float:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            **batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)
    return generated / elapsed


def _anyattn_tokens_per_s(llm: LLM, prompts: list[str], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs each")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    llm = LLM(path, dtype=torch.float32, device="cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, {path.name}")
    print(f"{'batch':>5} {'anyattn tok/s':>14} {'transformers tok/s':>19} {'ratio':>6}")
    for size in args.batches:
        prompts = (PROMPTS * (size // len(PROMPTS) + 1))[:size]
        # one short warm-up each, so first-call costs do not count
        _anyattn_tokens_per_s(llm, prompts, 4)
        _hf_tokens_per_s(hf_model, hf_tok, prompts, 4)
        # best of N, the two sides interleaved so that both see the same background load
        ours = theirs = 0.0
        for _ in range(args.repeats):
            ours = max(ours, _anyattn_tokens_per_s(llm, prompts, args.new_tokens))
            theirs = max(theirs, _hf_tokens_per_s(hf_model, hf_tok, prompts, args.new_tokens))
        print(f"{size:>5} {ours:>14.1f} {theirs:>19.1f} {ours / theirs:>6.2f}")


if __name__ == "__main__":
    main()
