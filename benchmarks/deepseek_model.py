"""A random DeepSeek-V3-shaped model for the engine's GPU check (`deepseek_gpu_check.py`), built
offline with transformers on the CPU.

`save_random_deepseek_v3(folder, seed)` writes a Hugging Face folder (config.json, bf16
safetensors, a word-level tokenizer "t0 t1 ...") that `anyattn.engine.llm.LLM` loads. The
weights are drawn in float32 with `seed` and stored in bfloat16; every run, float32 or bfloat16,
reads them from the folder, so runs in the two dtypes differ in their arithmetic only.

The shape (`V3_CONFIG`) is DeepSeek-V3's where it matters to attention and routing, small
elsewhere (2 layers, hidden 256, vocab 512; ~7.9M parameters, ~16 MB in bf16):
- MLA as V3 has it: low-rank query (`q_lora_rank` 128 here, 1536 in V3), latent 512 + rope 64,
  `qk_nope_head_dim` 128, `v_head_dim` 128 (the split FLASHINFER_MLA takes), 16 heads,
  interleaved rope pairs (`rope_interleave`).
- V3's YaRN exactly: factor 40 over 4096 original positions, beta 32 / 1, mscale and
  mscale_all_dim 1 (attention factor 1, softmax scale times `mscale(40, 1)^2`).
- V3's routing: sigmoid scores plus `e_score_correction_bias` (randomised: zeros would hide a
  missing bias), 16 routed experts of 64 in 4 groups, the best 2 groups kept, top-4,
  renormalised, times 2.5; one shared expert; layer 0 dense (`first_k_dense_replace` 1).
- Norm weights randomised around 1 (their default ones would hide a misplaced norm);
  `initializer_range` 0.06 keeps activations O(1) at hidden 256.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["V3_CONFIG", "save_random_deepseek_v3"]

V3_CONFIG: dict = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    # transformers' V3 eager attention needs as many KV heads as query heads
    "num_key_value_heads": 16,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    # transformers' config holds the rope size as head_dim
    "head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_interleave": True,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.06,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}


def save_random_deepseek_v3(folder: Path, seed: int = 0) -> None:
    """Write the random model of `V3_CONFIG` drawn with `seed` into `folder` (bf16 weights);
    load it with `AutoModelForCausalLM.from_pretrained(folder, dtype=...)` to run it."""
    import transformers
    from engine_model import save_word_tokenizer

    config = transformers.DeepseekV3Config(**V3_CONFIG)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(0.1 * torch.randn(buffer.shape, generator=generator))
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    save_word_tokenizer(folder, V3_CONFIG["vocab_size"])
