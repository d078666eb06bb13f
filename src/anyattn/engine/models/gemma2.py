"""Gemma2: the Llama graph with the token embedding scaled by `sqrt(hidden_size)`, RMSNorm
scaling by `1 + weight`, and four norms per layer (`DecoderLayer.has_sandwich_norms`); GeGLU,
score scale and soft caps, and the sliding layers are settings of `ModelConfig`.
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
