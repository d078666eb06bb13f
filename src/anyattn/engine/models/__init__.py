"""Model families over anyattn's attention layer, and `build_model` to pick one from a config.

Every model has the `CausalLM` interface (`forward`, `compute_logits`, `attention_layers`,
`load_weights`) and loads Hugging Face parameter names and layouts.
"""

from __future__ import annotations

from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.base import CausalLM, LlamaForCausalLM
from anyattn.engine.models.deepseek import DeepseekForCausalLM
from anyattn.engine.models.gemma2 import Gemma2ForCausalLM

__all__ = [
    "MODEL_REGISTRY",
    "CausalLM",
    "DeepseekForCausalLM",
    "Gemma2ForCausalLM",
    "LlamaForCausalLM",
    "build_model",
]

# Mistral is Llama with a sliding window and Qwen2 Llama with q/k/v biases: both are settings of
# ModelConfig, not separate graphs; so are DeepSeek-V2 and V3 (their routing differs).
MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
}


def build_model(config: ModelConfig, **kwargs: object) -> CausalLM:
    """The model of `config.architecture` (`CausalLM`'s keyword arguments; parameters left
    uninitialised); ValueError lists the known architectures."""
    model_cls = MODEL_REGISTRY.get(config.architecture)
    if model_cls is None:
        raise ValueError(
            f"build_model: unsupported architecture (got {config.architecture!r}, expected one "
            f"of {', '.join(MODEL_REGISTRY)})."
        )
    return model_cls(config, **kwargs)
