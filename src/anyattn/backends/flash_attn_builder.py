"""FLASH_ATTN's plan: the metadata its builder makes for a step, and the builder.

`build` plans from the step's CPU mirrors (`CommonAttentionMetadata.host_batch`), slices the
step's device tensors and, for cascade and CUDA-graph decode batches, fills builder-owned
buffers with device-side copies; it never reads a device value.

Cascade attention (`common_prefix_len > 0`): a prefix pass runs every query of the step as one
request against the shared prefix blocks (non-causal: every query follows them); a suffix pass
runs each request against its remaining blocks; `merge_attn_states` joins the two by their LSEs.
Sinks go to the suffix pass only, so they are counted once.

CUDA graphs (UNIFORM_SINGLE_TOKEN_DECODE): a batch of single-token decodes of at most the
largest capture size is copied into buffers the builder owns (sized from `BatchLimits`), laid
out for the smallest capture size that holds it: padding requests have no query token and no
keys, and `max_seqlen_k` is `max_model_len`, so a graph captured for that size replays for any
such batch. Such metadata stays valid until the builder's next build; under replay, output rows
between the real tokens and the captured size hold unspecified values. With
`BatchLimits.has_persistent_graph_inputs` (the runner keeps a graph step's tensors at fixed
addresses, padded to the captured size) a batch of a captured size reads the step's own tensors
instead (FA2's key offsets, which the step does not carry, are still summed into a builder
buffer); a batch of another size is an eager step then.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from anyattn.async_copy import to_device
from anyattn.backend import AttentionMetadataBuilder
from anyattn.backends import flash_attn_versions as versions
from anyattn.backends.flash_attn_entry_point import paged_bidirectional_is_faulty
from anyattn.backends.flash_attn_plan import (
    cascade_is_worthwhile,
    contiguous_key_rows,
    cu_seqlens_from_lens,
    padded_num_reqs,
    plan_cascade,
)
from anyattn.metadata import CommonAttentionMetadata
from anyattn.types import ENCODER_TYPES, AttentionCGSupport

__all__ = ["FlashAttentionMetadata", "FlashAttentionMetadataBuilder", "FlashAttnPass"]


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
        key_rows: int64 `(blocks, offsets)`, each `[sum of key lengths]` (device), when the
            keys are read out of the paged cache into contiguous rows (`cache[blocks,
            offsets]`, by `cu_seqlens_k`) because the kernel's paged bidirectional path is
            wrong at this head size (`flash_attn_entry_point.paged_bidirectional_is_faulty`);
            `page_table` is then None.
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    page_table: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    key_rows: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class FlashAttentionMetadata:
    """What `FlashAttentionImpl.forward` needs for one step. Read-only: in the CUDA-graph
    decode layout its tensors are views of the builder's persistent buffers, which the next
    build rewrites.

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
        uses_persistent_buffers: the tensors are the builder's CUDA-graph buffers (False
            under `BatchLimits.has_persistent_graph_inputs`, whose graph steps read their own).
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


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Slices the step's tensors for FlashAttention; never syncs with the device. See the
    module docstring for the cascade and CUDA-graph layouts."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layers, limits, device) -> None:
        super().__init__(kv_cache_spec, layers, limits, device)
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
        self._layer_names = frozenset(self.layer_names)
        self._has_encoder_layers = any(p.attn_type in ENCODER_TYPES for p in self.layers.values())

    @cached_property
    def _gather_bidirectional(self) -> bool:
        """Whether bidirectional passes read their keys contiguously: where the newest installed
        version's paged kernel is wrong for them (the impl runs the newest version that takes a
        layer). Asked at the first build, so that making a builder touches no device."""
        installed = versions.installed_interfaces()
        if not installed:
            return False
        cuda = self.device.type == "cuda"
        capability = torch.cuda.get_device_capability(self.device) if cuda else None
        return paged_bidirectional_is_faulty(installed[0], capability, self.kv_cache_spec.head_size)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> FlashAttentionMetadata:
        cm = common_attn_metadata
        api = "FlashAttentionMetadataBuilder.build"
        cross = cm.encoder_seq_lens is not None
        max_k = int(cm.encoder_seq_lens_cpu[: cm.num_reqs].max()) if cross and cm.num_reqs else 0
        self._check_table_width(cm, max_k if cross else cm.max_seq_len, api)
        if common_prefix_len and not self._gather_bidirectional:
            # (under gathering the cascade's bidirectional prefix pass would read paged keys;
            # the plain layout gives the same result)
            if cross or self.kv_cache_spec.sliding_window is not None:
                raise ValueError(
                    f"{api}: cascade attention needs decoder attention without a sliding window "
                    f"(got common_prefix_len={common_prefix_len}). Pass 0."
                )
            return self._build_cascade(common_prefix_len, cm, api)
        sizes = self.limits.cudagraph_capture_sizes
        if not cross and sizes and cm.num_reqs <= max(sizes) and self._is_single_decode(cm):
            if not self.limits.has_persistent_graph_inputs or cm.num_reqs in sizes:
                return self._build_decode(cm)
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
        if not self._is_single_decode(cm) or cm.encoder_seq_lens is not None:
            raise ValueError(
                f"{api}: CUDA graphs are supported for batches of single-token decodes (got "
                f"{cm.num_reqs} requests, {cm.num_actual_tokens} tokens, max_query_len "
                f"{cm.max_query_len}). Capture decode batches only."
            )
        self._check_table_width(cm, cm.max_seq_len, api)
        sizes = self.limits.cudagraph_capture_sizes
        if self.limits.has_persistent_graph_inputs and cm.num_reqs not in sizes:
            raise ValueError(
                f"{api}: with BatchLimits.has_persistent_graph_inputs a captured batch is "
                f"padded to a capture size (got {cm.num_reqs} requests, capture sizes "
                f"{sizes}). Pad it with dummy requests, or turn has_persistent_graph_inputs off."
            )
        return self._build_decode(cm)

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
        return to_device(cpu, self.device)

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
            query_start_loc=main.cu_seqlens_q,
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
        # keys read contiguously where the paged kernel is wrong (`_gather_bidirectional`)
        gather = self._gather_bidirectional and (cross or not cm.causal)
        cu_k = key_rows = None
        if gather or self._needs_cu_seqlens_k:
            cu_k = self._upload(cu_seqlens_from_lens(lens_cpu[:num_reqs]))
        if gather:
            table = cm.block_table_tensor if cm.block_table_cpu is None else cm.block_table_cpu
            blocks, offsets = contiguous_key_rows(table, lens_cpu[:num_reqs], self.block_size)
            key_rows = (self._upload(blocks), self._upload(offsets))
        main = FlashAttnPass(
            cu_seqlens_q=cm.query_start_loc[: num_reqs + 1],
            seq_lens=None if gather else lens[:num_reqs],
            cu_seqlens_k=cu_k,
            page_table=None if gather else cm.block_table_tensor[:num_reqs],
            max_seqlen_q=cm.max_query_len,
            max_seqlen_k=max_cross_len if cross else cm.max_seq_len,
            causal=cm.causal and not cross,
            key_rows=key_rows,
        )
        return self._metadata(cm, main)

    def _decode_buffers(self) -> _DecodeBuffers:
        """The CUDA-graph buffers, made by the first build that needs them."""
        if self._buffers is None:
            self._buffers = _DecodeBuffers(self.limits.max_num_reqs, self._max_blocks, self.device)
        return self._buffers

    def _build_decode(self, cm: CommonAttentionMetadata) -> FlashAttentionMetadata:
        """The CUDA-graph decode layout of `cm`'s single-token decodes: copied into the
        builder's buffers, padded to the smallest capture size that holds them; or, under
        `BatchLimits.has_persistent_graph_inputs`, the step's own tensors (a captured size, at
        the captured addresses). `max_seqlen_k` is `max_model_len`, a bound every replay
        satisfies."""
        n = cm.num_reqs
        persistent = self.limits.has_persistent_graph_inputs
        if persistent:
            padded, qsl, lens, table = n, cm.query_start_loc, cm.seq_lens, cm.block_table_tensor
        else:
            buf = self._decode_buffers()
            padded = padded_num_reqs(n, self.limits.cudagraph_capture_sizes)
            cols = -(-cm.host_batch.max_seq_len // self.block_size)  # `build` checked the width
            # Device-side copies into the addresses the captured graph reads; padding rows get
            # no query token and no keys.
            buf.block_table[:n, :cols].copy_(cm.block_table_tensor[:n, :cols])
            buf.seq_lens[:n].copy_(cm.seq_lens[:n])
            buf.seq_lens[n:padded].fill_(_PADDING_LEN)
            torch.clamp(buf.arange[: padded + 1], max=n, out=buf.query_start_loc[: padded + 1])
            qsl, lens, table = buf.query_start_loc, buf.seq_lens, buf.block_table
        cu_k = None
        if self._needs_cu_seqlens_k:
            # FA2 reads key offsets, which the step does not carry: summed on the device into
            # a builder buffer the graph reads (a fresh tensor would move every step)
            cu_k = self._decode_buffers().cu_seqlens_k[: padded + 1]
            torch.cumsum(lens[:padded], 0, out=cu_k[1:])
        main = FlashAttnPass(
            cu_seqlens_q=qsl[: padded + 1],
            seq_lens=lens[:padded],
            cu_seqlens_k=cu_k,
            page_table=table[:padded],
            max_seqlen_q=1,
            max_seqlen_k=self.limits.max_model_len,
            # one query token per request, the last: causal and bidirectional agree, and
            # the causal kernel is right where FA4's paged bidirectional one is not
            causal=True,
        )
        return self._metadata(cm, main, uses_persistent_buffers=not persistent)

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
        table, blocks = cm.block_table_tensor, plan.prefix_blocks
        needs_cu = self._needs_cu_seqlens_k
        prefix = FlashAttnPass(
            cu_seqlens_q=self._upload(plan.prefix_cu_seqlens_q),
            seq_lens=self._upload(plan.prefix_seq_lens),
            cu_seqlens_k=self._upload(plan.prefix_cu_seqlens_k) if needs_cu else None,
            page_table=table[:1, :blocks],  # every row holds the same prefix ids
            max_seqlen_q=plan.num_tokens,
            max_seqlen_k=common_prefix_len,
            causal=False,  # every query of the step comes after the shared prefix
        )
        suffix = FlashAttnPass(
            cu_seqlens_q=cm.query_start_loc[: num_reqs + 1],
            seq_lens=self._upload(plan.suffix_seq_lens),
            cu_seqlens_k=self._upload(plan.suffix_cu_seqlens_k) if needs_cu else None,
            # a copy on the device: some versions want the page table contiguous
            page_table=table[:num_reqs, blocks:].contiguous(),
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
        if self._gather_bidirectional:  # its prefix pass would be bidirectional over pages
            return False
        if self.kv_cache_spec.sliding_window is not None or common_prefix_len % self.block_size:
            return False
        if self.backend is not None and not self.backend.supports_cascade():
            return False
        return cascade_is_worthwhile(
            common_prefix_len, query_lens, num_query_heads, num_kv_heads, num_sms
        )
