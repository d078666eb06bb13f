"""What a FlashAttention entry point takes, and which layers it can serve.

Three generations ship under different module names, with different arguments:

- FA4: `flash_attn.cute.flash_attn_varlen_func` (`pip install 'anyattn[flash-attn]'`);
- FA3: `flash_attn_interface` (Hopper build): `flash_attn_varlen_func` when it takes a page
  table (vLLM's fork), else `flash_attn_with_kvcache` (upstream);
- FA2: `flash_attn.flash_attn_interface.flash_attn_varlen_func` (`pip install flash-attn`).

A feature is declared only when the entry point has the argument that carries it
(`inspect.signature`, read at run time; the `_*_ARGS` names below). fp8 KV is declared by none:
FA3's fp8 kernels round the query to e4m3 too, which misses the conformance kit's bound. What no
signature says (compute capabilities, head sizes, page sizes) is in `_FACTS`, with its source.

`FlashAttnInterface.reasons` says why an entry point cannot serve a `FlashAttnRequest` (what a
layer needs of it); `FlashAttnInterface.call` runs it with generic arguments mapped to its names.
Nothing here imports FlashAttention: `flash_attn_versions` finds the installed entry points and
picks the one that serves each layer.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from anyattn.types import ENCODER_TYPES, AttentionType

if TYPE_CHECKING:
    from anyattn.config import AttentionSelectorConfig
    from anyattn.types import DeviceInfo

__all__ = [
    "PIP_COMMAND",
    "FlashAttnInterface",
    "FlashAttnRequest",
    "FlashAttnVersion",
    "interface_from_function",
    "paged_bidirectional_is_faulty",
    "reference_fa4_interface",
]

PIP_COMMAND = "pip install 'anyattn[flash-attn]'"

_PAGE_ARGS = ("page_table", "block_table")
_SEQ_LENS_ARGS = ("seqused_k", "cache_seqlens")
_SINK_ARGS = ("learnable_sink", "s_aux")
_LSE_ARGS = ("return_lse", "return_softmax_lse", "return_attn_probs")
_DESCALE_ARGS = ("q_descale", "k_descale", "v_descale")


class FlashAttnVersion(enum.IntEnum):
    """A FlashAttention generation."""

    FA2 = 2
    FA3 = 3
    FA4 = 4

    @property
    def label(self) -> str:
        return f"FA{self.value}"

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules that may hold this version, in the order to try them."""
        return _FACTS[self].modules

    @property
    def entries(self) -> tuple[str, ...]:
        """The names its entry point may have in such a module."""
        return _FACTS[self].entries


@dataclass(frozen=True, slots=True)
class _Facts:
    """What no signature says about a version: where it lives and what it runs on."""

    modules: tuple[str, ...]
    entries: tuple[str, ...]
    min_capability: tuple[int, int]
    max_major: int | None  # newest compute capability major with paged KV (None: any)
    capability_text: str
    head_size_text: str
    # Page sizes: FA4's cp.async path takes any (paged_kv.py divides by it), FA3 documents
    # "arbitrary", upstream FA2 "a multiple of 256"; 16 keeps every kernel tile aligned.
    block_size_multiple: int


# FA4: interface.py:1611 "paged KV not supported on SM
# 8.0", :1754 "Paged KV not supported on SM 12.0"; FA3: a Hopper-only build.
_FACTS: dict[FlashAttnVersion, _Facts] = {
    FlashAttnVersion.FA4: _Facts(
        modules=("flash_attn.cute",), entries=("flash_attn_varlen_func",),
        min_capability=(9, 0), max_major=11, capability_text="sm90, sm100 and sm110 (paged KV)",
        head_size_text="multiples of 16 up to 128, and 144, 176, 192, 256, on sm90; up to 128, "
        "and 256, on sm100/sm110",
        block_size_multiple=16,
    ),
    FlashAttnVersion.FA3: _Facts(
        modules=("flash_attn_interface", "flash_attn_3.flash_attn_interface"),
        entries=("flash_attn_varlen_func", "flash_attn_with_kvcache"),
        min_capability=(9, 0), max_major=9, capability_text="sm90 only",
        head_size_text="multiples of 8 up to 256", block_size_multiple=16,
    ),
    FlashAttnVersion.FA2: _Facts(
        modules=("flash_attn.flash_attn_interface",), entries=("flash_attn_varlen_func",),
        min_capability=(8, 0), max_major=None, capability_text="sm80 and newer",
        head_size_text="multiples of 8 up to 256", block_size_multiple=256,
    ),
}  # fmt: skip

# The parameters of flash_attn.cute.flash_attn_varlen_func in flash-attn-4 4.0.0b36
# (flash_attn/cute/interface.py:4214): what `pip install 'anyattn[flash-attn]'` provides, used for
# the declarations while no FlashAttention is installed.
_FA4_REFERENCE_PARAMS = frozenset(
    "q k v qv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k min_seqlen_k seqused_q "
    "seqused_k gather_kv_indices page_table softmax_scale causal window_size learnable_sink "
    "softcap num_splits pack_gqa deterministic score_mod score_mod_bwd mask_mod "
    "block_sparse_tensors aux_tensors aux_scalars return_lse scheduler_metadata "
    "seqlen_k_per_split disable_scheduler_metadata gather_bwd_recompute_p "
    "gather_bwd_token_chunk".split()
)

# FA4 on sm90, paged: 4.0.0b36 returns wrong rows at head sizes 208 and 240 in every run of
# the declaration sweep and at 160 and 224 in some; the sizes above 128 kept passed every run.
_FA4_SM90_WIDE_HEAD_SIZES = (144, 176, 192, 256)
# FA4 4.0.0b36 and 4.0.0b40 on sm90, paged keys, bidirectional (cross attention, non-causal
# decoder): head sizes 65-96 give wrong rows and 160 an illegal memory access, where the same
# call over contiguous keys is right (benchmarks/fa4_cross_attention_repro.py).
_FA4_PAGED_BIDIRECTIONAL_BAD = (range(65, 97), range(129, 257))


def paged_bidirectional_is_faulty(
    interface: FlashAttnInterface, capability: tuple[int, int] | None, head_size: int
) -> bool:
    """Whether `interface` returns wrong rows for bidirectional attention (cross attention, a
    non-causal decoder) over paged keys at `head_size` on a device of `capability`; the caller
    then passes the keys contiguously (`cu_seqlens_k`), which that kernel gets right."""
    return (
        interface.version is FlashAttnVersion.FA4
        and capability is not None
        and capability[0] == 9
        and any(head_size in bad for bad in _FA4_PAGED_BIDIRECTIONAL_BAD)
    )


@dataclass(frozen=True, slots=True)
class FlashAttnRequest:
    """What a layer needs of a FlashAttention version (`capability` None: any device)."""

    head_size: int
    capability: tuple[int, int] | None = None
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    attn_type: AttentionType = AttentionType.DECODER
    has_alibi: bool = False
    has_sink: bool = False
    has_logits_soft_cap: bool = False
    has_sliding_window: bool = False
    needs_lse: bool = False
    use_non_causal: bool = False
    use_per_head_quant_scales: bool = False

    @classmethod
    def from_config(cls, config: AttentionSelectorConfig, device: DeviceInfo) -> FlashAttnRequest:
        """The request of a selector config (its fields of the same names) on `device`."""
        names = {f.name for f in fields(cls)} - {"capability"}
        return cls(capability=device.capability, **{n: getattr(config, n) for n in names})


@dataclass(frozen=True)
class FlashAttnInterface:
    """One installed (or described) FlashAttention entry point and what it takes.

    Attributes:
        version: the generation.
        module, entry: where the function lives (`module.entry`).
        params: the entry point's parameter names, from its signature.
        fn: the function itself; None for a described interface that cannot run here.
    """

    version: FlashAttnVersion
    module: str
    entry: str
    params: frozenset[str]
    fn: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def _first(self, names: Sequence[str]) -> str | None:
        return next((n for n in names if n in self.params), None)

    @property
    def label(self) -> str:
        return f"{self.version.label} ({self.module}.{self.entry})"

    @property
    def page_table_arg(self) -> str | None:
        return self._first(_PAGE_ARGS)

    @property
    def seq_lens_arg(self) -> str | None:
        """Argument for per-request key lengths; None: pass `cu_seqlens_k` instead."""
        return self._first(_SEQ_LENS_ARGS)

    @property
    def sink_arg(self) -> str | None:
        return self._first(_SINK_ARGS)

    @property
    def lse_arg(self) -> str | None:
        return self._first(_LSE_ARGS)

    @property
    def takes_cache_as_k_cache(self) -> bool:
        """`flash_attn_with_kvcache` names the cache `k_cache`/`v_cache` (its `k`/`v` are new
        tokens to append, which we never pass)."""
        return "k_cache" in self.params

    @property
    def has_softcap(self) -> bool:
        return "softcap" in self.params

    @property
    def has_window(self) -> bool:
        return "window_size" in self.params

    @property
    def has_alibi(self) -> bool:
        return "alibi_slopes" in self.params

    @property
    def has_descales(self) -> bool:
        return all(name in self.params for name in _DESCALE_ARGS)

    @property
    def has_out(self) -> bool:
        return "out" in self.params

    @property
    def has_cu_seqlens_k(self) -> bool:
        return "cu_seqlens_k" in self.params

    @property
    def min_capability(self) -> tuple[int, int]:
        return _FACTS[self.version].min_capability

    @property
    def block_size_multiple(self) -> int:
        return _FACTS[self.version].block_size_multiple

    @property
    def kv_cache_dtypes(self) -> tuple[str, ...]:
        # No fp8: FA3's fp8 kernels (q / k / v descales) take the query in e4m3 too, and that
        # rounding alone put the conformance kit's fp8 cases at 1.4-2x the bound in bf16 and
        # 15x in fp16 (its CPU stand-in, tests/backends/fa_fakes.py); FA4 and FA2 take no fp8.
        return ("auto", "float16", "bfloat16")

    @property
    def attn_types(self) -> tuple[AttentionType, ...]:
        paged = (AttentionType.DECODER, AttentionType.ENCODER_DECODER)
        # Encoder self-attention reads contiguous K/V through cu_seqlens_k.
        return (*paged, *ENCODER_TYPES) if self.has_cu_seqlens_k else paged

    def supports_capability(self, capability: tuple[int, int]) -> bool:
        facts = _FACTS[self.version]
        newest = facts.max_major
        return capability >= facts.min_capability and (newest is None or capability[0] <= newest)

    def head_sizes(self, capability: tuple[int, int] | None = None) -> list[int]:
        """Head sizes for `capability` (None: any capability this version runs on)."""
        if self.version is not FlashAttnVersion.FA4:
            return list(range(8, 257, 8))  # 16-byte aligned rows
        # Paged KV not loaded by TMA asserts "Paged KV does not support irregular head dim"
        # (flash_fwd_sm90.py:66, flash_fwd_sm100.py:265); interface.py:121 bounds the range.
        sizes = list(range(16, 257, 16))
        if capability is not None and capability[0] in (10, 11):
            return [s for s in sizes if s <= 128 or s == 256]
        return [s for s in sizes if s <= 128 or s in _FA4_SM90_WIDE_HEAD_SIZES]

    def missing_essentials(self) -> list[str]:
        """Why this entry point cannot run paged varlen attention at all (empty: it can)."""
        missing = []
        if self.page_table_arg is None:
            missing.append("no page table argument (page_table / block_table)")
        if self.seq_lens_arg is None and not self.has_cu_seqlens_k:
            missing.append("no key lengths argument (seqused_k / cache_seqlens / cu_seqlens_k)")
        for name in ("cu_seqlens_q", "max_seqlen_q", "softmax_scale", "causal"):
            if name not in self.params:
                missing.append(f"no {name} argument")
        return missing

    def reasons(self, request: FlashAttnRequest) -> list[str]:
        """Why this version cannot serve `request` (empty: it can)."""
        reasons = list(self.missing_essentials())
        cap, facts = request.capability, _FACTS[self.version]
        if cap is not None and not self.supports_capability(cap):
            reasons.append(
                f"compute capability sm{cap[0]}{cap[1]} not supported (runs on "
                f"{facts.capability_text})"
            )
        if request.head_size not in self.head_sizes(cap):
            reasons.append(f"head_size {request.head_size} not supported ({facts.head_size_text})")
        if request.block_size is not None and request.block_size % self.block_size_multiple:
            reasons.append(
                f"block_size {request.block_size} not supported (needs a multiple of "
                f"{self.block_size_multiple})"
            )
        if request.kv_cache_dtype not in self.kv_cache_dtypes:
            why = f"takes {', '.join(self.kv_cache_dtypes)}"
            if self.has_descales and request.kv_cache_dtype.startswith("fp8"):
                why += "; its fp8 kernels round the query to e4m3, past the error bound"
            reasons.append(f"kv_cache_dtype {request.kv_cache_dtype} not supported ({why})")
        if request.attn_type not in self.attn_types:
            reasons.append(f"attn_type {request.attn_type.value} not supported (no cu_seqlens_k)")
        bidirectional = request.use_non_causal or request.attn_type is not AttentionType.DECODER
        wanted = (
            (request.has_alibi, self.has_alibi, "ALiBi (no alibi_slopes argument)"),
            (request.has_sink, self.sink_arg, "sinks (no learnable_sink / s_aux argument)"),
            (request.has_logits_soft_cap, self.has_softcap, "soft cap (no softcap argument)"),
            (request.has_sliding_window, self.has_window, "sliding window (no window_size)"),
            (request.needs_lse, self.lse_arg, "LSE (no return_lse-style argument)"),
            (request.use_per_head_quant_scales, False, "per-head scales (no fp8 caches)"),
        )
        reasons.extend(f"{label} not supported" for want, has, label in wanted if want and not has)
        if request.has_alibi and self.has_alibi and bidirectional:
            # FA2 adds -slope * |i - j|; semantics.md's slope * (j - p) differs for keys after p.
            reasons.append("ALiBi with bidirectional attention not supported (biases by -|i - j|)")
        return reasons

    def call(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the entry point with generic arguments mapped to this version's names.

        Generic arguments: `q, k, v` (k/v the paged cache views or contiguous keys),
        `cu_seqlens_q, max_seqlen_q, max_seqlen_k, seq_lens, cu_seqlens_k, page_table,
        softmax_scale, causal, window (W or None), softcap, sinks, alibi_slopes,
        q_descale, k_descale, v_descale, return_lse, out`. None values are left at the
        entry point's default.

        Returns:
            `(out, lse)`; lse is None unless `return_lse`.
        """
        if self.fn is None:
            raise RuntimeError(
                f"FLASH_ATTN: {self.label} is described, not installed (got a call). "
                f"Install it with {PIP_COMMAND}."
            )
        call_kwargs = self.map_arguments(**kwargs)
        result = self.fn(**call_kwargs)
        out = result[0] if isinstance(result, tuple | list) else result
        lse = result[1] if kwargs.get("return_lse") else None
        return out, lse

    def map_arguments(self, **kwargs: Any) -> dict[str, Any]:
        """The keyword arguments `call` passes to the entry point (see `call`)."""
        k, v = kwargs.pop("k"), kwargs.pop("v")
        mapped: dict[str, Any] = {"q": kwargs.pop("q")}
        if self.takes_cache_as_k_cache:
            mapped["k_cache"], mapped["v_cache"] = k, v
        else:
            mapped["k"], mapped["v"] = k, v
        window = kwargs.pop("window", None)
        if window is not None:
            mapped["window_size"] = (window - 1, 0)
        renames = {
            "page_table": self.page_table_arg,
            "seq_lens": self.seq_lens_arg,
            "sinks": self.sink_arg,
            "return_lse": self.lse_arg,
        }
        for name, value in kwargs.items():
            if value is None or (name == "return_lse" and not value):
                continue
            target = renames.get(name, name)
            if target is None or target not in self.params:
                if name == "max_seqlen_k":
                    continue  # a bound some entry points do not take
                raise TypeError(
                    f"FLASH_ATTN: {self.label} takes no argument for {name!r} (got a value). "
                    "This is a declaration bug: the version chooser should have rejected it."
                )
            mapped[target] = value
        return mapped


def interface_from_function(
    version: FlashAttnVersion, module: str, entry: str, fn: Callable[..., Any] | None
) -> FlashAttnInterface:
    """Describe `fn` by its signature (no parameters when the signature cannot be read)."""
    try:
        params = frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()
    except (TypeError, ValueError):
        params = frozenset()
    return FlashAttnInterface(version, module, entry, params, fn)


def reference_fa4_interface() -> FlashAttnInterface:
    """FA4 4.0.0b36 as `pip install 'anyattn[flash-attn]'` installs it (not runnable here)."""
    return FlashAttnInterface(
        FlashAttnVersion.FA4, "flash_attn.cute", "flash_attn_varlen_func", _FA4_REFERENCE_PARAMS
    )
