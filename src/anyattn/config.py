"""Explicit configuration: what a layer asks of a backend, and the engine's batch limits.

No global "current config" exists in anyattn: the selector takes an `AttentionSelectorConfig`,
builders take a KV-cache spec (`AttentionSpec`, `MLAAttentionSpec`) and `BatchLimits`, all
frozen and hashable (docs/contract.md; docs/vllm_differences.md says what this replaces).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from anyattn.types import (
    AttentionType,
    CacheDType,
    cache_torch_dtype,
    check_positive_int,
    parse_cache_dtype,
    parse_dtype,
)

__all__ = ["AttentionSelectorConfig", "AttentionSpec", "BatchLimits", "MLAAttentionSpec"]


def _normalise_dtypes(spec: object, api: str) -> None:
    """Replace `spec.dtype` and `spec.kv_cache_dtype` with their parsed forms."""
    object.__setattr__(spec, "dtype", parse_dtype(spec.dtype, argument=f"{api}: dtype"))
    cache_dtype = parse_cache_dtype(spec.kv_cache_dtype, argument=f"{api}: kv_cache_dtype")
    object.__setattr__(spec, "kv_cache_dtype", cache_dtype)


@dataclass(frozen=True, slots=True)
class AttentionSelectorConfig:
    """Everything a model layer knows about its attention, as the selector needs it. Frozen
    and hashable (selections are cached on it); `dtype` and `attn_type` may be given as text.

    Attributes:
        head_size: size of each attention head.
        dtype: model (query/output) dtype: float32, float16 or bfloat16.
        kv_cache_dtype: "auto" (the model dtype) or one of `anyattn.types.CACHE_DTYPES`.
        block_size: the engine's KV block size, or None to let the backend prefer one.
        num_heads, num_kv_heads: query and KV heads of the layer (None when unknown).
        use_mla: the layer is multi-head latent attention (compressed KV cache).
        has_sink: the layer has per-head attention sinks.
        use_sparse: the layer uses sparse (top-k) attention.
        attn_type: what the queries attend to (`AttentionType`).
        has_sliding_window, has_alibi, has_logits_soft_cap: the layer's score modifiers.
        use_non_causal: a decoder layer with bidirectional attention over its cache.
        use_per_head_quant_scales: fp8 scales per KV head instead of per tensor.
        use_batch_invariant: results must not depend on how requests are batched.
        needs_lse: the engine will merge partial results (cascade, context parallel) and needs
            each backend call to return the log-sum-exp of every row.
        qk_rope_head_dim: MLA only: the rope part R of the latent row, which tells splits of
            one `head_size` apart (576 = 512 + 64 or 448 + 128); None when unknown.
        qk_nope_head_dim, v_head_dim: MLA only: the no-rope part P of the up-projected Q/K
            rows (P + R) and the value rows' size Vd, which a prefill kernel may limit
            (`MLAAttentionBackend.get_mla_head_dims_reason`); None when unknown.
    """

    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: CacheDType = "auto"
    block_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    use_mla: bool = False
    has_sink: bool = False
    use_sparse: bool = False
    attn_type: AttentionType = AttentionType.DECODER
    has_sliding_window: bool = False
    has_alibi: bool = False
    has_logits_soft_cap: bool = False
    use_non_causal: bool = False
    use_per_head_quant_scales: bool = False
    use_batch_invariant: bool = False
    needs_lse: bool = False
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        api = "AttentionSelectorConfig"
        check_positive_int(api, "head_size", self.head_size)
        _normalise_dtypes(self, api)
        attn_type = self.attn_type
        try:
            attn_type = AttentionType(
                attn_type.lower() if isinstance(attn_type, str) else attn_type
            )
        except ValueError:
            valid = ", ".join(t.value for t in AttentionType)
            raise ValueError(
                f"{api}: unknown attn_type (got {self.attn_type!r}, expected one of {valid})."
            ) from None
        object.__setattr__(self, "attn_type", attn_type)
        check_positive_int(api, "block_size", self.block_size, allow_none=True)
        check_positive_int(api, "num_heads", self.num_heads, allow_none=True)
        check_positive_int(api, "num_kv_heads", self.num_kv_heads, allow_none=True)
        if self.num_heads is not None and self.num_kv_heads is not None:
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"{api}: num_heads must be a multiple of num_kv_heads (got "
                    f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads})."
                )
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"{api}: {f.name} must be a bool (got {getattr(self, f.name)!r}).")
        for name in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            check_positive_int(api, name, value, allow_none=True)
            if value is not None and not self.use_mla:
                raise ValueError(
                    f"{api}: {name} is for MLA layers (got {name}={value} with use_mla=False, "
                    "expected None). Set use_mla=True or drop it."
                )
        rope = self.qk_rope_head_dim
        if rope is not None and rope >= self.head_size:
            raise ValueError(
                f"{api}: qk_rope_head_dim must be smaller than head_size, the latent row "
                f"kv_lora_rank + qk_rope_head_dim (got {rope} for head_size {self.head_size})."
            )

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        """The boolean feature fields (`use_mla`, `has_sink`, ...), in declaration order."""
        return tuple(f.name for f in fields(cls) if f.type == "bool")

    def replace(self, **changes: object) -> AttentionSelectorConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element dtype of the KV cache this config implies."""
        return cache_torch_dtype(self.kv_cache_dtype, self.dtype)


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The engine's per-step limits, passed to every metadata builder (what vLLM's builders
    read from its global config).

    Attributes:
        max_num_reqs: most requests in one step.
        max_num_tokens: most query tokens in one step.
        max_model_len: longest sequence (context + new tokens) of a request.
        num_speculative_tokens: draft tokens per request in speculative decoding (0: none).
        cudagraph_capture_sizes: batch sizes (in tokens) the engine captures CUDA graphs for.
        has_persistent_graph_inputs: the engine's promise (engine/cuda_graphs.py keeps it)
            that in every CUDA-graph step `num_reqs` is the captured size, padding requests
            included, each with at least one key over a valid block (the null block will do),
            and the device tensors are views of buffers that keep their addresses from
            capture to replay (the block table whole rows of its buffer). Builders that copy
            a step's tensors for the graph (FLASH_ATTN) may then let it read the step's own.
            A decode step whose slot mapping has a captured size's rows but fewer requests is
            refused. False (default): they copy, and any tensors will do.
    """

    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    num_speculative_tokens: int = 0
    cudagraph_capture_sizes: tuple[int, ...] = ()
    has_persistent_graph_inputs: bool = False

    def __post_init__(self) -> None:
        api = "BatchLimits"
        check_positive_int(api, "max_num_reqs", self.max_num_reqs)
        check_positive_int(api, "max_num_tokens", self.max_num_tokens)
        check_positive_int(api, "max_model_len", self.max_model_len)
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(
                f"{api}: num_speculative_tokens must be an int >= 0 "
                f"(got {self.num_speculative_tokens!r})."
            )
        sizes = tuple(self.cudagraph_capture_sizes)
        for size in sizes:
            check_positive_int(api, "cudagraph_capture_sizes entry", size)
        object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        if not isinstance(self.has_persistent_graph_inputs, bool):
            raise TypeError(
                f"{api}: has_persistent_graph_inputs must be a bool (got "
                f"{self.has_persistent_graph_inputs!r})."
            )


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The KV-cache spec of a group of layers that share one block table: `block_size` tokens
    per block, `num_kv_heads` x `head_size` per token, the model `dtype`, the
    `kv_cache_dtype` ("auto" or one of `anyattn.types.CACHE_DTYPES`) and the `sliding_window`
    W of sliding-window layers (else None)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: CacheDType = "auto"
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        api = type(self).__name__
        check_positive_int(api, "block_size", self.block_size)
        check_positive_int(api, "num_kv_heads", self.num_kv_heads)
        check_positive_int(api, "head_size", self.head_size)
        check_positive_int(api, "sliding_window", self.sliding_window, allow_none=True)
        _normalise_dtypes(self, api)

    @property
    def cache_dtype(self) -> torch.dtype:
        return cache_torch_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one KV block of one layer (K and V)."""
        itemsize = torch.empty((), dtype=self.cache_dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class MLAAttentionSpec(AttentionSpec):
    """KV-cache spec of MLA layers (keyword-only): one latent row `[c_kv (L), k_pe (R)]` per
    token, a cache `(num_blocks, block_size, L + R)` (docs/mla.md, "The cache"). `head_size`
    is `L + R` (when given it must equal that), `num_kv_heads` 1, `sliding_window` None.

    Attributes:
        kv_lora_rank: L, the latent (compressed KV) size.
        qk_rope_head_dim: R, the size of the rotary key shared by all heads.
        qk_nope_head_dim, v_head_dim: P and Vd, the per-head query/key (without rope) and
            value sizes.
    """

    block_size: int
    dtype: torch.dtype
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_kv_heads: int = 1
    head_size: int | None = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        api = "MLAAttentionSpec"
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            check_positive_int(api, name, getattr(self, name))
        row = self.kv_lora_rank + self.qk_rope_head_dim
        if self.head_size is None:
            object.__setattr__(self, "head_size", row)
        elif self.head_size != row:
            raise ValueError(
                f"{api}: head_size must be kv_lora_rank + qk_rope_head_dim (got {self.head_size}, "
                f"expected {self.kv_lora_rank} + {self.qk_rope_head_dim} = {row}). Leave it out."
            )
        if self.num_kv_heads != 1:
            raise ValueError(
                f"{api}: num_kv_heads must be 1, MLA caches one latent per token "
                f"(got {self.num_kv_heads})."
            )
        if self.sliding_window is not None:
            raise ValueError(
                f"{api}: sliding_window must be None, MLA declares no window (got "
                f"{self.sliding_window!r})."
            )
        AttentionSpec.__post_init__(self)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one KV block of one layer (one latent row per token)."""
        itemsize = torch.empty((), dtype=self.cache_dtype).element_size()
        return self.block_size * self.head_size * itemsize
