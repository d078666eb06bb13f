"""`MLAAttention`: the multi-head latent attention layer of DeepSeek-V2/V3 (docs/mla.md).

The layer owns the projections, named as in Hugging Face checkpoints (`q_proj`, or `q_a_proj`
+ `q_a_layernorm` + `q_b_proj`; `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`),
the absorption (`W_UK`, `W_UV`: views of `kv_b_proj`'s weight) and the split of a step into
decode rows (absorbed, `impl.forward_mqa`) and prefill rows (up-projected, `impl.forward_mha`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from anyattn.backends.mla_metadata import MLAMetadata
from anyattn.config import AttentionSelectorConfig, MLAAttentionSpec
from anyattn.declarations import AttentionBackend
from anyattn.layer import check_serves, resolve_device
from anyattn.layer_params import DEFAULT_WORKSPACE_TOKENS
from anyattn.selector import select_backend
from anyattn.types import DeviceInfo, parse_dtype
from anyattn.validation_mla import check_mla_layer_call, check_rope_outputs, mla_layer_call

__all__ = ["MLAAttention", "RMSNorm", "Rope"]

# rope(q_pe [T, H, R], k_pe [T, 1, R]) -> (q_pe, k_pe), rotated at the step's positions.
Rope = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, normalised in float32 and cast back before the
    weight is applied (as DeepSeek's Hugging Face code does)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLAAttention(nn.Module):
    """One MLA layer over a paged latent cache.

    Args:
        hidden_size: the model's hidden size.
        num_heads: H, query heads.
        kv_lora_rank: L; qk_rope_head_dim: R; qk_nope_head_dim: P; v_head_dim: Vd.
        q_lora_rank: the query's low-rank size (`q_a_proj` / `q_b_proj`), or None for one
            `q_proj` (DeepSeek-V2-Lite).
        scale: the softmax scale (DeepSeek with YaRN: `mscale^2 / sqrt(P + R)`).
        rms_norm_eps: epsilon of `q_a_layernorm` and `kv_a_layernorm`.
        dtype: the model dtype (weights, activations).
        layer_name: unique name of the layer.
        block_size: the engine's block size (None: the backend's preferred one).
        backend: a backend class or name to use instead of selecting one.
        device: a `torch.device` (or "cpu" / "cuda") for the weights, or a `DeviceInfo` /
            "sm90" to judge selection for other hardware (weights then stay on the CPU).
        kv_cache_dtype: "auto" or one of `anyattn.types.CACHE_DTYPES`.
        workspace_tokens: most cached latent rows a prefill reads (and up-projects) at once.

    Attributes:
        backend, impl: the MLA backend class and its impl (`use_backend` replaces both).
        k_scale, v_scale: float32 `[]` buffers; an fp8 latent cache uses `k_scale`.

    Its parameters do not require grad (an inference layer: `forward` builds no autograd
    graph); `requires_grad_(True)` turns that back on.

    Raises:
        ValueError, TypeError: a bad size or dtype, or a backend that cannot serve the layer.
        NoBackendError: no MLA backend fits (the message lists every backend's reasons).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        qk_nope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        scale: float,
        rms_norm_eps: float = 1e-6,
        dtype: torch.dtype | str = torch.float32,
        layer_name: str = "attn",
        block_size: int | None = None,
        backend: type[AttentionBackend] | str | None = None,
        device: DeviceInfo | torch.device | str | None = None,
        kv_cache_dtype: str = "auto",
        workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
    ) -> None:
        super().__init__()
        dtype = parse_dtype(dtype, argument=f"MLAAttention({layer_name}): dtype")
        self._device_info, weights_device = resolve_device(device)
        self.layer_name = layer_name
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        self.q_lora_rank, self.block_size = q_lora_rank, block_size
        self.config = AttentionSelectorConfig(
            head_size=kv_lora_rank + qk_rope_head_dim,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            num_heads=num_heads,
            num_kv_heads=1,
            use_mla=True,
            qk_rope_head_dim=qk_rope_head_dim,
            qk_nope_head_dim=qk_nope_head_dim,
            v_head_dim=v_head_dim,
        )
        self._impl_args = (num_heads, scale)
        self._impl_kwargs = dict(
            kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
            qk_nope_head_dim=qk_nope_head_dim, kv_cache_dtype=kv_cache_dtype,
            workspace_tokens=workspace_tokens,
        )  # fmt: skip
        if not isinstance(backend, type):
            backend = select_backend(self.config, self._device_info, backend)
        self.use_backend(backend)
        if block_size is not None and workspace_tokens < block_size:
            raise ValueError(
                f"MLAAttention({layer_name}): workspace_tokens too small for one context chunk "
                f"(got {workspace_tokens}, expected >= block_size {block_size})."
            )

        def linear(n_in: int, n_out: int) -> nn.Linear:
            return nn.Linear(n_in, n_out, bias=False, dtype=dtype, device=weights_device)

        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = linear(hidden_size, num_heads * qk_head_dim)
        else:
            self.q_a_proj = linear(hidden_size, q_lora_rank)
            self.q_a_layernorm = RMSNorm(q_lora_rank, rms_norm_eps, dtype, weights_device)
            self.q_b_proj = linear(q_lora_rank, num_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = linear(hidden_size, kv_lora_rank + qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, rms_norm_eps, dtype, weights_device)
        self.kv_b_proj = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.o_proj = linear(num_heads * v_head_dim, hidden_size)
        one = torch.tensor(1.0, device=weights_device)
        self.register_buffer("k_scale", one, persistent=False)
        self.register_buffer("v_scale", one.clone(), persistent=False)
        # An inference layer: no autograd graph is built through it (as the engine's layers).
        self.requires_grad_(False)

    def use_backend(
        self, backend: type[AttentionBackend], prefill_backend: type[AttentionBackend] | None = None
    ) -> None:
        """Run the layer on the MLA `backend` from now on (a new impl; the weights and scale
        buffers stay), e.g. the one a measured selection chose. Call it before the engine
        builds its groups. `prefill_backend` may only be None or `backend`: MLA layers run one
        backend for every phase (the signature is `Attention.use_backend`'s).

        Raises:
            TypeError: `backend` is not a backend class.
            ValueError: `backend` cannot serve this layer (its reasons are listed), or a
                different `prefill_backend` was given. The layer is unchanged then.
        """
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            raise TypeError(
                f"MLAAttention({self.layer_name}): backend must be an AttentionBackend class "
                f"(got {backend!r}); get one by name with anyattn.registry.get_backend_class."
            )
        if prefill_backend is not None and prefill_backend is not backend:
            raise ValueError(
                f"MLAAttention({self.layer_name}): prefill_backend "
                f"{prefill_backend.get_name()} differs from backend {backend.get_name()} "
                "(expected None or the same backend: MLA layers run one backend for every "
                "phase)."
            )
        check_serves(f"MLAAttention({self.layer_name})", backend, self.config, self._device_info)
        impl = backend.get_impl_cls()(*self._impl_args, **self._impl_kwargs)
        self.backend, self.impl = backend, impl

    @property
    def W_UK(self) -> torch.Tensor:
        """`[H, P, L]`: per head, the rows of `kv_b_proj` that give `k_nope` from `c_kv`."""
        heads = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)
        return heads[:, : self.qk_nope_head_dim]

    @property
    def W_UV(self) -> torch.Tensor:
        """`[H, Vd, L]`: per head, the rows of `kv_b_proj` that give `v` from `c_kv`."""
        heads = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)
        return heads[:, self.qk_nope_head_dim :]

    def up_project(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`c_kv [N, L]` -> `(k_nope [N, H, P], v [N, H, Vd])` through `kv_b_proj`."""
        kv = self.kv_b_proj(c_kv).view(-1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

    def kv_cache_spec(
        self,
        block_size: int | None = None,
        dtype: torch.dtype | str | None = None,
        kv_cache_dtype: str | None = None,
    ) -> MLAAttentionSpec:
        """The layer's `MLAAttentionSpec`; each argument defaults to the layer's own (block
        size: the layer's, else the backend's preferred one)."""
        if block_size is None:
            block_size = self.block_size or self.backend.get_preferred_block_size()
        return MLAAttentionSpec(
            block_size=block_size,
            dtype=self.config.dtype if dtype is None else dtype,
            kv_cache_dtype=self.config.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
        )

    def forward(
        self, hidden: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, attn_metadata: MLAMetadata
    ) -> torch.Tensor:
        """MLA for one step.

        Args:
            hidden: `[T, hidden_size]`, the model dtype.
            rope: `rope(q_pe [T, H, R], k_pe [T, 1, R]) -> (q_pe, k_pe)`, the model's rotary
                embedding at the step's positions.
            kv_cache: this layer's latent cache `(num_blocks, block_size, L + R)`.
            attn_metadata: what this layer's group builder built for the step.

        Returns:
            `[T, hidden_size]`; rows past the step's real tokens come from zero attention.

        Raises:
            TypeError, ValueError: a bad call, before anything is written
                (`anyattn.validation_mla.check_mla_layer_call`).
        """
        md = attn_metadata
        check_mla_layer_call(self.impl, self, hidden, kv_cache, md,
                             hidden_size=self.hidden_size, dtype=self.config.dtype)  # fmt: skip
        with mla_layer_call(self.impl, self, kv_cache, md):
            return self._forward(hidden, rope, kv_cache, md)

    def _forward(
        self, hidden: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, md: MLAMetadata
    ) -> torch.Tensor:
        num_tokens, heads = hidden.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        # q: [T, H, P + R] -> q_nope [T, H, P], q_pe [T, H, R]
        q = q.view(num_tokens, heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # latent: [T, L + R] -> c_kv [T, L], k_pe [T, R]
        latent = self.kv_a_proj_with_mqa(hidden)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = check_rope_outputs(
            self.impl, rope(q_pe, k_pe.unsqueeze(1)), num_tokens, hidden.dtype, hidden.device
        )
        # k_pe: [T, R], in general a view with row stride L + R (docs/mla.md, "Strides"); a
        # rope that returns other strides is made to give unit stride in the last dimension.
        k_pe = k_pe.reshape(num_tokens, self.qk_rope_head_dim)
        if k_pe.stride(-1) != 1:
            k_pe = k_pe.contiguous()
        self.impl.do_kv_cache_update(self, c_kv, k_pe, kv_cache, md.slot_mapping, md)
        # attn: [T, H, Vd]; rows past the real tokens stay zero
        attn = hidden.new_zeros(num_tokens, heads, self.v_head_dim)
        decode, end = md.num_decode_tokens, md.num_actual_tokens
        if decode:
            # q_latent[t, h] = W_UK[h]^T q_nope[t, h]: [T_dec, H, L]
            q_latent = torch.einsum("thp,hpl->thl", q_nope[:decode], self.W_UK).contiguous()
            out_latent = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
            self.impl.forward_mqa(self, q_latent, q_pe[:decode].contiguous(), kv_cache, md,
                                  out_latent)  # fmt: skip
            attn[:decode] = torch.einsum("thl,hvl->thv", out_latent, self.W_UV)
        if end > decode:
            q_full = torch.cat([q_nope[decode:end], q_pe[decode:end]], dim=-1)
            self.impl.forward_mha(self, q_full, c_kv[decode:end], k_pe[decode:end], kv_cache, md,
                                  attn[decode:end])  # fmt: skip
        return self.o_proj(attn.flatten(1))
