"""FLEX_ATTENTION: PyTorch's FlexAttention (`torch.nn.attention.flex_attention`), compiled.

One compiled `flex_attention` call per layer and step covers the whole batch (decodes, fresh
and chunked prefills, encoder and cross attention), on the CPU (Inductor's C++ template) and on
CUDA GPUs (its Triton template).

How a step is laid out for the kernel (the plan, built from the CPU mirrors only):

- Keys: each layer copies each request's keys out of the paged cache, token by token, into
  contiguous workspaces `[num_kv_heads, kv_rows, head_size]` for K and for V (any block size,
  NHD or HND, fp8 dequantised on the way) with `ops.gather_kv_rows`: one Triton launch on
  CUDA, which reads the block table and the device `seq_lens` directly, so no per-key index
  array is ever made and the builder does no device work at all. Row 0 is reserved (the sink
  slot: V = 0; its key's score is replaced by the sink logit or masked, so K row 0 is not
  cleared: it holds zeros or earlier finite keys); the requests' keys follow back to back
  from row `FIRST_KEY_ROW` (one tile on: a fresh prefill's causal diagonal then lies on tile
  boundaries), request r's at `key_start[r] ...` (less the skipped requests' keys where
  decodes read the cache in place, below). Encoder attention copies the step's own key/value
  there.
- Decodes on CUDA read the cache in place (`flex_attention_paged`): K and V are strided views
  of the cache, each request's BlockMask lists its own blocks, and FlexAttention's decoding
  kernel runs compiled for a static batch bucket; no key is copied, and a mixed step copies
  only its other requests' keys, into a workspace sized for them alone
  (`flex_attention_plan.skipping_keys`). This needs a decoder layer without ALiBi or sinks, a
  cache of the model dtype and a block size that is a power of two of at least 16; other decodes
  (and every decode on the CPU, whose template cannot compile that plan) take the decode
  layout.
- The decode layout: the builder asks for decodes first (`reorder_batch_threshold` 1), and
  the step's leading single-token requests take the decode layout: batch entry b is request b,
  its query rows are its G query heads of one KV head (`[batch, KVH, G, D]`, the query's own
  layout, read in place where the caller's query has a row for every padded entry, else
  copied into a buffer of the padded batch), and its block lists name only its own key
  tiles, so FlexAttention's decoding kernel reads each request's keys once. (Served by the
  rows instead, when they folded GQA into rows, a 128-row tile held 128 / G requests and
  visited all their keys for every row: for 64 x 4096 on an H200 the attention took 3.3 ms
  there, with the other fixes below, and 0.37 ms here.)
- Other tokens: one batch entry, a row per token, every query head (FlexAttention's GQA,
  `enable_gqa`, maps query head h to KV head h // G). The queries are copied token-major
  into a buffer of whole row tiles (`[rows, H, D]`, viewed as `[1, H, rows, D]`: one
  contiguous copy), unless the caller's contiguous query already holds the padded rows from
  token 0 on (a step without decodes whose batch is a bucket's size or padded past it: it is
  read as it is); FlexAttention gives the output the query's strides, so the copy into the
  caller's output is contiguous too. (Before, GQA was folded into the rows, row
  `t * G + g` of one KV head: two transposing copies, 326 us of a 4 x 4096 prefill on an
  H200 against 133 us for these two, measured in a throwaway experiment.)
- Masks: token t of request r keeps keys `lo[t] <= kv <= hi[t]` in workspace coordinates
  (causal: `hi` is the token's own position; non-causal: the request's last key; a window of W
  raises `lo`). The `BlockMask` (128 x 128 tiles, partial and full tiles apart) is computed
  with numpy from those bounds; tiles no row needs are skipped by the kernel. It is made by the
  first layer of a step that needs it and shared by the others (`flex_attention_masks`).
- Score mods: the scale, soft cap `cap * tanh(s / cap)`, then ALiBi `s + slope * (j - p)`; a
  sink is the reserved key 0, whose score is the sink logit and whose value is zero, so it
  enters the denominator only (and the LSE, as DESIGN.md asks). Which mods a layer has is
  static; their values (scale, cap, slopes, sinks) are tensors, so layers differing only in
  them share a graph.

Compilation. A configuration is (device type, dtype, head size, query and KV heads, which score
mods, LSE or not, decode layout or rows); each has its own compiled function, so
torch.compile's limit of 8 graphs per function never sends one back to the slow eager path.
Row, key and batch counts are padded to buckets (`flex_attention_plan.pad_rows`, `pad_keys`,
`pad_decodes`) and compiled as dynamic sizes (per-head score-mod sizes marked static): after
its first step a configuration does not recompile, whatever the batch and sequence lengths
(tests/backends/test_flex_attention.py counts it). On CUDA the kernel's inputs are set up so
that dynamic shapes cost nothing: K and V each at storage offset 0 (alignment provable) and
rows given as `[tiles, 128]` (lengths known multiples of the kernel's blocks); before, the same
kernel took 1.8-2.0x as long as with static shapes. The paged decode is the exception:
FlexAttention takes its decoding kernel only for a static batch (with a symbolic one it falls
back to its main kernel, 1.8x slower), so it compiles one static graph per batch bucket
(`pad_paged_batch`: 18 up to 256 requests) and cache geometry, each in a function of its own.

First-call cost on the CPU, measured on a 2-core x86 machine with torch 2.13: about 40 s for
the first configuration of a cold process (Inductor's start-up and precompiled header
included; about 34 s with a warm header), 7-8 s for each further configuration (the decode
layout and the rows are two configurations); later steps of a compiled configuration
cost only their run. Inductor's on-disk caches (TORCHINDUCTOR_CACHE_DIR)
shorten later processes.

Speed on an H200 (benchmarks/RESULTS.md, torch 2.11, bf16, 32 / 8 heads of 128): this is the
portable backend, not the fastest. Against FlexAttention called directly on keys already laid
out (what a user of the library would write for the same batch): decode 64 x 4096 0.95-0.96x
with 16- and 64-token blocks (250-255 us; FLASHINFER 248-256 us), reading the cache in place
(16-token pages took 1.81x and 64-token pages 1.02x with FlexAttention's default launch:
`flex_attention_launch.paged_decode_options` pipelines them); a mixed step of 48 such decodes
and 2 chunked prefills 1.01x with 16-token blocks and 0.96x with 64; prefill 4 x 4096 0.94-0.95x
(16 x 1024: 1.14x, measured before the rows launch below). The prefill's kernels run with
64-row query tiles on sm90 (`flex_attention_launch.rows_kernel_options`, 0.91x the default
launch's time), the keys one tile into the workspace (`FIRST_KEY_ROW`: 1.10x with the keys from
row 1, whose causal diagonal straddled two key tiles) and the query read in place. What the
wrapper adds is copies: the output copy, 55-67 us of a 4 x 4096 prefill (FlexAttention has no
`out=`, and Inductor does not fuse a copy compiled after it into its template), and the key
copy out of the paged cache, 41.7 us of the forward there (`ops.gather_kv_rows` alone: 38.1 us,
1.08x a contiguous copy of its bytes; a prefill reading the cache in place measured slower:
1.11x at 64-token pages, thirteenth session). The
first step of each new decode batch bucket compiles for 1-4 s on an H200. On a 2-core CPU the
decode layout took a 16 x 1024 decode step from 32.2 ms (the rows) to 14.5 ms.

Limits, all declared: LSE output only on CUDA (Inductor's CPU template has no LSE); no cascade;
sliding window only causal (as TORCH); head sizes multiples of 16 up to 256 (Triton's dot
needs 16; the CPU template takes more, but one declaration serves both); no CUDA graphs.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from anyattn.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
)
from anyattn.backends.flex_attention_launch import paged_decode_options, rows_kernel_options
from anyattn.backends.flex_attention_masks import (
    DecodePlan,
    RowsPlan,
    make_decode_plan,
    make_rows_plan,
    score_mod,
)
from anyattn.backends.flex_attention_paged import (
    PagedDecodePlan,
    PagedKV,
    make_paged_decode_plan,
    paged_kv_views,
)
from anyattn.backends.flex_attention_plan import (
    FIRST_KEY_ROW,
    TILE,
    StepLayout,
    lay_out_owned,
    pad_keys,
    skipping_keys,
)
from anyattn.metadata import CommonAttentionMetadata
from anyattn.ops.gather_kv_rows import MAX_NUM_REQS, gather_kv_rows
from anyattn.types import AttentionCGSupport, AttentionType, KVCacheLayout, is_fp8_cache
from anyattn.validation import check_forward, check_forward_inputs, layer_kv_scale

__all__ = [
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexAttentionMetadataBuilder",
]

_API = "FLEX_ATTENTION forward"

_ENCODER_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)


class FlexAttentionBackend(AttentionBackend):
    """Declarations of the FLEX_ATTENTION backend (see the module docstring)."""

    priority: ClassVar[Mapping[str, int]] = {"cpu": 1, "cuda": 3, "blackwell": 3}

    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_device_types = ("cpu", "cuda")
    supported_attn_types = tuple(AttentionType)
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
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Keys are copied token by token: NHD keeps a token's heads in one contiguous row.
        return (KVCacheLayout.NHD, KVCacheLayout.HND)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(16, 257, 16))

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_alibi(cls) -> bool:
        return True

    @classmethod
    def supports_logits_soft_cap(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True

    @classmethod
    def supports_lse(cls) -> bool:
        """On CUDA only; `supports_combination` rejects `needs_lse` on the CPU."""
        return True

    @classmethod
    def supports_combination(cls, config, device) -> str | None:
        reasons = []
        if config.needs_lse and device.type == "cpu":
            reasons.append(
                "returning LSE (needs_lse) not supported on cpu (Inductor's CPU FlexAttention "
                "has no LSE output)"
            )
        return "; ".join(reasons) or None

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


class _Workspace:
    """Zero-initialised buffers reused by every layer of a builder's steps, grown on demand.

    Rows past what a step writes keep earlier (finite) values or zeros: the kernel computes
    masked keys of a partly used tile, and a NaN there would leak through `0 * NaN`.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        numel = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.zeros(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


@dataclass
class FlexAttentionMetadata:
    """What `FlexAttentionImpl.forward` needs for one step.

    Attributes:
        num_actual_tokens: real tokens; output rows past it are untouched.
        block_size: tokens per block of the block table.
        slot_mapping: int64 `[num_tokens]` (device).
        causal: the step's causal flag (decoder layers only).
        layout: where keys and queries sit in workspace coordinates (CPU, see
            `flex_attention_plan.lay_out_step`).
        kv_rows_padded: the bucketed key length of the workspace for every request's keys
            (a step whose decodes read the cache in place copies fewer:
            `flex_attention_plan.skipping_keys`).
        block_table: int32 `[>= num_reqs, max_blocks]` (device), the step's block table.
        key_lens: int32 `[num_reqs]` (device): keys per request (`seq_lens`, or the encoder
            lengths for cross attention); a view, made without any device work.
        max_key_len: the longest request's keys (host).
        max_blocks_per_req: blocks of a request of `max_model_len` tokens (the paged decode's
            block lists are at least this wide).
        workspace: the builder's buffers.
        step_cache: plans made by the first layer that needs them, reused by the others.
        common_attn_metadata: the step it was built from (its mirrors for the checks).
    """

    num_actual_tokens: int
    block_size: int
    slot_mapping: torch.Tensor
    causal: bool
    layout: StepLayout
    kv_rows_padded: int
    block_table: torch.Tensor
    key_lens: torch.Tensor
    max_key_len: int
    common_attn_metadata: CommonAttentionMetadata
    max_blocks_per_req: int = 0
    workspace: _Workspace = field(default_factory=_Workspace)
    step_cache: dict = field(default_factory=dict)


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder[FlexAttentionMetadata]):
    """Lays a step out for FlexAttention from the CPU mirrors; never syncs with the device.

    `build` launches nothing on the device either: its host work is a few numpy calls over the
    requests (on the per-step path of every engine step), and the device tensors it passes on
    (block table, key lengths) are the common metadata's own. It asks for decodes first
    (`reorder_batch_threshold` 1): they take the decode layout, one batch entry each.
    """

    _cudagraph_support = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layers, limits, device) -> None:
        super().__init__(kv_cache_spec, layers, limits, device)
        FlexAttentionBackend.check_kv_cache_spec(kv_cache_spec, "FlexAttentionMetadataBuilder")
        if limits.max_num_reqs > MAX_NUM_REQS:
            raise ValueError(
                "FlexAttentionMetadataBuilder: too many requests per step for the key gather "
                f"(got max_num_reqs={limits.max_num_reqs}, expected <= {MAX_NUM_REQS}). "
                "Lower BatchLimits.max_num_reqs."
            )
        self._workspace = _Workspace()
        # Decodes first: they take the decode layout (see the module docstring).
        self._init_reorder_batch_threshold(1)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata
    ) -> FlexAttentionMetadata:
        api = "FlexAttentionMetadataBuilder.build"
        cm = common_attn_metadata
        host = cm.host_batch
        if common_prefix_len:
            raise ValueError(
                f"{api}: cascade attention not supported (got common_prefix_len="
                f"{common_prefix_len}, expected 0). FLEX_ATTENTION declares no cascade."
            )
        block_size = self.kv_cache_spec.block_size
        num_reqs = cm.num_reqs
        key_lens, key_lens_cpu = cm.seq_lens, cm.seq_lens_cpu
        if cm.encoder_seq_lens_cpu is not None:  # cross attention
            key_lens, key_lens_cpu = cm.encoder_seq_lens, cm.encoder_seq_lens_cpu
            if key_lens is None:
                raise ValueError(
                    f"{api}: cross attention needs encoder_seq_lens on the device (got only "
                    "encoder_seq_lens_cpu). Set both, as make_common_attn_metadata does."
                )
        # Host work only, in numpy (slicing arrays is cheaper than slicing tensors); the keys
        # themselves are copied by each layer's forward, straight from the block table.
        key_lens_np = (
            host.seq_lens if key_lens is cm.seq_lens else np.array(key_lens_cpu.numpy()[:num_reqs])
        )
        # (argmax, one C call, rather than `max`, which goes through a Python wrapper)
        max_key_len = int(key_lens_np[key_lens_np.argmax()]) if num_reqs else 0
        width = cm.block_table_tensor.shape[1]
        if max_key_len > width * block_size:
            raise ValueError(
                f"{api}: block_table too narrow for the longest sequence (got {width} columns, "
                f"expected >= {-(-max_key_len // block_size)} for block_size {block_size})."
            )
        # (the validated arrays are the build's own: laid out without copies)
        layout = lay_out_owned(
            host.query_start_loc, key_lens_np, host.context_lens, host.query_lens
        )
        return FlexAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            block_size=block_size,
            slot_mapping=cm.slot_mapping,
            causal=cm.causal,
            layout=layout,
            kv_rows_padded=pad_keys(layout.num_key_rows),
            block_table=cm.block_table_tensor,
            # slicing a tensor costs a microsecond or two; the engine's is already this long
            key_lens=key_lens if key_lens.shape[0] == num_reqs else key_lens[:num_reqs],
            max_key_len=max_key_len,
            common_attn_metadata=cm,
            max_blocks_per_req=-(-self.limits.max_model_len // block_size),
            workspace=self._workspace,
        )


# The compiled templates take K and V (and the rows' queries) on CUDA as tiles,
# `[1, heads, tiles, TILE, D]`, and flatten them: the row count `tiles * TILE` is then a known
# multiple of the kernel's blocks under dynamic shapes, and Inductor drops the bounds checks
# it needs for an arbitrary length (1.14-1.42x faster on an H200, and 1.8-1.9x with K and V
# at storage offset 0; benchmarks/RESULTS.md).


def _attend(query, key, value, block_mask, score_mod, scale, kernel_options=None):
    from torch.nn.attention.flex_attention import flex_attention

    query, key, value = (x.flatten(2, 3) if x.dim() == 5 else x for x in (query, key, value))
    # (GQA: the rows' query heads share a KV head; the decode layouts have as many of each)
    return flex_attention(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
        enable_gqa=True, kernel_options=kernel_options,
    )  # fmt: skip


def _attend_with_lse(query, key, value, block_mask, score_mod, scale, kernel_options=None):
    from torch.nn.attention import flex_attention as flex

    query, key, value = (x.flatten(2, 3) if x.dim() == 5 else x for x in (query, key, value))
    if hasattr(flex, "AuxRequest"):
        out, aux = flex.flex_attention(
            query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
            enable_gqa=True, kernel_options=kernel_options, return_aux=flex.AuxRequest(lse=True),
        )  # fmt: skip
        return out, aux.lse
    return flex.flex_attention(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
        enable_gqa=True, kernel_options=kernel_options, return_lse=True,
    )  # fmt: skip


# Compiled callables only, one per static configuration (see the module docstring).
_COMPILED: dict[tuple, Callable] = {}


def _compiled_attend(config: tuple, with_lse: bool, dynamic: bool = True) -> Callable:
    """The compiled attention call of `config`; `dynamic=False` compiles for the exact shapes
    of its first call (`config` must then name them all: one graph per code object)."""
    fn = _COMPILED.get((config, with_lse))
    if fn is None:
        template = _attend_with_lse if with_lse else _attend
        # A code object of its own: torch.compile's graph limit (8) counts per code object.
        name = f"{template.__name__}_{len(_COMPILED)}"
        code = template.__code__.replace(co_name=name, co_qualname=name)
        copy = types.FunctionType(code, template.__globals__, name, template.__defaults__)
        fn = _COMPILED[(config, with_lse)] = torch.compile(copy, dynamic=dynamic, fullgraph=True)
    return fn


def _copied_keys(md: FlexAttentionMetadata, skip: int) -> tuple[int, int, int]:
    """`(key_offset, kv_rows_padded, max_key_len)` of the keys a layer copies when the first
    `skip` requests' are not copied (`flex_attention_plan.skipping_keys`; the longest copied
    request sizes the gather's grid, not a skipped decode). Made once per step, for every
    layer that reads its decodes in place."""
    if not skip:
        return 0, md.kv_rows_padded, md.max_key_len
    key = ("copied keys", skip)
    copied = md.step_cache.get(key)
    if copied is None:
        key_offset, kv_rows_padded = skipping_keys(md.layout, skip)
        longest = int(md.layout.key_lens[skip:].max(initial=0))
        copied = md.step_cache[key] = (key_offset, kv_rows_padded, longest)
    return copied


@functools.cache
def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of `device`, None off CUDA (looked up once per device)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _static_dims(tensor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Marks `dims` static for torch.compile (compiled with dynamic=True, every size would
    otherwise be a symbol, and heads and head sizes never vary)."""
    for dim in dims:
        torch._dynamo.mark_static(tensor, dim)
    return tensor


def _as_kernel_rows(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`[1, heads, rows, D]` (any strides) as the compiled templates take it: on CUDA as
    tiles `[1, heads, rows / TILE, TILE, D]` (a view) with only the tile count symbolic; on
    the CPU untiled (its template fails to compile the tiled form, torch 2.13), only the row
    count symbolic (a symbolic head count would share a symbol with an equal decode batch)."""
    if device.type != "cuda":
        return _static_dims(rows, (0, 1, 3))
    _, heads, num_rows, size = rows.shape
    return _static_dims(rows.view(1, heads, num_rows // TILE, TILE, size), (0, 1, 3, 4))


def _covers_whole_rows(query: torch.Tensor, first_token: int, num_rows: int) -> bool:
    """Whether the rows kernel or a decode kernel can read `query [tokens, H, D]` itself: its
    rows start at token 0 and the caller's tensor has at least `num_rows` (the padded row
    count or decode batch; an engine's padded batch, a step of exactly a bucket's tokens, or
    the tokens after the decodes) in the layout of the workspace's copy: contiguous at storage
    offset 0. The rows past the step's tokens (or decodes) are the caller's (padding, any
    values): their outputs are never copied out, and a row's scores depend on its own query
    only.

    Anything else is copied: a graph compiled for these strides would guard on others and
    compile again, and a symbolic storage offset hides the alignment Inductor needs (the
    kernel took 1.3-1.6x as long with one on an H200, benchmarks/RESULTS.md). (torch.compile
    also guards on a tensor being an inference tensor: a caller alternating steps inside and
    outside `torch.inference_mode` would compile once for each, the paged decode once per
    batch bucket too; the engine runs every step inside it.)"""
    return (
        first_token == 0
        and query.shape[0] >= num_rows
        and query.storage_offset() == 0
        and query.is_contiguous()
    )


def _padded_queries(
    query: torch.Tensor,
    md: FlexAttentionMetadata,
    name: str,
    first: int,
    end: int,
    num_rows: int,
) -> torch.Tensor:
    """Tokens `first ... end - 1` of `query [tokens, H, D]` in `num_rows` rows `[num_rows, H,
    D]` for a kernel: the caller's own rows where they cover them (`_covers_whole_rows`:
    nothing to copy; a copy is a kernel launch, 2-3 us for a decode batch), else workspace
    buffer `name`, the tokens copied token-major in one contiguous copy (rows past them keep
    earlier values)."""
    if _covers_whole_rows(query, first, num_rows):
        return query[:num_rows]
    q = md.workspace.get(name, (num_rows, *query.shape[1:]), query.dtype, query.device)
    q[: end - first].copy_(query[first:end])
    return q


def _soft_cap(mods: dict[str, torch.Tensor]) -> Callable | None:
    """The soft cap alone as a score mod (FlexAttention applies the scale before it)."""
    cap = mods.get("soft_cap")
    if cap is None:
        return None

    def soft_cap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return soft_cap


class FlexAttentionImpl(AttentionImpl[FlexAttentionMetadata]):
    """The FLEX_ATTENTION forward; see the module docstring."""

    # On CUDA; the CPU returns no LSE (FlexAttentionBackend.supports_combination says so).
    can_return_lse_for_decode = True
    lse_base_on_e = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        alibi_slopes, sinks = self.alibi_slopes, self.sinks
        self.group = self.num_heads // self.num_kv_heads
        shape = (self.num_kv_heads, self.group)
        # Per-layer values travel as tensors, so layers differing only in them share a graph.
        # The scale too: flex_attention's own `scale` argument is baked into the graph.
        self._mods: dict[str, torch.Tensor] = {"scale": torch.tensor(self.scale)}
        if self.logits_soft_cap:
            self._mods["soft_cap"] = torch.tensor(self.logits_soft_cap, dtype=torch.float32)
        # (per-head sizes static: an unmarked one equal to a symbolic size shares its symbol)
        if alibi_slopes is not None:
            self._mods["alibi_slopes"] = _static_dims(alibi_slopes.view(shape).clone(), (0, 1))
        if sinks is not None:
            self._mods["sinks"] = _static_dims(sinks.detach().float().view(shape).clone(), (0, 1))
        # Decodes may read the cache in place (flex_attention_paged) when no score needs a
        # key's position, no sink needs a key of its own and the cache holds the model dtype.
        self._may_read_in_place = (
            self.attn_type == AttentionType.DECODER
            and alibi_slopes is None
            and sinks is None
            and not is_fp8_cache(self.kv_cache_dtype)
        )
        self._paged: tuple[torch.Tensor, PagedKV | None] | None = None
        self._rows_mods_cache: dict[str, torch.Tensor] | None = None  # see `_rows_mods`
        self._rows_kernels: dict[tuple, Callable] = {}  # see `_rows_kernel`

    def _mods_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The score-mod tensors on `device` (moved once, then kept), per-head ones `[KVH,
        G]` with their sizes marked static."""
        for name, tensor in self._mods.items():
            if tensor.device != device:
                self._mods[name] = _static_dims(tensor.to(device), tuple(range(tensor.dim())))
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
        n = md.num_actual_tokens
        if n == 0:
            return output
        device = query.device
        mods = self._mods_on(device)
        paged = self._in_place(kv_cache, md, query.dtype)
        decode_plan, plan = self._plans(md, "sinks" in mods, device, paged)
        heads = (self.num_heads, self.num_kv_heads)
        config = (device.type, query.dtype, self.head_size, *heads, *sorted(mods))
        in_place = isinstance(decode_plan, PagedDecodePlan)
        if in_place:
            self._attend_paged_decodes(query, paged, md, decode_plan, mods, config, output,
                                       output_lse)  # fmt: skip
            if plan is None:
                return output  # a decode step: no key is copied
        # K, V: [1, KVH, kv_rows, D] (tiled on CUDA), contiguous at storage offset 0 each
        # (strides tied to sizes, as torch.compile likes; an offset would be one more symbol).
        # Decodes read in place need none of their keys copied.
        skip = decode_plan.num_decodes if in_place else 0
        k, v = (
            _as_kernel_rows(x.unsqueeze(0), device)
            for x in self._load_kv(layer, key, value, kv_cache, md, query.dtype, skip)
        )
        if decode_plan is not None and skip == 0:
            self._attend_decodes(query, k, v, md, decode_plan, mods, config, output, output_lse)
        if plan is not None:
            self._attend_rows(query, k, v, md, plan, mods, config, output, output_lse)
        return output

    def _in_place(
        self, kv_cache: torch.Tensor, md: FlexAttentionMetadata, dtype: torch.dtype
    ) -> PagedKV | None:
        """The cache's in-place views when this step's decodes can read it there (CUDA, a
        layer without positional mods, the model dtype; see flex_attention_paged), else None.
        Made once per cache."""
        if not (
            self._may_read_in_place
            and md.layout.num_decodes
            and kv_cache.device.type == "cuda"
            and kv_cache.dtype == dtype
        ):
            return None
        if self._paged is None or self._paged[0] is not kv_cache:
            self._paged = (kv_cache, paged_kv_views(kv_cache))
        return self._paged[1]

    def _attend_paged_decodes(
        self, query, paged: PagedKV, md, plan: PagedDecodePlan, mods, config, output, output_lse
    ) -> None:
        """Tokens `0 ... num_decodes - 1`, one batch entry each, over the cache in place."""
        q = self._decode_queries(query, md, plan.num_decodes, plan.batch)
        result = self._paged_kernel(q, paged, md, plan, mods, config, output_lse is not None)()
        self._write_decodes(result, plan.num_decodes, output, output_lse)

    def _decode_queries(self, query, md, n: int, batch: int) -> torch.Tensor:
        """The first `n` tokens' queries as the decode kernels take them, `[batch, KVH, G, D]`
        (both decode paths; `_padded_queries`). Entries past `n` are padding: their outputs
        are never copied out."""
        # query [n, H, D] is [n, KVH, G, D] already: batch entry, KV head, its query heads.
        q = _padded_queries(query, md, "decode_query", 0, n, batch)
        # Detached, without a base: torch.compile guards on a view's base (the caller's query,
        # whose token count changes from step to step, or the workspace's)
        return q.view(batch, self.num_kv_heads, self.group, self.head_size).detach()

    def _write_decodes(self, result, n: int, output, output_lse) -> None:
        """Writes a decode batch's result (`out [batch, KVH, G, D]`, with `lse [batch, KVH,
        G]` when `output_lse` is given) into the first `n` rows of `output` / `output_lse`."""
        out, lse = result if output_lse is not None else (result, None)
        output[:n].view(n, *out.shape[1:]).copy_(out[:n])
        if lse is not None:
            # lse: [batch, KVH, G] -> [H, n]
            output_lse[:, :n].copy_(lse[:n].reshape(n, -1).t())

    def _paged_kernel(
        self, q, paged: PagedKV, md, plan: PagedDecodePlan, mods, config, with_lse: bool
    ) -> Callable[[], object]:
        """The paged decode's compiled call on queries `q [batch, KVH, G, D]`, bound to its
        inputs. Compiled for this batch bucket, list width and cache geometry alone (the
        decoding kernel needs a static batch); the scale is baked in, as FlexAttention's
        own."""
        # (Inductor copies an input that breaks the alignment it compiled for: K and V, the
        # whole cache, must not be; their storage offsets it neither bakes in nor guards)
        aligned = tuple(x.data_ptr() % 16 == 0 for x in (paged.key, paged.value))
        # (everything the graph depends on: with a window the mask_mod is another function)
        mask = (md.block_size, self.group, self.sliding_window is not None)
        shapes = (plan.batch, plan.block_mask.kv_indices.shape[-1], paged.key.shape)
        options = paged_decode_options(md.block_size, self.head_size, q.element_size())
        static = (*config, "paged", *mask, *shapes, paged.key.stride(), aligned, self.scale,
                  str(options))  # fmt: skip
        attend = _compiled_attend(static, with_lse=with_lse, dynamic=False)
        soft_cap = _soft_cap(mods)
        return lambda: attend(
            q, paged.key, paged.value, plan.block_mask, soft_cap, self.scale, options
        )

    def _attend_decodes(
        self, query, k, v, md, plan: DecodePlan, mods, config, output, output_lse
    ) -> None:
        """The decode layout: tokens `0 ... num_decodes - 1`, one batch entry each."""
        q = _static_dims(self._decode_queries(query, md, plan.num_decodes, plan.batch), (1, 2, 3))
        attend = _compiled_attend((*config, "decode"), with_lse=output_lse is not None)
        result = attend(q, k, v, plan.block_mask, score_mod(mods, plan), 1.0)
        self._write_decodes(result, plan.num_decodes, output, output_lse)

    def _attend_rows(
        self, query, k, v, md, plan: RowsPlan, mods, config, output, output_lse
    ) -> None:
        """The rows: tokens `plan.first_token ...`, one batch entry, every query head."""
        t0, n = plan.first_token, md.num_actual_tokens
        attend = self._rows_kernel(config, output_lse is not None, query)
        q = self._rows_queries(query, md, plan)
        result = attend(q, k, v, plan.block_mask, score_mod(self._rows_mods(mods), plan), 1.0)
        out, lse = result if output_lse is not None else (result, None)
        # out: [1, H, rows, D], in the query's token-major memory order (FlexAttention gives
        # the output the query's strides): the copy into output [m, H, D] is contiguous
        output[t0:n].copy_(out[0, :, : n - t0].transpose(0, 1))
        if lse is not None:
            output_lse[:, t0:n].copy_(lse[0, :, : n - t0])  # lse: [1, H, rows]

    def _rows_kernel(self, config: tuple, with_lse: bool, query: torch.Tensor) -> Callable:
        """The rows' compiled call, `attend(q, k, v, block_mask, score_mod, scale)`, with its
        launch settings for the query's GPU bound (`rows_kernel_options`). Made once per
        configuration and device, then kept: every layer's forward asks for it."""
        key = (config, with_lse, query.device)
        bound = self._rows_kernels.get(key)
        if bound is None:
            capability = _capability(query.device)
            options = rows_kernel_options(capability, self.head_size, query.itemsize)
            attend = _compiled_attend((*config, "rows", str(options)), with_lse)
            bound = self._rows_kernels[key] = functools.partial(attend, kernel_options=options)
        return bound

    def _rows_queries(self, query, md, plan: RowsPlan) -> torch.Tensor:
        """Tokens `plan.first_token ...` of `query [n, H, D]` as the rows kernel takes them:
        `[1, H, rows, D]` (tiled on CUDA): a token-major view of the caller's query where it
        covers the padded row count (`_covers_whole_rows`), else of a workspace buffer of that
        many rows (rows past the tokens keep earlier values)."""
        # (a copy where the caller's query ends where its tokens do, or starts at the
        # decodes' offset: the kernel wants whole tiles of rows)
        t0, n = plan.first_token, md.num_actual_tokens
        q = _padded_queries(query, md, "query", t0, n, plan.num_rows)
        # Detached, a tensor without a base, its heads and head size static: torch.compile
        # guards on a view's base, and the caller's query and the workspace buffer have bases
        # of other shapes (a static head count is never tied to a symbolic tile count).
        rows = _static_dims(q.detach(), (1, 2))
        return _as_kernel_rows(rows.unsqueeze(0).transpose(1, 2), query.device)

    def _rows_mods(self, mods: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`mods` as the rows' score mod reads them: the kernel's head is the query head
        (GQA in FlexAttention), so per-head values are `[H, 1]` (`RowsPlan.head` is 0).

        Made once per device, with their sizes marked static: under dynamic shapes an
        unmarked size equal to a step's row tile count would share its symbol, and the next
        step of another size would compile again (a fresh view each call cannot be marked:
        torch.compile then ties the view's base)."""
        if "alibi_slopes" not in mods and "sinks" not in mods:
            return mods
        cached = self._rows_mods_cache
        # (made from `mods` as they are: a move to another device replaces every tensor)
        if cached is None or cached["scale"] is not mods["scale"]:
            per_head = ("alibi_slopes", "sinks")
            cached = self._rows_mods_cache = {
                k: _static_dims(v.reshape(-1, 1).clone(), (0, 1)) if k in per_head else v
                for k, v in mods.items()
            }
        return cached

    def _plans(
        self,
        md: FlexAttentionMetadata,
        has_sink: bool,
        device: torch.device,
        paged: PagedKV | None = None,
    ) -> tuple[DecodePlan | PagedDecodePlan | None, RowsPlan | None]:
        """The step's plans for this layer's settings, made by the first layer that needs
        them: the decode layout's for the leading single-token requests (over the cache in
        place with `paged`), the rows' for the other tokens (None where there are
        none)."""
        causal = md.causal and self.attn_type == AttentionType.DECODER
        views = (paged.blocks_per_cache_block, paged.key.shape[2]) if paged is not None else None
        key = ("plan", causal, self.sliding_window, self.group, has_sink, device, views)
        plans = md.step_cache.get(key)
        if plans is None:
            window = self.sliding_window
            num_decodes = md.layout.num_decodes
            if not num_decodes:
                decodes = None
            elif paged is not None:
                decodes = make_paged_decode_plan(md, paged, self.group, window, device)
            else:
                decodes = make_decode_plan(md, causal, window, self.group, has_sink, device)
            plans = md.step_cache[key] = (
                decodes,
                # one row per token: FlexAttention's GQA serves a token's query heads; with the
                # decodes read in place, over the other requests' keys alone
                make_rows_plan(
                    md,
                    causal,
                    window,
                    1,
                    has_sink,
                    device,
                    first_token=num_decodes,
                    keys_skipped=paged is not None,
                )
                if num_decodes < md.num_actual_tokens
                else None,
            )
        return plans

    def _load_kv(
        self,
        layer: AttentionLayer,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: FlexAttentionMetadata,
        dtype: torch.dtype,
        skip: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's keys and values in workspace rows, `[KVH, kv_rows_padded, D]` each, of
        the model dtype; row 0 is the sink slot (V zero, K not cleared). Without the first
        `skip` requests' keys (their decodes read the cache in place): the others' keys start
        at `FIRST_KEY_ROW` all the same (`skipping_keys`), so that the workspace holds only
        them, not rows for every decode's keys."""
        encoder = self.attn_type in _ENCODER_TYPES
        device = key.device if encoder else kv_cache.device
        # K and V in buffers of their own, each at storage offset 0: a symbolic offset (V's,
        # in one shared buffer) left Inductor unable to prove alignment, and the kernel
        # took 1.3-1.6x as long on an H200 (benchmarks/RESULTS.md).
        key_offset, kv_rows_padded, max_key_len = _copied_keys(md, skip)
        shape = (self.num_kv_heads, kv_rows_padded, self.head_size)
        k_rows = md.workspace.get("k", shape, dtype, device)
        v_rows = md.workspace.get("v", shape, dtype, device)
        v_rows[:, 0].zero_()  # the sink's value must be zero (its key's score is replaced)
        rows = md.layout.num_key_rows
        if encoder:
            # Encoder attention reads the step's own K/V; its rows follow the token order.
            k_rows[:, FIRST_KEY_ROW:rows] = key[: rows - FIRST_KEY_ROW].transpose(0, 1)
            v_rows[:, FIRST_KEY_ROW:rows] = value[: rows - FIRST_KEY_ROW].transpose(0, 1)
            return k_rows, v_rows
        scales = (None, None)
        if is_fp8_cache(self.kv_cache_dtype):
            scales = tuple(
                layer_kv_scale(_API, layer, name, self.num_kv_heads, device)
                for name in ("k_scale", "v_scale")
            )
        # (requests' keys lie back to back from FIRST_KEY_ROW, those skipped left out)
        gather_kv_rows(
            kv_cache,
            md.block_table[skip:] if skip else md.block_table,
            md.key_lens[skip:] if skip else md.key_lens,
            k_rows,
            v_rows,
            num_keys=rows - key_offset - FIRST_KEY_ROW,
            max_key_len=max_key_len,
            first_row=FIRST_KEY_ROW,
            k_scale=scales[0],
            v_scale=scales[1],
        )
        return k_rows, v_rows

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
        check_forward_inputs(
            _API,
            self,
            FlexAttentionBackend.supported_dtypes,
            query,
            key,
            value,
            kv_cache,
            md,
            FlexAttentionMetadata,
            output=output,
            output_lse=output_lse,
            reads_cache=self.attn_type not in _ENCODER_TYPES,
        )
        if output_lse is not None and query.device.type != "cuda":
            raise NotImplementedError(
                f"{_API}: output_lse not supported on {query.device.type} (Inductor's CPU "
                "FlexAttention returns no LSE). Use the TORCH backend when LSEs are needed "
                "on the CPU."
            )


FlexAttentionImpl.backend = FlexAttentionBackend
