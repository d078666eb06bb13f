"""FLEX_ATTENTION: attention through PyTorch's FlexAttention (`torch.nn.attention.flex_attention`).

The portable backend for what the fused kernels do not serve: encoder, encoder-only and cross
attention on CUDA (after FLASH_ATTN), every attention type on the CPU (after TORCH). Limits, all
declared: LSE only on CUDA; no cascade; head sizes multiples of 16 up to 256 (Triton's dot); no
CUDA graphs. Each configuration's first step compiles (tens of seconds).

One compiled `flex_attention` call per layer and step covers the batch as one FlexAttention
batch entry (laid out by `flex_attention_builder`): queries `[1, H, rows, D]`, keys and values
`[1, KVH, keys, D]` copied per call out of the paged cache (or the step's own, for encoder
attention), score mods in docs/semantics.md's order with tensor values (layers differing only
in them share a graph). One compiled function per configuration, a code object of its own
(torch.compile's recompile limit counts per code object); sizes dynamic and padded to buckets
that never equal one another, heads and head size static, so it compiles once. On CUDA rows
are given as tiles `[1, heads, tiles, TILE, D]`, so that Inductor drops its bounds checks.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch

from anyattn.backend import AttentionBackend, AttentionImpl, AttentionLayer, check_layer_planned
from anyattn.backends.flex_attention_builder import (
    FIRST_KEY_ROW,
    TILE,
    FlexAttentionMetadata,
    FlexAttentionMetadataBuilder,
    mask_key,
)
from anyattn.types import ENCODER_TYPES, AttentionType, DeviceInfo, is_fp8_cache
from anyattn.validation import check_forward, check_forward_inputs, layer_kv_scale

__all__ = [
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexAttentionMetadataBuilder",
]


class FlexAttentionBackend(AttentionBackend):
    """Declarations of the FLEX_ATTENTION backend (see the module docstring)."""

    priority: ClassVar[Mapping[str, int]] = {"cpu": 1, "cuda": 3, "blackwell": 3}

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cpu", "cuda")
    supported_attn_types = tuple(AttentionType)
    supported_features = (
        "sink", "sliding_window", "alibi", "logits_soft_cap", "non_causal",
        "per_head_quant_scales", "lse",  # lse: on CUDA only (see supports_combination)
    )  # fmt: skip
    # The Triton template is tuned for and tested on Ampere and newer.
    min_compute_capability = (8, 0)
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "FLEX_ATTENTION"

    @staticmethod
    def get_impl_cls() -> type[FlexAttentionImpl]:
        return FlexAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlexAttentionMetadataBuilder]:
        return FlexAttentionMetadataBuilder

    @classmethod
    def chosen_automatically(cls, config, device: DeviceInfo) -> bool:
        """On the CPU every attention type; on CUDA all but decoder attention."""
        return device.type == "cpu" or AttentionType(config.attn_type) != AttentionType.DECODER

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(16, 257, 16))

    @classmethod
    def supports_combination(cls, config, device) -> str | None:
        if config.needs_lse and device.type == "cpu":
            return (
                "returning LSE (needs_lse) not supported on cpu (Inductor's CPU FlexAttention "
                "has no LSE output)"
            )
        return None

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        return _unavailable_reason()


@functools.cache
def _unavailable_reason() -> str | None:
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return (
            "torch.nn.attention.flex_attention is missing (torch >= 2.5 needed): "
            "pip install 'torch>=2.5'"
        )
    if not torch._dynamo.is_dynamo_supported():
        version = ".".join(str(v) for v in sys.version_info[:2])
        return (
            f"torch.compile is not supported on this Python (got Python {version}): run on a "
            f"Python version torch {torch.__version__.split('+')[0]} supports for torch.compile"
        )
    if torch.cuda.is_available():
        if importlib.util.find_spec("triton") is None:
            return "Triton is missing (torch.compile needs it on CUDA): pip install triton"
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:
        return "no C++ compiler for torch.compile on the CPU: install g++ (or set CXX)"
    return None


_API = "FLEX_ATTENTION forward"
# fp32 of head sizes 129-255 on CUDA: 32-row query and key tiles in one stage (about 96 KiB
# of shared memory; the default launch asks for 336 KiB and fails to compile on an H200).
_WIDE_FP32_OPTIONS = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


class FlexAttentionImpl(AttentionImpl[FlexAttentionMetadata]):
    """The FLEX_ATTENTION forward; see the module docstring."""

    backend = FlexAttentionBackend
    lse_base_on_e = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Per-layer values as tensors of static sizes: an unmarked size equal to a symbolic one
        # would share its symbol (one more compile), and the CPU template's symbols can clash.
        mods = {"scale": torch.tensor(self.scale)}
        if self.logits_soft_cap is not None:
            mods["soft_cap"] = torch.tensor(self.logits_soft_cap)
        if self.alibi_slopes is not None:
            mods["alibi_slopes"] = self.alibi_slopes.clone()
        if self.sinks is not None:
            mods["sinks"] = self.sinks.detach().float().flatten().clone()
        self._mods = {name: _static(t, range(t.dim())) for name, t in mods.items()}

    def _mods_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The score-mod tensors on `device` (moved once, then kept), sizes static."""
        for name, tensor in self._mods.items():
            if tensor.device != device:
                self._mods[name] = _static(tensor.to(device), range(tensor.dim()))
        return self._mods

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: FlexAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `AttentionImpl.forward`. Writes `output[:num_actual_tokens]` (and `output_lse`,
        CUDA only)."""
        md = attn_metadata
        check_forward(self, query, key, value, kv_cache, md, output, output_lse)
        check_layer_planned(md.layer_names, layer, _API)
        n = md.num_actual_tokens
        if n == 0:
            return output
        key_of_mask = mask_key(
            self.attn_type, md.causal, self.sliding_window, self.sinks is not None
        )
        block_mask = md.masks.get(key_of_mask)
        if block_mask is None:
            raise ValueError(
                f"{_API}: no mask was built for this layer's settings (got causal, window, "
                f"sinks = {key_of_mask}, built {sorted(md.masks, key=str)}). Give the builder "
                "this layer's own record (impl.layer_params())."
            )
        device, dtype = query.device, query.dtype
        k, v = self._keys(layer, key, value, kv_cache, md, dtype)
        q = query.new_empty((md.num_rows, self.num_heads, self.head_size))
        q[:n].copy_(query[:n])
        q[n:].zero_()  # padding rows: their outputs are never read
        mods = self._mods_on(device)
        options = None
        if device.type == "cuda" and dtype == torch.float32 and 128 < self.head_size < 256:
            options = dict(_WIDE_FP32_OPTIONS)
        config = (device.type, dtype, self.head_size, self.num_heads, self.num_kv_heads,
                  *sorted(mods), str(options))  # fmt: skip
        attend = _compiled(config, with_lse=output_lse is not None)
        # [1, H or KVH, rows, D] each
        rows = (_kernel_rows(x[None], device.type == "cuda") for x in (q.transpose(0, 1), k, v))
        result = attend(*rows, block_mask, _score_mod(mods, md.q_key_pos), options)
        out, lse = result if output_lse is not None else (result, None)
        # out [1, H, rows, D] has the query's token-major strides: a contiguous copy
        output[:n].copy_(out[0, :, :n].transpose(0, 1))
        if lse is not None:
            output_lse[:, :n].copy_(lse[0, :, :n])
        return output

    def _keys(
        self,
        layer: AttentionLayer,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: FlexAttentionMetadata,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's keys and values, `[KVH, num_keys, D]` each, of the model dtype, fresh
        buffers at storage offset 0."""
        end = md.layout.num_key_rows
        if self.attn_type in ENCODER_TYPES:
            # encoder attention: the step's own K/V, in token order
            parts = (key[: end - FIRST_KEY_ROW], value[: end - FIRST_KEY_ROW])
        else:
            # [keys, 2, KVH, D]: advanced indices apart put the key dimension first
            kv = kv_cache[md.key_blocks, :, md.key_offsets]
            parts = (kv[:, 0], kv[:, 1])
            if is_fp8_cache(self.kv_cache_dtype):
                scales = (layer_kv_scale(_API, layer, name, self.num_kv_heads, kv_cache.device)
                          for name in ("k_scale", "v_scale"))  # fmt: skip
                parts = [x.float().mul_(s.view(-1, 1)) for x, s in zip(parts, scales, strict=True)]
        k, v = (part.new_empty((self.num_kv_heads, md.num_keys, self.head_size), dtype=dtype)
                for part in parts)  # fmt: skip
        for buffer, part in ((k, parts[0]), (v, parts[1])):
            # unused rows must be finite: masked keys of a visited tile are still computed,
            # and a NaN there would leak through `0 * NaN`
            buffer[:, :FIRST_KEY_ROW].zero_()
            buffer[:, end:].zero_()
            buffer[:, FIRST_KEY_ROW:end].copy_(part.transpose(0, 1))
        return k, v

    def validate_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: FlexAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `AttentionImpl.validate_inputs`; shapes, dtypes and devices of every input."""
        check_forward_inputs(_API, self, query, key, value, kv_cache, md, FlexAttentionMetadata,
                             output=output, output_lse=output_lse)  # fmt: skip
        if output_lse is not None and query.device.type != "cuda":
            raise NotImplementedError(
                f"{_API}: output_lse not supported on {query.device.type} (Inductor's CPU "
                "FlexAttention returns no LSE). Use the TORCH backend when LSEs are needed "
                "on the CPU."
            )


def _score_mod(mods: dict[str, torch.Tensor], q_key_pos: torch.Tensor) -> Callable:
    """Scale, soft cap, ALiBi, then the sink logit at key row 0 (docs/design.md's order); `h`
    is the query head."""
    scale, soft_cap = mods["scale"], mods.get("soft_cap")
    slopes, sinks = mods.get("alibi_slopes"), mods.get("sinks")

    def score_mod(score, b, h, q_idx, kv_idx):
        score = score * scale
        if soft_cap is not None:
            score = soft_cap * torch.tanh(score / soft_cap)
        if slopes is not None:
            # key position minus query position, both in key-workspace rows
            score = score + slopes[h] * (kv_idx - q_key_pos[q_idx])
        if sinks is not None:
            score = torch.where(kv_idx == 0, sinks[h], score)
        return score

    return score_mod


def _static(tensor: torch.Tensor, dims) -> torch.Tensor:
    """Marks `dims` static for torch.compile (heads and head sizes never vary)."""
    for dim in dims:
        torch._dynamo.mark_static(tensor, dim)
    return tensor


def _kernel_rows(rows: torch.Tensor, tiled: bool) -> torch.Tensor:
    """`[1, heads, rows, D]` as the compiled call takes it: `tiled` (on CUDA) as tiles `[1,
    heads, rows / TILE, TILE, D]` with only the tile count symbolic; else untiled (the CPU
    template fails to compile the tiled form), only the row count symbolic. Detached: without
    a base, whose unmarked sizes torch.compile would guard on."""
    if not tiled:
        return _static(rows.detach(), (0, 1, 3))
    return _static(rows.unflatten(2, (-1, TILE)).detach(), (0, 1, 3, 4))


def _attend(query, key, value, block_mask, score_mod, kernel_options, with_lse=False):
    from torch.nn.attention import flex_attention as flex

    query, key, value = (x.flatten(2, 3) if x.dim() == 5 else x for x in (query, key, value))
    args = dict(score_mod=score_mod, block_mask=block_mask, scale=1.0, enable_gqa=True,
                kernel_options=kernel_options)  # fmt: skip
    if not with_lse:
        return flex.flex_attention(query, key, value, **args)
    if hasattr(flex, "AuxRequest"):
        out, aux = flex.flex_attention(
            query, key, value, **args, return_aux=flex.AuxRequest(lse=True)
        )
        return out, aux.lse
    return flex.flex_attention(query, key, value, **args, return_lse=True)


_COMPILED: dict[tuple, Callable] = {}


def _compiled(config: tuple, with_lse: bool) -> Callable:
    """The compiled attention call of `config`, a code object of its own (`with_lse` its
    default, a constant to the compiler)."""
    fn = _COMPILED.get((config, with_lse))
    if fn is None:
        name = f"_attend_{len(_COMPILED)}"
        code = _attend.__code__.replace(co_name=name, co_qualname=name)
        copy = types.FunctionType(code, _attend.__globals__, name, (with_lse,))
        fn = _COMPILED[(config, with_lse)] = torch.compile(copy, dynamic=True, fullgraph=True)
    return fn


FlexAttentionMetadataBuilder.backend = FlexAttentionBackend
