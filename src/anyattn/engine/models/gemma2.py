"""Gemma2: the Llama graph with Gemma's changes.

- the token embedding is scaled by `sqrt(hidden_size)` (in the model dtype);
- RMSNorm scales by `1 + weight`;
- each layer norms the attention and MLP outputs as well as their inputs (four norms);
- the MLP is GeGLU (`gelu_pytorch_tanh`);
- scores are scaled by `query_pre_attn_scalar ** -0.5` and soft-capped;
- even layers use a sliding window, odd layers full attention (from `layer_types`);
- the output logits are soft-capped (`CausalLM.compute_logits`).

All but the first two are settings of `ModelConfig`; the norms are `DecoderLayer`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.base import CausalLM

__all__ = ["Gemma2ForCausalLM"]


class Gemma2ForCausalLM(CausalLM):
    has_gemma_norms = True

    def __init__(self, config: ModelConfig, **kwargs: object) -> None:
        super().__init__(config, **kwargs)
        # transformers rounds sqrt(hidden_size) to fp32 first, then to the model dtype.
        normalizer = torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer(
            "embed_scale", normalizer.to(dtype=self.dtype, device=self.device), persistent=False
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_weight) * self.embed_scale
