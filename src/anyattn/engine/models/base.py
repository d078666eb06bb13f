"""`CausalLM`: the decoder-only skeleton every family shares (token embedding, decoder layers,
final norm, tied or own LM head, one RoPE table, loading by Hugging Face parameter name); the
engine relies on `forward`, `compute_logits`, `attention_layers` and `load_weights`.

Its layers are the Llama graph's, which serves Llama 2/3, SmolLM2, Mistral and Qwen2 alike
(they differ only in what `ModelConfig` records); Gemma2 and DeepSeek change parts of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from anyattn.backend import AttentionBackend
from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.layers import (
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    SelfAttention,
    Slots,
)
from anyattn.engine.models.linear import Linear
from anyattn.engine.models.rope import RotaryEmbedding
from anyattn.engine.models.weights import WeightSlot, empty_param, load_into_slots
from anyattn.types import parse_cache_dtype, parse_dtype

__all__ = ["CausalLM", "LlamaForCausalLM"]


class CausalLM(nn.Module):
    """A decoder-only language model over anyattn's paged attention, Llama's layers unless a
    subclass sets `has_gemma_norms` or overrides `make_layer`.

    `block_size`, `backend` (None: the selector chooses) and `kv_cache_dtype` go to every
    `Attention`; `max_positions` is the RoPE table's length (default: the model's context).
    ValueError: a bad dtype, or no backend serves a layer.
    """

    # Gemma's norms: scales `1 + w`, and four per layer (`DecoderLayer.has_sandwich_norms`).
    has_gemma_norms = False
    # False when a step cannot be captured in a CUDA graph (the runner then runs eagerly).
    supports_cuda_graphs = True

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        backend: str | type[AttentionBackend] | None = None,
        kv_cache_dtype: str = "auto",
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        api = type(self).__name__
        self.config = config
        self.dtype = parse_dtype(dtype, argument=f"{api}: dtype")
        self.device = torch.device(device)
        kv_cache_dtype = parse_cache_dtype(kv_cache_dtype, argument=f"{api}: kv_cache_dtype")
        factory = {"dtype": self.dtype, "device": self.device}
        self.lm_head = Linear(config.hidden_size, config.vocab_size, **factory)
        if config.tie_word_embeddings:
            # a lookup gathers rows: from the head's row-major copy if it has one
            rows = self.lm_head.weight_rows
            self.embed_weight = self.lm_head.weight if rows is None else rows
        else:
            self.embed_weight = empty_param(config.vocab_size, config.hidden_size, **factory)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
            max_positions=max_positions or config.max_position_embeddings,
            **factory,
        )
        attn_kwargs = {
            "block_size": block_size,
            "backend": backend,
            "kv_cache_dtype": kv_cache_dtype,
            **factory,
        }
        self.layers = nn.ModuleList(
            [self.make_layer(i, attn_kwargs) for i in range(config.num_hidden_layers)]
        )
        self.layer_names = [attn.layer_name for attn in self.attention_layers()]
        self.norm = RMSNorm(
            config.hidden_size,
            config.rms_norm_eps,
            has_unit_offset=self.has_gemma_norms,
            **factory,
        )

    def make_layer(self, index: int, attn_kwargs: dict[str, object]) -> nn.Module:
        """Decoder layer `index`: called as `layer(hidden, (cos, sin), kv_cache, attn_metadata)`,
        with `weight_slots(prefix)`; its attention layer is the one `attention_layers` lists
        (by default `.self_attn.attn`)."""
        return DecoderLayer(
            self.config,
            SelfAttention(self.config, index, attn_kwargs),
            self.dense_mlp(),
            has_sandwich_norms=self.has_gemma_norms,
            dtype=self.dtype,
            device=self.device,
        )

    def dense_mlp(self) -> GatedMLP:
        """The gated MLP of a (dense) decoder layer."""
        config = self.config
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            has_bias=config.mlp_bias,
            dtype=self.dtype,
            device=self.device,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 `[num_tokens]` -> `[num_tokens, hidden_size]`."""
        return F.embedding(input_ids, self.embed_weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Mapping[str, object],
        kv_caches: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """Run one step: int64 `input_ids` and `positions` `[num_tokens]` (requests back to
        back), metadata and KV cache by layer name -> final hidden states `[num_tokens,
        hidden_size]` (after the last norm)."""
        hidden = self.embed(input_ids)  # [num_tokens, hidden_size]
        cos_sin = self.rotary(positions)  # cos and sin, [num_tokens, 1, head_size] each
        for layer, name in zip(self.layers, self.layer_names, strict=True):
            hidden = layer(hidden, cos_sin, kv_caches[name], attn_metadata[name])
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: `[n, hidden_size]` -> float32 logits `[n, vocab_size]`, final soft cap
        applied."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[nn.Module]:
        """Every attention layer (`Attention`, or `MLAAttention` for MLA models), in order;
        names are `model.layers.<i>.self_attn.attn` unless a family says otherwise."""
        return [layer.self_attn.attn for layer in self.layers]

    def weight_slots(self) -> Slots:
        """Every tensor the model needs, by Hugging Face name."""
        tied = self.config.tie_word_embeddings
        if tied:
            yield from self.lm_head.weight_slots({"model.embed_tokens": slice(None)})
        else:
            yield "model.embed_tokens.weight", WeightSlot(self.embed_weight)
        for i, layer in enumerate(self.layers):
            yield from layer.weight_slots(f"model.layers.{i}")
        yield from self.norm.weight_slots("model.norm")
        if not tied:
            yield from self.lm_head.weight_slots({"lm_head": slice(None)})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a checkpoint (Hugging Face names and layouts) into the model, casting to its
        dtype (tensors `is_skipped_weight` names are skipped). ValueError names the missing,
        unexpected and mis-shaped tensors."""
        slots = dict(self.weight_slots())
        api = f"{type(self).__name__}.load_weights"
        load_into_slots(api, slots, weights, self.is_skipped_weight)

    def is_skipped_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor without a slot is expected and skipped: rotary caches,
        and an LM head next to tied embeddings."""
        tied = self.config.tie_word_embeddings
        return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


class LlamaForCausalLM(CausalLM):
    """Llama, SmolLM2, Mistral and Qwen2 (see `CausalLM`)."""
