"""FLASH_ATTN: FlashAttention's varlen kernel over the paged KV cache.

Wraps `flash_attn_varlen_func` of whichever FlashAttention is installed: FA4 (`flash_attn.cute`,
`pip install 'anyattn[flash-attn]'`), else FA3, else FA2. `flash_attn_versions` reads each
installed entry point's signature and declares only what it takes; while none is installed the
declarations are FA4's (what the pinned extra installs) and `get_unavailable_reason()` gives the
pip command. Every layer picks the newest installed version that serves its head size, ALiBi,
sinks and the GPU's compute capability. No version is declared for fp8 caches: FA3's fp8 kernels
round the query to e4m3 as well, which misses the conformance kit's bound.

One kernel call serves a whole mixed batch (decodes, fresh and chunked prefills) with no
reordering: queries by `cu_seqlens_q = query_start_loc`, keys through the page table
(`block_table_tensor`) up to `seqused_k = seq_lens` (FA2: `cu_seqlens_k`), bounded by the
metadata's `max_query_len` / `max_seq_len`. Bottom-right causal alignment puts query `i` of a
request at position `context + i`; a window of W keys is `window_size = (W - 1, 0)`; LSEs are in
natural log and count the sink (FA4 folds it into the softmax denominator).

Plan/run split: `build` plans from the step's CPU mirrors, checked when the metadata was made
(`CommonAttentionMetadata.host_batch`: the kernels are sized by `max_query_len` /
`max_seq_len`), slices the step's device tensors and, for cascade and CUDA-graph decode
batches, fills builder-owned buffers (cascade: host-to-device copies from the CPU mirrors that
do not wait; CUDA graphs: one device launch copying the step's table and lengths); it never
reads a device value.

Cascade attention (`common_prefix_len > 0`): a prefix pass runs every query of the step as one
request against the shared prefix blocks (non-causal: every query follows them); a suffix pass
runs each request against its remaining blocks; `merge_attn_states` joins the two by their LSEs.
Sinks go to the suffix pass only, so they are counted once.

CUDA graphs (UNIFORM_SINGLE_TOKEN_DECODE): a batch of single-token decodes of at most the
largest capture size is copied into buffers the builder owns (sized from `BatchLimits`, in one
launch: `ops.graph_decode_inputs`), laid out for the smallest capture size that holds it:
padding requests have no query token and no keys, and `max_seqlen_k` is `max_model_len`, so a
graph captured for that size replays for any such batch (a runner that pads the batch itself,
with dummy requests, gets the same addresses). Such metadata stays valid until the builder's
next build. Under replay, output rows between the real tokens and the captured size hold
unspecified values. With
`BatchLimits.has_persistent_graph_inputs` (the runner keeps a graph step's tensors at fixed
addresses, padded to the captured size) a batch of a captured size reads the step's own tensors
instead, as an eager step does: no device copy at replay (FA2's key offsets, which the step does
not carry, are still summed into a builder buffer); a batch of another size is an eager step
then.

KV cache: `(num_blocks, 2, block_size, num_kv_heads, head_size)`, NHD or HND (FA4 marks every
stride of K/V dynamic and only needs the head dim contiguous and 16-byte aligned strides; its
cp.async page loader addresses rows through those strides). With pages of the kernel's TILE_N
(128 for most head sizes) FA4 loads whole pages by TMA, including rows past a request's length:
they must hold finite values, which zero-initialised caches (`allocate_kv_cache`) guarantee.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from anyattn.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    check_layer_planned,
)
from anyattn.backends import flash_attn_versions as versions
from anyattn.backends.flash_attn_plan import (
    cascade_block_tables,
    cascade_is_worthwhile,
    cu_seqlens_from_lens,
    padded_num_reqs,
    plan_cascade,
)
from anyattn.metadata import CommonAttentionMetadata, first_rows
from anyattn.ops.graph_decode_inputs import GraphDecodeInputsLaunch
from anyattn.ops.merge_attn_states import merge_attn_states
from anyattn.types import (
    AttentionCGSupport,
    AttentionType,
    KVCacheLayout,
    MultipleOf,
    cache_torch_dtype,
    is_fp8_cache,
)
from anyattn.validation import check_forward, check_forward_inputs

__all__ = [
    "FlashAttentionBackend",
    "FlashAttentionImpl",
    "FlashAttentionMetadata",
    "FlashAttentionMetadataBuilder",
    "FlashAttnPass",
]

_ENCODER_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


class _DeclaredByInstalledVersion(abc.ABCMeta):
    """Class attributes that follow the installed FlashAttention (metaclass properties win over
    the base class's plain attributes, so every reader sees the same answer)."""

    @property
    def supported_kv_cache_dtypes(cls) -> tuple[str, ...]:
        names = [d for i in versions.declared_interfaces() for d in i.kv_cache_dtypes]
        return tuple(dict.fromkeys(names))

    @property
    def supported_attn_types(cls) -> tuple[AttentionType, ...]:
        types = {t for i in versions.declared_interfaces() for t in i.attn_types}
        return tuple(t for t in AttentionType if t in types)

    @property
    def min_compute_capability(cls) -> tuple[int, int]:
        return min(i.min_capability for i in versions.declared_interfaces())


def _any(attribute: str) -> bool:
    return any(getattr(i, attribute) for i in versions.declared_interfaces())


class FlashAttentionBackend(AttentionBackend, metaclass=_DeclaredByInstalledVersion):
    """Declarations of the FLASH_ATTN backend: the union over the installed versions; joint
    constraints per version (head size by compute capability, ...) in `validate_configuration`."""

    priority: ClassVar[Mapping[str, int]] = {"cuda": 0, "blackwell": 1}

    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_device_types = ("cuda",)
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.NHD, KVCacheLayout.HND)

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        bases = sorted({i.block_size_multiple for i in versions.declared_interfaces()})
        # A multiple of a larger base is a multiple of a smaller one that divides it.
        kept = [b for b in bases if not any(b % s == 0 for s in bases if s < b)]
        return [MultipleOf(b) for b in kept]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return sorted({s for i in versions.declared_interfaces() for s in i.head_sizes()})

    @classmethod
    def supports_sink(cls) -> bool:
        return _any("sink_arg")

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return _any("has_window")

    @classmethod
    def supports_alibi(cls) -> bool:
        return _any("has_alibi")

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return _any("has_softcap")

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_lse(cls) -> bool:
        return _any("lse_arg")

    @classmethod
    def supports_cascade(cls) -> bool:
        return cls.supports_lse()  # the merge needs both passes' LSEs

    @classmethod
    def supports_combination(cls, config, device) -> str | None:
        if not is_fp8_cache(config.kv_cache_dtype) and config.cache_dtype != config.dtype:
            return (
                f"kv_cache_dtype {config.kv_cache_dtype} with dtype "
                f"{str(config.dtype).removeprefix('torch.')} not supported (the kernels take "
                "queries and keys of one dtype)"
            )
        return None

    @classmethod
    def get_unavailable_reason(cls) -> str | None:
        return versions.unavailable_reason()

    @classmethod
    def validate_configuration(cls, config, device) -> list[str]:
        """The declared checks, then (when they pass on a CUDA device) whether one version takes
        everything together, e.g. head size 192 on sm100 (FA4 takes it on sm90 only)."""
        reasons = super().validate_configuration(config, device)
        sm80_or_newer = device.capability is not None and device.capability >= (8, 0)
        if reasons and sm80_or_newer and not versions.installed_interfaces():
            # (nothing installed: what is declared is FA4, the extra's; name the version that
            # serves an sm80-sm89 GPU instead)
            reasons = [
                f"{r}: FA4, which {versions.PIP_COMMAND} installs, runs on sm90+; "
                "FlashAttention 2 runs on sm80+ (pip install flash-attn)"
                if r.startswith("compute capability")
                else r
                for r in reasons
            ]
        if reasons or not device.is_cuda:
            return reasons
        request = versions.FlashAttnRequest.from_config(config, device)
        chosen, why = versions.choose_interface(versions.declared_interfaces(), request)
        if chosen is None:
            reasons.append(f"no FlashAttention version takes this combination ({'; '.join(why)})")
        return reasons


@dataclass(frozen=True)
class FlashAttnPass:
    """The varlen arguments of one kernel call.

    Attributes:
        cu_seqlens_q: int32 `[batch + 1]` (device): query offsets.
        seq_lens: int32 `[batch]` (device): keys per request (`seqused_k`); None for
            encoder attention (contiguous keys by `cu_seqlens_k`).
        cu_seqlens_k: int32 `[batch + 1]` (device) for entry points without `seqused_k` and
            for encoder attention.
        page_table: int32 `[batch, max_blocks]` (device); None for encoder attention.
        max_seqlen_q, max_seqlen_k: bounds on the lengths.
        causal: bottom-right causal masking.
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    page_table: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool


@dataclass(frozen=True)
class FlashAttentionMetadata:
    """What `FlashAttentionImpl.forward` needs for one step. Read-only, tensors and passes
    alike: in the CUDA-graph decode layout they are the builder's persistent buffers and one
    pass per captured size, reused by every later step (the builder rewrites the query offsets
    only when the batch changes).

    Attributes:
        num_actual_tokens: real tokens; output rows past it are untouched (eager).
        num_reqs: real requests.
        block_size: tokens per block of the page tables.
        slot_mapping: int64 `[num_tokens]` (device), for the layer's cache write.
        causal: the step's causal flag.
        query_start_loc: int32 `[batch + 1]` (device); encoder attention uses it for keys too.
        max_query_len: the longest query.
        main: the whole batch (the suffix pass under cascade).
        prefix: the cascade prefix pass, else None.
        encoder: the pass of encoder layers (keys are the step's own, by `query_start_loc`),
            when the builder has such layers, else None.
        layer_names: the builder's layers (`forward` refuses any other).
        common_prefix_len: shared prefix tokens (0: no cascade).
        uses_persistent_buffers: the tensors are the builder's CUDA-graph buffers. (Under
            `BatchLimits.has_persistent_graph_inputs` a graph step's are the step's own, False
            here, but FA2's `cu_seqlens_k` is a builder buffer all the same: valid until the
            next build, as these are.)
        common_attn_metadata: the step it was built from (its mirrors for the checks).
    """

    num_actual_tokens: int
    num_reqs: int
    block_size: int
    slot_mapping: torch.Tensor
    causal: bool
    query_start_loc: torch.Tensor
    max_query_len: int
    main: FlashAttnPass
    common_attn_metadata: CommonAttentionMetadata
    layer_names: frozenset[str]
    prefix: FlashAttnPass | None = None
    encoder: FlashAttnPass | None = None
    common_prefix_len: int = 0
    uses_persistent_buffers: bool = False


# The key length of a CUDA-graph batch's padding rows: FlashAttention skips a request without
# keys (its query offsets give it no query token either).
_PADDING_LEN = 0


class _DecodeBuffers:
    """The builder's persistent buffers, sized from `BatchLimits`, that hold the CUDA-graph
    decode layout (int32, on the builder's device)."""

    def __init__(self, max_num_reqs: int, max_blocks: int, device: torch.device) -> None:
        int32 = dict(dtype=torch.int32, device=device)
        self.arange = torch.arange(max_num_reqs + 1, **int32)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, **int32)
        self.seq_lens = torch.zeros(max_num_reqs, **int32)
        self.cu_seqlens_k = torch.zeros(max_num_reqs + 1, **int32)
        self.block_table = torch.zeros(max_num_reqs, max_blocks, **int32)
        # (what a replay step's copy writes, as the raw addresses its launch takes)
        self.addresses = (self.block_table.data_ptr(), self.seq_lens.data_ptr())


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Slices the step's tensors for FlashAttention; never syncs with the device. See the
    module docstring for the cascade and CUDA-graph layouts."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layers, limits, device) -> None:
        super().__init__(kv_cache_spec, layers, limits, device)
        FlashAttentionBackend.check_kv_cache_spec(kv_cache_spec, "FlashAttentionMetadataBuilder")
        self.block_size = kv_cache_spec.block_size
        # FA2's varlen call has no seqused_k: key lengths go in as cumulative offsets.
        self._needs_cu_seqlens_k = any(
            i.seq_lens_arg is None for i in versions.declared_interfaces()
        )
        self._max_blocks = -(-limits.max_model_len // self.block_size)
        too_large = [s for s in limits.cudagraph_capture_sizes if s > limits.max_num_reqs]
        if too_large:
            # (the decode graphs' buffers hold max_num_reqs requests: a larger size would be
            # cut to that silently)
            raise ValueError(
                "FlashAttentionMetadataBuilder: cudagraph_capture_sizes entries must be <= "
                f"max_num_reqs for single-token decode graphs (got {too_large} with "
                f"max_num_reqs={limits.max_num_reqs}). Drop those sizes or raise max_num_reqs."
            )
        self._buffers: _DecodeBuffers | None = None  # made by the first decode-layout build
        # The decode layout's pass per (padded batch, causal): views of the buffers, made once
        # (slicing tensors and making dataclasses was most of a replay step's host time).
        self._decode_passes: dict[tuple[int, bool], FlashAttnPass] = {}
        self._query_offsets_for: tuple[int, int] | None = None  # (num_reqs, padded) written
        self._copy_inputs = GraphDecodeInputsLaunch(
            self.device, "FlashAttentionMetadataBuilder.build"
        )
        self._layer_names = frozenset(self.layer_names)
        self._has_encoder_layers = any(p.attn_type in _ENCODER_TYPES for p in self.layers.values())

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashAttentionMetadata:
        cm = common_attn_metadata
        api = "FlashAttentionMetadataBuilder.build"
        # (the mirrors' values size the kernels: max_seqlen_q / _k, the table width)
        host = cm.host_batch
        cross = cm.encoder_seq_lens is not None
        max_k = int(cm.encoder_seq_lens_cpu[: cm.num_reqs].max()) if cross and cm.num_reqs else 0
        self._check_table_width(cm, max_k if cross else cm.max_seq_len, api)
        if common_prefix_len:
            if cross or self.kv_cache_spec.sliding_window is not None:
                raise ValueError(
                    f"{api}: cascade attention needs decoder attention without a sliding window "
                    f"(got common_prefix_len={common_prefix_len}). Pass 0."
                )
            return self._build_cascade(common_prefix_len, cm, api)
        sizes = self.limits.cudagraph_capture_sizes
        if not cross and sizes and cm.num_reqs <= max(sizes) and self._is_single_decode(cm):
            if not self.limits.has_persistent_graph_inputs:
                return self._build_decode(cm, padded_num_reqs(cm.num_reqs, sizes), host.max_seq_len)
            if cm.num_reqs in sizes:
                return self._build_decode_in_place(cm)
            self._refuse_unpadded_graph_step(cm, api)  # else no graph step: eager
        return self._build_plain(cm, cross, max_k)

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashAttentionMetadata:
        """Metadata in the builder's persistent buffers, for capturing a decode graph (under
        `BatchLimits.has_persistent_graph_inputs`, over the step's own tensors).

        Raises:
            ValueError: not a batch of single-token decodes within `max_num_reqs` (the level
                is UNIFORM_SINGLE_TOKEN_DECODE); under `has_persistent_graph_inputs`, a batch
                whose size is not a capture size.
        """
        cm = common_attn_metadata
        api = "FlashAttentionMetadataBuilder.build_for_cudagraph_capture"
        host = cm.host_batch
        if not self._is_single_decode(cm) or cm.encoder_seq_lens is not None:
            raise ValueError(
                f"{api}: CUDA graphs are supported for batches of single-token decodes (got "
                f"{cm.num_reqs} requests, {cm.num_actual_tokens} tokens, max_query_len "
                f"{cm.max_query_len}). Capture decode batches only."
            )
        self._check_table_width(cm, cm.max_seq_len, api)
        sizes = self.limits.cudagraph_capture_sizes
        if not self.limits.has_persistent_graph_inputs:
            return self._build_decode(cm, padded_num_reqs(cm.num_reqs, sizes), host.max_seq_len)
        if cm.num_reqs not in sizes:
            raise ValueError(
                f"{api}: with BatchLimits.has_persistent_graph_inputs a captured batch is "
                f"padded to a capture size (got {cm.num_reqs} requests, capture sizes "
                f"{sizes}). Pad it with dummy requests, or turn has_persistent_graph_inputs off."
            )
        return self._build_decode_in_place(cm)

    def _refuse_unpadded_graph_step(self, cm: CommonAttentionMetadata, api: str) -> None:
        """Under `has_persistent_graph_inputs`, a decode step whose slot mapping has a captured
        size's rows but fewer requests looks like a replay of that graph not padded to it: the
        graph would read rows (and FA2's key offsets) this step does not write."""
        rows = cm.slot_mapping.shape[0]
        if rows in self.limits.cudagraph_capture_sizes and cm.num_reqs < rows:
            raise ValueError(
                f"{api}: with BatchLimits.has_persistent_graph_inputs a CUDA-graph decode step "
                f"has num_reqs equal to its captured size (got {cm.num_reqs} requests over "
                f"{rows} slot_mapping rows, capture sizes {self.limits.cudagraph_capture_sizes})."
                " Pad the batch with dummy requests, or turn has_persistent_graph_inputs off."
            )

    def _is_single_decode(self, cm: CommonAttentionMetadata) -> bool:
        # every query length is >= 1, so a maximum of 1 with one token per request means all 1
        return (
            0 < cm.num_reqs <= self.limits.max_num_reqs
            and cm.max_query_len == 1
            and cm.num_actual_tokens == cm.num_reqs
            and cm.max_seq_len <= self._max_blocks * self.block_size
        )

    def _check_table_width(self, cm: CommonAttentionMetadata, max_k: int, api: str) -> None:
        needed = -(-max_k // self.block_size)
        if needed > cm.block_table_tensor.shape[1] or cm.block_table_tensor.shape[0] < cm.num_reqs:
            raise ValueError(
                f"{api}: block_table too small for the batch (got shape "
                f"{tuple(cm.block_table_tensor.shape)}, expected >= [{cm.num_reqs}, {needed}] "
                f"for block_size {self.block_size})."
            )

    def _upload(self, cpu: torch.Tensor) -> torch.Tensor:
        # From pageable memory the copy is staged at once; the host never waits on the device.
        return cpu.to(self.device, non_blocking=True)

    def _metadata(
        self, cm: CommonAttentionMetadata, main: FlashAttnPass, **kw
    ) -> FlashAttentionMetadata:
        encoder = None
        if self._has_encoder_layers:
            qsl, max_q = cm.query_start_loc, cm.max_query_len
            encoder = FlashAttnPass(qsl, None, qsl, None, max_q, max_q, False)
        return FlashAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=cm.num_reqs,
            block_size=self.block_size,
            slot_mapping=cm.slot_mapping,
            causal=cm.causal,
            query_start_loc=kw.pop("query_start_loc", main.cu_seqlens_q),
            max_query_len=cm.max_query_len,
            main=main,
            common_attn_metadata=cm,
            layer_names=self._layer_names,
            encoder=encoder,
            **kw,
        )

    def _build_plain(
        self, cm: CommonAttentionMetadata, cross: bool, max_cross_len: int
    ) -> FlashAttentionMetadata:
        num_reqs = cm.num_reqs
        lens, lens_cpu = (
            (cm.encoder_seq_lens, cm.encoder_seq_lens_cpu)
            if cross
            else (cm.seq_lens, cm.seq_lens_cpu)
        )
        cu_k = None
        if self._needs_cu_seqlens_k:
            cu_k = self._upload(cu_seqlens_from_lens(lens_cpu[:num_reqs]))
        main = FlashAttnPass(
            cu_seqlens_q=cm.query_start_loc[: num_reqs + 1],
            seq_lens=lens[:num_reqs],
            cu_seqlens_k=cu_k,
            page_table=cm.block_table_tensor[:num_reqs],
            max_seqlen_q=cm.max_query_len,
            max_seqlen_k=max_cross_len if cross else cm.max_seq_len,
            causal=cm.causal and not cross,
        )
        return self._metadata(cm, main)

    def _decode_buffers(self) -> _DecodeBuffers:
        """The CUDA-graph buffers, made by the first build that needs them."""
        if self._buffers is None:
            self._buffers = _DecodeBuffers(self.limits.max_num_reqs, self._max_blocks, self.device)
        return self._buffers

    def _build_decode(
        self, cm: CommonAttentionMetadata, padded: int, longest: int
    ) -> FlashAttentionMetadata:
        """The CUDA-graph decode layout of `cm`'s decodes padded to `padded`, in the builder's
        buffers (`longest`: the mirrors' longest sequence, whose pages are the columns copied)."""
        buf, n = self._decode_buffers(), cm.num_reqs
        main = self._decode_passes.get((padded, cm.causal))
        if main is None:
            main = self._decode_passes[(padded, cm.causal)] = FlashAttnPass(
                cu_seqlens_q=buf.query_start_loc[: padded + 1],
                seq_lens=buf.seq_lens[:padded],
                cu_seqlens_k=buf.cu_seqlens_k[: padded + 1] if self._needs_cu_seqlens_k else None,
                page_table=buf.block_table[:padded],
                max_seqlen_q=1,
                # a bound every replay of the graph satisfies
                max_seqlen_k=self.limits.max_model_len,
                causal=cm.causal,
            )
        # Device-side writes only, into the addresses the captured graph reads: one launch
        # copies the table's rows (the columns the longest request reads, which `build` has
        # checked the table and the buffer hold) and the lengths, padding rows of length 0.
        self._copy_inputs(
            cm.block_table_tensor, cm.seq_lens, buf.block_table, main.seq_lens, n,
            -(-longest // self.block_size), _PADDING_LEN, buf.addresses,
        )  # fmt: skip
        if self._query_offsets_for != (n, padded):
            # 0, 1, ..., n, then n for the padding: rewritten only when n or the size changes
            torch.clamp(buf.arange[: padded + 1], max=n, out=main.cu_seqlens_q)
            self._query_offsets_for = (n, padded)
        if main.cu_seqlens_k is not None:
            torch.cumsum(main.seq_lens, 0, out=main.cu_seqlens_k[1:])
        return self._metadata(cm, main, uses_persistent_buffers=True)

    def _build_decode_in_place(self, cm: CommonAttentionMetadata) -> FlashAttentionMetadata:
        """A graph step of a captured size over the step's own tensors, which the runner keeps
        at the captured addresses (`BatchLimits.has_persistent_graph_inputs`): the plain layout
        with `max_seqlen_k` bounded by `max_model_len`, as the graph was captured."""
        n = cm.num_reqs
        lens = first_rows(cm.seq_lens, n)
        cu_k = None
        if self._needs_cu_seqlens_k:
            # FA2 reads key offsets, which the step does not carry: summed on the device into
            # a builder buffer the graph reads (a fresh tensor would move every step)
            cu_k = self._decode_buffers().cu_seqlens_k[: n + 1]
            torch.cumsum(lens, 0, out=cu_k[1:])
        main = FlashAttnPass(
            cu_seqlens_q=first_rows(cm.query_start_loc, n + 1),
            seq_lens=lens,
            cu_seqlens_k=cu_k,
            page_table=first_rows(cm.block_table_tensor, n),
            max_seqlen_q=1,
            max_seqlen_k=self.limits.max_model_len,
            causal=cm.causal,
        )
        return self._metadata(cm, main)

    def _build_cascade(
        self, common_prefix_len: int, cm: CommonAttentionMetadata, api: str
    ) -> FlashAttentionMetadata:
        num_reqs = cm.num_reqs
        plan = plan_cascade(
            common_prefix_len,
            self.block_size,
            cm.seq_lens_cpu[:num_reqs],
            cm.num_computed_tokens_cpu[:num_reqs],
            cm.num_actual_tokens,
            api=api,
        )
        prefix_table, suffix_table = cascade_block_tables(
            cm.block_table_tensor, num_reqs, plan.prefix_blocks
        )
        needs_cu = self._needs_cu_seqlens_k
        prefix = FlashAttnPass(
            cu_seqlens_q=self._upload(plan.prefix_cu_seqlens_q),
            seq_lens=self._upload(plan.prefix_seq_lens),
            cu_seqlens_k=self._upload(plan.prefix_cu_seqlens_k) if needs_cu else None,
            page_table=prefix_table,
            max_seqlen_q=plan.num_tokens,
            max_seqlen_k=common_prefix_len,
            causal=False,  # every query of the step comes after the shared prefix
        )
        suffix = FlashAttnPass(
            cu_seqlens_q=cm.query_start_loc[: num_reqs + 1],
            seq_lens=self._upload(plan.suffix_seq_lens),
            cu_seqlens_k=self._upload(plan.suffix_cu_seqlens_k) if needs_cu else None,
            # a copy on the device: some versions want the page table contiguous
            page_table=suffix_table.contiguous(),
            max_seqlen_q=cm.max_query_len,
            max_seqlen_k=plan.suffix_max_seq_len,
            causal=cm.causal,
        )
        return self._metadata(cm, suffix, prefix=prefix, common_prefix_len=common_prefix_len)

    def use_cascade_attention(
        self,
        common_prefix_len: int,
        query_lens: np.ndarray,
        num_query_heads: int,
        num_kv_heads: int,
        use_alibi: bool,
        use_sliding_window: bool,
        num_sms: int,
    ) -> bool:
        """Cascade pays off when many requests share a long prefix (see
        `flash_attn_plan.cascade_is_worthwhile`); position-dependent modifiers and versions
        without LSE rule it out."""
        if use_alibi or use_sliding_window:
            return False
        if self.kv_cache_spec.sliding_window is not None or common_prefix_len % self.block_size:
            return False
        if not FlashAttentionBackend.supports_cascade():
            return False
        return cascade_is_worthwhile(
            common_prefix_len, query_lens, num_query_heads, num_kv_heads, num_sms
        )


def _aligned(x: torch.Tensor) -> bool:
    """Whether FlashAttention can write `x` directly: a contiguous last dimension and 16-byte
    aligned start and strides (FA4's forward asserts this of `out`; else we copy)."""
    size = x.element_size()
    return (
        x.stride(-1) == 1
        and x.data_ptr() % 16 == 0
        and all(stride * size % 16 == 0 for stride in x.stride()[:-1])
    )


class FlashAttentionImpl(AttentionImpl[FlashAttentionMetadata]):
    """The FLASH_ATTN backend's forward; see the module docstring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sinks = None if self.sinks is None else self.sinks.detach().float()
        self._request = versions.FlashAttnRequest(
            head_size=self.head_size,
            kv_cache_dtype=self.kv_cache_dtype,
            attn_type=self.attn_type,
            has_alibi=self.alibi_slopes is not None,
            has_sink=self.sinks is not None,
            has_logits_soft_cap=self.logits_soft_cap is not None,
            has_sliding_window=self.sliding_window is not None,
        )
        installed = versions.installed_interfaces()
        if not installed:
            raise ImportError(f"FLASH_ATTN impl: {versions.unavailable_reason()}.")
        chosen, why = versions.choose_interface(installed, self._request)
        if chosen is None:
            raise NotImplementedError(
                f"FLASH_ATTN impl: no installed FlashAttention takes this layer ({'; '.join(why)})."
            )
        self._any_device_interface = chosen
        self._interfaces: dict[torch.device, versions.FlashAttnInterface] = {}

    def _interface_for(self, device: torch.device) -> versions.FlashAttnInterface:
        """The version for `device`'s compute capability, chosen once per device."""
        interface = self._interfaces.get(device)
        if interface is None:
            capability = None
            if device.type == "cuda":
                capability = torch.cuda.get_device_capability(device)
            request = replace(self._request, capability=capability)
            interface, why = versions.choose_interface(versions.installed_interfaces(), request)
            if interface is None:
                raise NotImplementedError(
                    f"FLASH_ATTN forward: no installed FlashAttention runs this layer on "
                    f"{device} ({'; '.join(why)})."
                )
            self._interfaces[device] = interface
        return interface

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `AttentionImpl.forward`. Writes `output[:num_actual_tokens]` (and `output_lse`)."""
        md = attn_metadata
        check_layer_planned(md.layer_names, layer, "FLASH_ATTN forward")
        check_forward(self, query, key, value, kv_cache, md, output, output_lse)
        n = md.num_actual_tokens
        if n == 0:
            return output
        interface = self._interface_for(query.device)
        lse = None if output_lse is None else output_lse[:, :n]
        if self.attn_type in _ENCODER_TYPES:
            # Bidirectional self-attention over the step's own keys: no cache.
            out, part_lse = self._attend(
                interface, query[:n], key[:n], value[:n], md.encoder, self.sinks, lse is not None
            )
            self._store(output[:n], out, lse, part_lse)
            return output
        # [num_blocks, block_size, num_kv_heads, head_size] views, strides of the layout
        k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
        q = query[:n]
        if md.prefix is None:
            rows = output[:n]
            out_arg = rows if interface.has_out and _aligned(rows) else None
            out, part_lse = self._attend(
                interface, q, k_cache, v_cache, md.main, self.sinks, lse is not None, out=out_arg
            )
            self._store(output[:n], out, lse, part_lse)
            return output
        prefix_out, prefix_lse = self._attend(interface, q, k_cache, v_cache, md.prefix, None, True)
        suffix_out, suffix_lse = self._attend(
            interface, q, k_cache, v_cache, md.main, self.sinks, True
        )
        merge_attn_states(output[:n], prefix_out, prefix_lse, suffix_out, suffix_lse, lse)
        return output

    def _attend(
        self,
        interface: versions.FlashAttnInterface,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pass_: FlashAttnPass,
        sinks: torch.Tensor | None,
        return_lse: bool,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One kernel call (every FlashAttention call of the backend goes through here)."""
        device = q.device
        # Paged keys by per-request lengths where the entry point takes them; contiguous
        # (encoder) keys and FA2 by cumulative offsets.
        if pass_.page_table is not None and interface.seq_lens_arg:
            lens = {"seq_lens": pass_.seq_lens}
        else:
            lens = {"cu_seqlens_k": pass_.cu_seqlens_k}
        out, lse = interface.call(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=pass_.cu_seqlens_q,
            max_seqlen_q=pass_.max_seqlen_q,
            max_seqlen_k=pass_.max_seqlen_k,
            page_table=pass_.page_table,
            softmax_scale=self.scale,
            causal=pass_.causal,
            window=self.sliding_window,
            softcap=self.logits_soft_cap,
            sinks=None if sinks is None else _on(self, "sinks", device),
            alibi_slopes=None if self.alibi_slopes is None else _on(self, "alibi_slopes", device),
            return_lse=return_lse,
            out=out,
            **lens,
        )
        if return_lse and (lse is None or tuple(lse.shape) != (self.num_heads, q.shape[0])):
            got = None if lse is None else tuple(lse.shape)
            raise RuntimeError(
                f"FLASH_ATTN forward: {interface.label} returned an LSE of an unexpected shape "
                f"(got {got}, expected {(self.num_heads, q.shape[0])})."
            )
        return out, lse

    @staticmethod
    def _store(
        output: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        part_lse: torch.Tensor | None,
    ) -> None:
        if out.data_ptr() != output.data_ptr():
            output.copy_(out)
        if lse is not None:
            lse.copy_(part_lse)

    def validate_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: FlashAttentionMetadata,
        output: torch.Tensor,
        output_lse: torch.Tensor | None = None,
    ) -> None:
        """See `AttentionImpl.validate_inputs`; shapes, dtypes, devices and feature joints."""
        api = "FLASH_ATTN forward"
        check_forward_inputs(
            api,
            self,
            FlashAttentionBackend.supported_dtypes,
            query,
            key,
            value,
            kv_cache,
            md,
            FlashAttentionMetadata,
            output=output,
            output_lse=output_lse,
            reads_cache=self.attn_type not in _ENCODER_TYPES,
        )
        self._check_features(md, output_lse, api)
        interface = self._interface_for(query.device)
        if md.block_size % interface.block_size_multiple:
            raise ValueError(
                f"{api}: {interface.label} needs blocks of a multiple of "
                f"{interface.block_size_multiple} tokens (got block_size {md.block_size})."
            )
        if self.attn_type not in _ENCODER_TYPES:
            self._check_cache(query, kv_cache, api)

    def _check_features(
        self, md: FlashAttentionMetadata, output_lse: torch.Tensor | None, api: str
    ) -> None:
        # (a sliding window with non-causal attention: refused by check_forward_inputs)
        if self.attn_type in _ENCODER_TYPES and md.encoder is None:
            raise ValueError(
                f"{api}: the metadata was built for no encoder layer (got an "
                f"{self.attn_type.value} layer). Give the builder this layer's record."
            )
        bidirectional = not md.causal or self.attn_type is not AttentionType.DECODER
        if self.alibi_slopes is not None and bidirectional:
            raise NotImplementedError(
                f"{api}: ALiBi with non-causal attention not supported (got "
                "attn_metadata.causal=False); FA2 biases by -slope * |i - j|."
            )
        if md.prefix is not None and (self.alibi_slopes is not None or self.sliding_window):
            raise NotImplementedError(
                f"{api}: cascade attention with ALiBi or a sliding window not supported (got "
                f"common_prefix_len={md.common_prefix_len}). Build without a common prefix."
            )
        if (output_lse is not None or md.prefix is not None) and (
            self._any_device_interface.lse_arg is None
        ):
            raise NotImplementedError(
                f"{api}: {self._any_device_interface.label} returns no LSE (got output_lse or a "
                "cascade prefix)."
            )

    def _check_cache(self, query: torch.Tensor, kv_cache: torch.Tensor, api: str) -> None:
        """What FlashAttention adds to the shared checks: one dtype for q/k/v and a contiguous
        head dimension."""
        cache_dtype = cache_torch_dtype(self.kv_cache_dtype, query.dtype)
        if cache_dtype != query.dtype:
            raise ValueError(
                f"{api}: kv_cache dtype differs from the query's (got {cache_dtype} and "
                f"{query.dtype}, expected one dtype). Use kv_cache_dtype='auto'."
            )
        if kv_cache.stride(-1) != 1:
            raise ValueError(
                f"{api}: kv_cache needs a contiguous head dimension (got strides "
                f"{kv_cache.stride()}). Allocate it in NHD or HND order."
            )


def _on(impl: FlashAttentionImpl, name: str, device: torch.device) -> torch.Tensor:
    """`impl.<name>` on `device`, moved there once and kept."""
    tensor = getattr(impl, name)
    if tensor.device != device:
        tensor = tensor.to(device)
        setattr(impl, name, tensor)
    return tensor


FlashAttentionImpl.backend = FlashAttentionBackend
