"""Random-weight Llama models for the engine benchmarks, built offline with transformers.

`save_random_llama(folder, preset, dtype)` writes a Hugging Face folder (config.json,
safetensors, a word-level tokenizer "t0 t1 ...") that `anyattn.engine.llm.LLM` loads, and
returns the transformers model on the same weights (the reference contender). Weights are drawn
with a fixed seed, so two calls with the same preset give the same model.

Presets:
    llama-1b: hidden 2048, 16 layers, 32 query / 8 KV heads of 64, intermediate 5632, vocab
        32000 (~1.2B parameters), the GPU benchmark model.
    tiny: hidden 64, 16 layers, 4 query / 1 KV heads of 16, intermediate 128, vocab 1000: the
        same depth (so the same number of layer calls per step) at a width whose compute is
        negligible on the CPU, for host-time measurements.
    micro: hidden 64, 2 layers, 4 / 2 heads of 16, vocab 256: smoke tests.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["PRESETS", "save_random_llama", "save_word_tokenizer"]

PRESETS: dict[str, dict] = {
    "llama-1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
    },
    "micro": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "max_position_embeddings": 2048,
    },
}


def save_random_llama(
    folder: Path, preset: str, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.nn.Module:
    """Write a random Llama of `preset` into `folder` and return it (eval mode, on the CPU).

    The weights are initialised in float32 with `seed` and then cast to `dtype`, so the fp32 and
    bf16 models of one preset share their weights up to rounding.
    """
    import transformers

    sizes = PRESETS[preset]
    config = transformers.LlamaConfig(**sizes, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(dtype).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    save_word_tokenizer(folder, sizes["vocab_size"])
    return model


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """Write a word-level tokenizer of `vocab_size` words "t0 t1 ..." into `folder` (t0 unknown
    and padding, t1 end of text): what `LLM` needs to load a folder whose prompts are token ids."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", eos_token="t1", pad_token="t0"
    )
    fast.save_pretrained(folder)
