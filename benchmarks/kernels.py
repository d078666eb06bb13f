"""GPU attention kernels: every anyattn backend against FlashInfer, FlashAttention-4 and torch
SDPA, in one run, on the same inputs.

Inputs: bf16, 32 query / 8 KV heads, head_size 128, block 16. K/V live in one paged cache of
random values (never zeros) whose blocks are shuffled over a pool half again larger than needed,
block 0 being the null block; every contender reads that same data (a backend preferring
another layout or kernel block size gets a copy in it).
- decode 64 x 4096, 256 x 2048, 8 x 32768 (requests x keys, one new token each): TB/s of the
  K+V bytes attended.
- prefill, causal, fresh 16 x 1024, 4 x 4096, 1 x 16384: TFLOP/s counting 2*B*H*L*L*D.
- mixed: 48 decodes of 4096 keys and 2 chunked prefills of 512 new tokens after 1536 tokens of
  context, in arrival order (the prefills among the decodes): time, KV TB/s, TFLOP/s.

Contenders:
- the anyattn backends TRITON, FLASHINFER, FLASH_ATTN, FLEX_ATTENTION, TORCH, driven as an
  engine drives them: class from the registry, `validate_configuration` (a backend that is not
  registered, not available or rejects the config is reported, not run), cache from
  `allocate_kv_cache`, builder with its reorder request applied, `build` once, impl from the
  contract's constructor arguments, the step's K/V written with `do_kv_cache_update`; only
  `impl.forward` is timed. TRITON's label names its KV splits.
- FlashInfer directly (decode wrapper with tensor cores, ragged prefill wrapper for fresh
  prefills, decode + paged prefill wrappers for the mixed batch), FlashAttention-4 directly
  (`flash_attn.cute.flash_attn_varlen_func`: page table for decode and mixed, contiguous varlen
  for prefill, and "FA4 paged" through the page table for prefill too) and torch SDPA with the
  cuDNN and flash backends over contiguous K/V, as a bound; torch FlexAttention directly over
  the requests' keys laid out once (untimed): a batch entry per decode (its decoding kernel)
  and the other requests' keys packed with a document-causal block mask, both calls for the
  mixed batch.
Every contender is first checked against a float64 reference on a slice of rows (first, middle
and last requests; the first and last 32 rows of long queries); a wrong result is timed but
marked. Then the median of per-call CUDA-event times of device work (host overhead excluded),
input sets cycling (see `_timing`).
Wrapper cost: FLASHINFER, FLASH_ATTN and FLEX_ATTENTION forward vs their library called
directly, timed in alternating rounds (target: at most 3% over the direct call); and the host
time of `build` for 256 decodes (checked for host syncs under
`torch.cuda.set_sync_debug_mode("error")`), every case timed in rounds that take each in turn,
so that a slow phase of the host is shared by all; the table gives the median and p90 of all
calls and the quietest round's median.

Run on a GPU machine with FlashInfer and FA4 importable (as `benchmarks/gpu_sweep.sh` stages them):
`PYTHONPATH=src:<staged> python3 benchmarks/kernels.py [--quick] [--only decode,prefill,mixed,
wrapper,build] [--backends TRITON,...] [--peers fi,fa4,fa4-paged,sdpa-cudnn,sdpa-flash,flex]`.
Markdown tables go to stdout (for benchmarks/RESULTS.md), progress to stderr. One file by
design: everything one run needs, in the order it runs.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib
import importlib.metadata
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from _timing import cpu_times_us, interleaved_us, markdown_table, median_us, synchronize

from anyattn import registry
from anyattn.backend import AttentionBackend
from anyattn.backends.flashinfer_xqa import xqa_decode_reason
from anyattn.config import AttentionSelectorConfig, AttentionSpec, BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import (
    apply_swaps,
    compute_slot_mapping,
    expand_block_table,
    make_common_attn_metadata,
    reorder_batch_to_split_decodes_and_prefills,
)
from anyattn.testing import assign_blocks
from anyattn.types import AttentionCGSupport, AttentionType, DeviceInfo

SECTIONS = ("decode", "prefill", "mixed", "wrapper", "build")
BACKENDS = ("TRITON", "FLASHINFER", "FLASH_ATTN", "FLEX_ATTENTION", "TORCH")
PEERS = ("fi", "fa4", "fa4-paged", "sdpa-cudnn", "sdpa-flash", "flex")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
WORKSPACE_BYTES = 128 * 1024 * 1024


# --- what is measured ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """The layer every case runs: heads, head size, block size, dtype."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def scale(self) -> float:
        return self.head_size**-0.5

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class CaseSpec:
    """One step's batch, requests in arrival order.

    Attributes:
        section: "decode", "prefill" or "mixed".
        label: how tables name it ("64 x 4096").
        query_lens, seq_lens: new tokens and keys (context + new tokens) per request.
    """

    section: str
    label: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_kv_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def is_uniform(self) -> bool:
        """Every request has the same query and key lengths (one dense SDPA call fits)."""
        return len(set(self.query_lens)) == 1 and len(set(self.seq_lens)) == 1


def decode_case(num_reqs: int, seq_len: int) -> CaseSpec:
    return CaseSpec("decode", f"{num_reqs} x {seq_len}", (1,) * num_reqs, (seq_len,) * num_reqs)


def prefill_case(num_reqs: int, length: int) -> CaseSpec:
    return CaseSpec("prefill", f"{num_reqs} x {length}", (length,) * num_reqs, (length,) * num_reqs)


def mixed_case(
    num_decodes: int = 48,
    decode_seq_len: int = 4096,
    num_prefills: int = 2,
    new_tokens: int = 512,
    context: int = 1536,
) -> CaseSpec:
    """Decodes with chunked prefills spread among them, as requests arrive."""
    query_lens = [1] * num_decodes
    seq_lens = [decode_seq_len] * num_decodes
    total = num_decodes + num_prefills
    for i in range(num_prefills):
        at = (i + 1) * total // (num_prefills + 1)
        query_lens.insert(at, new_tokens)
        seq_lens.insert(at, context + new_tokens)
    label = (
        f"{num_decodes} x {decode_seq_len} decode + {num_prefills} x {new_tokens} new "
        f"after {context}"
    )
    return CaseSpec("mixed", label, tuple(query_lens), tuple(seq_lens))


CASES: dict[str, tuple[CaseSpec, ...]] = {
    "decode": (decode_case(64, 4096), decode_case(256, 2048), decode_case(8, 32768)),
    "prefill": (prefill_case(16, 1024), prefill_case(4, 4096), prefill_case(1, 16384)),
    "mixed": (mixed_case(),),
}
# The cases the wrapper comparison runs when no table section is asked for.
WRAPPER_CASES = (CASES["decode"][0], CASES["prefill"][1], CASES["mixed"][0])
# Which direct call each wrapper is compared with, per section.
WRAPPER_PAIRS = {
    "FLASHINFER": {"decode": "FlashInfer", "prefill": "FlashInfer", "mixed": "FlashInfer"},
    "FLASH_ATTN": {"decode": "FA4", "prefill": "FA4 paged", "mixed": "FA4"},
    "FLEX_ATTENTION": dict.fromkeys(("decode", "prefill", "mixed"), "FlexAttention"),
}


def kv_bytes(spec: CaseSpec, shape: Shape) -> int:
    """Bytes of K and V the step attends: every key of every request, read once."""
    return spec.num_kv_tokens * 2 * shape.num_kv_heads * shape.head_size * shape.itemsize


def causal_prefill_flops(num_reqs: int, length: int, shape: Shape) -> int:
    """The usual count for causal prefill: 2*B*H*L*L*D (half of 4*B*H*L*L*D)."""
    return 2 * num_reqs * shape.num_heads * length * length * shape.head_size


def attended_flops(spec: CaseSpec, shape: Shape) -> int:
    """4*H*D per (query, key) pair the causal mask keeps: a query at position p sees p + 1
    keys, so a request with c context and n new tokens has n*c + n*(n+1)/2 pairs."""
    pairs = sum(
        n * (s - n) + n * (n + 1) // 2 for n, s in zip(spec.query_lens, spec.seq_lens, strict=True)
    )
    return 4 * shape.num_heads * shape.head_size * pairs


def case_flops(spec: CaseSpec, shape: Shape) -> int:
    """Prefill cases use the causal-prefill convention (comparable with published figures);
    other cases count the pairs actually attended."""
    if spec.section == "prefill" and spec.is_uniform:
        return causal_prefill_flops(spec.num_reqs, spec.seq_lens[0], shape)
    return attended_flops(spec, shape)


# --- one case's data -------------------------------------------------------------------------


@dataclass
class CaseData:
    """One case on the device, shared by every contender.

    Attributes:
        block_table: int32 `[num_reqs, max_blocks]` (CPU), arrival order, 0 = null block.
        num_blocks: blocks in the pool.
        cache: `[num_blocks, 2, block_size, num_kv_heads, head_size]` (NHD), random.
        queries: input sets cycled by the timing, `[num_tokens, num_heads, head_size]` each.
        key, value: the step's new K/V `[num_tokens, num_kv_heads, head_size]`, equal to what
            the cache holds at their slots.
        query_start_loc: int32 `[num_reqs + 1]` (CPU).
    """

    spec: CaseSpec
    shape: Shape
    device: torch.device
    block_table: torch.Tensor
    num_blocks: int
    cache: torch.Tensor
    queries: list[torch.Tensor]
    key: torch.Tensor
    value: torch.Tensor
    query_start_loc: torch.Tensor
    dense: dict[str, torch.Tensor] = field(default_factory=dict)


def make_case_data(
    spec: CaseSpec, shape: Shape, device: torch.device | str, num_slots: int = 2, seed: int = 0
) -> CaseData:
    """Random inputs for `spec`: a shuffled paged cache and `num_slots` query sets."""
    device = torch.device(device)
    block_table, num_blocks = assign_blocks(
        spec.seq_lens, shape.block_size, generator=torch.Generator().manual_seed(seed)
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    bs, kvh, hs = shape.block_size, shape.num_kv_heads, shape.head_size
    cache = torch.randn(
        (num_blocks, 2, bs, kvh, hs), generator=gen, device=device, dtype=shape.dtype
    )
    queries = [
        torch.randn(
            (spec.num_tokens, shape.num_heads, hs), generator=gen, device=device, dtype=shape.dtype
        )
        for _ in range(num_slots)
    ]
    query_lens = torch.tensor(spec.query_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(spec.num_reqs + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    seq_lens = torch.tensor(spec.seq_lens, dtype=torch.int32)
    slots = compute_slot_mapping(block_table, query_start_loc, seq_lens, bs).to(device)
    key = cache[slots // bs, 0, slots % bs]
    value = cache[slots // bs, 1, slots % bs]
    return CaseData(
        spec, shape, device, block_table, num_blocks, cache, queries, key, value, query_start_loc
    )


def dense_kv(data: CaseData) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of a uniform batch laid out contiguously, `[num_reqs, seq_len, num_kv_heads,
    head_size]` each (made once per case)."""
    if "k" not in data.dense:
        seq_len, bs = data.spec.seq_lens[0], data.shape.block_size
        positions = torch.arange(seq_len)
        blocks = data.block_table[:, positions // bs].long().to(data.device)
        offsets = (positions % bs).to(data.device).expand_as(blocks)
        data.dense["k"] = data.cache[blocks, 0, offsets]
        data.dense["v"] = data.cache[blocks, 1, offsets]
    return data.dense["k"], data.dense["v"]


# --- correctness -----------------------------------------------------------------------------


def check_rows(spec: CaseSpec) -> list[tuple[int, list[int]]]:
    """Which (request, query offsets) the reference checks: the first, middle and last requests
    and up to four prefills; all rows of short queries, the first and last 32 of long ones."""
    requests = {0, spec.num_reqs // 2, spec.num_reqs - 1}
    requests |= set([r for r, n in enumerate(spec.query_lens) if n > 1][:4])
    chosen = []
    for r in sorted(requests):
        n = spec.query_lens[r]
        offsets = list(range(n)) if n <= 64 else [*range(32), *range(n - 32, n)]
        chosen.append((r, offsets))
    return chosen


@dataclass
class Reference:
    """float64 attention of some query rows of slot 0: `token_index` (canonical rows) and
    `expected` `[len(token_index), num_heads, head_size]`."""

    token_index: torch.Tensor
    expected: torch.Tensor


def reference_rows(data: CaseData, request: int, offsets: Sequence[int]) -> torch.Tensor:
    """float64 causal attention of request `request`'s query rows `offsets` over its keys,
    read back from the paged cache: `[len(offsets), num_heads, head_size]`."""
    shape, spec = data.shape, data.spec
    bs, kvh = shape.block_size, shape.num_kv_heads
    seq_len = spec.seq_lens[request]
    context = seq_len - spec.query_lens[request]
    rows = torch.tensor(offsets, dtype=torch.long, device=data.device)
    start = int(data.query_start_loc[request])
    group = shape.num_heads // kvh
    # q: [n, num_kv_heads, group, head_size]; k, v: [seq_len, num_kv_heads, head_size]
    q = data.queries[0][start + rows].double().view(len(offsets), kvh, group, -1)
    positions = torch.arange(seq_len, device=data.device)
    blocks = data.block_table[request].long().to(data.device)[positions // bs]
    k = data.cache[blocks, 0, positions % bs].double()
    v = data.cache[blocks, 1, positions % bs].double()
    scores = torch.einsum("nkgd,skd->kgns", q, k) * shape.scale
    allowed = positions.view(1, -1) <= (context + rows).view(-1, 1)  # [n, seq_len]
    probs = scores.masked_fill(~allowed, -math.inf).softmax(dim=-1)
    out = torch.einsum("kgns,skd->nkgd", probs, v)
    return out.reshape(len(offsets), shape.num_heads, shape.head_size)


def make_reference(data: CaseData) -> Reference:
    index, expected = [], []
    for request, offsets in check_rows(data.spec):
        start = int(data.query_start_loc[request])
        index += [start + o for o in offsets]
        expected.append(reference_rows(data, request, offsets))
    return Reference(torch.tensor(index, device=data.device), torch.cat(expected))


def compare(rows: torch.Tensor, reference: Reference, dtype: torch.dtype) -> tuple[float, bool]:
    """(max abs error, within tolerance) of canonical-order output rows against the reference.

    Tolerance: docs/semantics.md's starting atol = rtol for the dtype (bf16 1.5e-2)."""
    got = rows[reference.token_index].double()
    error = (got - reference.expected).abs().max().item()
    tol = TOLERANCE[dtype]
    ok = bool(torch.isclose(got, reference.expected, rtol=tol, atol=tol).all())
    return error, ok and not math.isnan(error)


# --- contenders ------------------------------------------------------------------------------


class Skip(Exception):
    """A contender that does not run on a case; the message says why."""


@dataclass
class Prepared:
    """A contender set up for one case.

    Attributes:
        run: `run(slot)` computes the step on query set `slot` and returns its result.
        rows: a result as `[num_tokens, num_heads, head_size]` rows in arrival order.
        path: the kernel path that ran (read after the first call).
    """

    run: Callable[[int], object]
    rows: Callable[[object], torch.Tensor]
    path: Callable[[], str]


@dataclass(frozen=True, slots=True)
class Contender:
    """A named way to run a case: an anyattn backend, a library called directly, a bound."""

    name: str
    prepare: Callable[[CaseData], Prepared]


def request_order(query_lens: Sequence[int], decode_threshold: int | None) -> list[int]:
    """Requests in the order a model runner lays them out for a builder: decodes first (fewest
    swaps) when it sets `reorder_batch_threshold`, else arrival order."""
    order = list(range(len(query_lens)))
    if decode_threshold is not None:
        swaps = reorder_batch_to_split_decodes_and_prefills(query_lens, decode_threshold)
        apply_swaps(order, swaps)
    return order


def gather_index(query_lens: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """Rows of the arrival-order token dim that make up the batch laid out in `order`."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.cat([torch.arange(starts[r], starts[r + 1]) for r in order])


def _reordered(
    data: CaseData, order: list[int]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Queries, key and value laid out in `order`, and the map of output rows back to arrival
    order."""
    if order == sorted(order):
        return data.queries, data.key, data.value, lambda out: out
    index = gather_index(data.spec.query_lens, order).to(data.device)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=data.device)
    queries = [q[index] for q in data.queries]
    return queries, data.key[index], data.value[index], lambda out: out[inverse]


@dataclass
class _Layer:
    """The `layer` argument of forward: name and (unused, non-fp8) KV scales."""

    layer_name: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def selector_config(shape: Shape) -> AttentionSelectorConfig:
    return AttentionSelectorConfig(
        head_size=shape.head_size,
        dtype=shape.dtype,
        block_size=shape.block_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
    )


def resolve_backend(name: str, shape: Shape, device: torch.device) -> type[AttentionBackend]:
    """The backend class an engine would get for `name`, or Skip with the reason it would not."""
    try:
        cls = registry.get_backend_class(name)
    except ValueError:
        raise Skip("not registered") from None
    except (ImportError, TypeError) as e:
        raise Skip(f"cannot import: {e}") from None
    reason = cls.get_unavailable_reason()
    if reason:
        raise Skip(f"not available: {reason}")
    reasons = cls.validate_configuration(selector_config(shape), DeviceInfo.current(device))
    if reasons:
        raise Skip("rejects the config: " + "; ".join(reasons))
    return cls


def backend_cache(cls: type[AttentionBackend], data: CaseData, kernel_block_size: int):
    """The case's cache as `cls` wants it allocated (its preferred layout, kernel block size):
    the shared tensor when that is already so, else a copy."""
    shape = data.shape
    k = shape.block_size // kernel_block_size
    logical = (data.num_blocks * k, 2, kernel_block_size, shape.num_kv_heads, shape.head_size)
    layout = cls.supported_kv_cache_layouts()[0]
    order = cls.get_kv_cache_stride_order(layout)
    if k == 1 and order == tuple(range(5)):
        return data.cache
    kv_cache = allocate_kv_cache(
        cls, logical[0], kernel_block_size, shape.num_kv_heads, shape.head_size, shape.dtype,
        layout=layout, device=data.device,
    )  # fmt: skip
    if tuple(kv_cache.shape) != logical:
        raise ValueError(f"unexpected KV-cache shape {tuple(kv_cache.shape)} (expected {logical})")
    # kernel block b*k + j holds tokens j*kbs ... of engine block b
    src = data.cache.view(data.num_blocks, 2, k, kernel_block_size, *data.cache.shape[3:])
    kv_cache.copy_(src.transpose(1, 2).reshape(logical))
    return kv_cache


def prepare_backend(name: str, data: CaseData, torch_max_kv_tokens: int | None = None) -> Prepared:
    """Set up an anyattn backend for `data` the way an engine does; only forward is left."""
    shape, spec = data.shape, data.spec
    cls = resolve_backend(name, shape, data.device)
    if name == "TORCH" and torch_max_kv_tokens is not None:
        if spec.num_kv_tokens > torch_max_kv_tokens:
            raise Skip("skipped (slow)")
    kbs = cls.get_kernel_block_size(shape.block_size)
    kv_cache = backend_cache(cls, data, kbs)
    limits = BatchLimits(
        max_num_reqs=spec.num_reqs, max_num_tokens=spec.num_tokens, max_model_len=max(spec.seq_lens)
    )
    kv_spec = AttentionSpec(kbs, shape.num_kv_heads, shape.head_size, shape.dtype)
    impl = cls.get_impl_cls()(
        shape.num_heads, shape.head_size, shape.scale, shape.num_kv_heads, None, None, "auto",
        None, AttentionType.DECODER, None, None,
    )  # fmt: skip
    builder = cls.get_builder_cls()(kv_spec, {"bench.0": impl.layer_params()}, limits, data.device)
    order = request_order(spec.query_lens, builder.reorder_batch_threshold)
    block_table = expand_block_table(data.block_table[order], shape.block_size, kbs)
    common = make_common_attn_metadata(
        [spec.query_lens[r] for r in order],
        [spec.seq_lens[r] for r in order],
        block_table,
        kbs,
        data.device,
    )
    metadata = builder.build(0, common)
    queries, key, value, rows = _reordered(data, order)
    one = torch.ones((), dtype=torch.float32, device=data.device)
    layer = _Layer("bench.0", one, one)
    if not cls.forward_includes_kv_cache_update:
        impl.do_kv_cache_update(layer, key, value, kv_cache, common.slot_mapping, metadata)
    outputs = [torch.empty_like(q) for q in queries]

    def run(slot: int) -> torch.Tensor:
        return impl.forward(layer, queries[slot], key, value, kv_cache, metadata, outputs[slot])

    def path() -> str:
        splits = getattr(metadata, "num_splits", 1)
        label = f"{name} split-kv x{splits}" if splits > 1 else name
        return f"{label} (forward writes K/V)" if cls.forward_includes_kv_cache_update else label

    return Prepared(run, rows, path)


def _import(module: str, what: str, device: torch.device):
    if device.type != "cuda":
        raise Skip(f"{what} needs CUDA")
    try:
        return importlib.import_module(module)
    except Exception as e:  # a broken install fails in many ways: report, never crash
        raise Skip(f"{what} not importable ({type(e).__name__}: {e})") from None


def flashinfer_page_indices(
    block_table: torch.Tensor, seq_lens: Sequence[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page layout: `(indptr [n + 1], indices [indptr[-1]],
    last_page_len [n])`, int32 on the CPU."""
    pages = torch.tensor([-(-s // block_size) for s in seq_lens], dtype=torch.int32)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    used = torch.arange(block_table.shape[1]).view(1, -1) < pages.view(-1, 1)
    indices = block_table.to(torch.int32)[used]  # row-major: request by request
    last_page_len = torch.tensor(seq_lens, dtype=torch.int32) - (pages - 1) * block_size
    return indptr, indices, last_page_len


def prepare_flashinfer(data: CaseData) -> Prepared:
    """FlashInfer called directly: ragged prefill for fresh prefills, else for the decodes
    the kernel FLASHINFER's default picks (XQA over the block table with blocks of 64 tokens
    or more on SM90+, `flashinfer_xqa`; the decode wrapper with tensor cores otherwise) and
    the paged prefill wrapper for the rest."""
    fi = _import("flashinfer", "FlashInfer", data.device)
    spec, shape = data.spec, data.shape
    types = {"q_data_type": shape.dtype, "kv_data_type": shape.dtype, "sm_scale": shape.scale}
    heads = (shape.num_heads, shape.num_kv_heads, shape.head_size)

    def workspace() -> torch.Tensor:
        return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=data.device)

    if spec.section == "prefill":
        ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD")
        loc = data.query_start_loc
        ragged.plan(loc, loc, *heads, causal=True, **types)
        outputs = [torch.empty_like(q) for q in data.queries]

        def run_ragged(slot: int) -> torch.Tensor:
            q = data.queries[slot]
            return ragged.run(q, data.key, data.value, out=outputs[slot])

        return Prepared(run_ragged, lambda out: out, lambda: "FlashInfer ragged prefill")

    order = request_order(spec.query_lens, 1)
    queries, _, _, rows = _reordered(data, order)
    query_lens = [spec.query_lens[r] for r in order]
    seq_lens = [spec.seq_lens[r] for r in order]
    block_table = data.block_table[order]
    num_decodes = sum(n == 1 for n in query_lens)
    num_decode_tokens = num_decodes
    decode = prefill = xqa = None
    capability = torch.cuda.get_device_capability(data.device)
    dt = shape.dtype
    if num_decodes and xqa_decode_reason("auto", capability, shape.block_size, shape.head_size,
                                         dt, dt, 0.0) is None:  # fmt: skip
        xqa_table = block_table[:num_decodes].contiguous().to(data.device)
        xqa_lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.int32, device=data.device)
        xqa_workspace = workspace()

        def xqa(q: torch.Tensor, out: torch.Tensor) -> None:
            fi.decode.xqa_batch_decode_with_kv_cache(
                q, data.cache, xqa_workspace, xqa_table, xqa_lens,
                xqa_table.shape[1] * shape.block_size, bmm1_scale=shape.scale, out=out,
            )  # fmt: skip

    elif num_decodes:
        decode = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=True)
        indices = flashinfer_page_indices(
            block_table[:num_decodes], seq_lens[:num_decodes], shape.block_size
        )
        decode.plan(*indices, *heads, shape.block_size, **types)
    if num_decodes < spec.num_reqs:
        prefill = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
        qo_indptr = torch.tensor([0, *query_lens[num_decodes:]], dtype=torch.int32).cumsum(0)
        indices = flashinfer_page_indices(
            block_table[num_decodes:], seq_lens[num_decodes:], shape.block_size
        )
        prefill.plan(qo_indptr.int(), *indices, *heads, shape.block_size, causal=True, **types)
    outputs = [torch.empty_like(q) for q in queries]

    def run_paged(slot: int) -> torch.Tensor:
        q, out = queries[slot], outputs[slot]
        if xqa is not None:
            xqa(q[:num_decode_tokens], out[:num_decode_tokens])
        if decode is not None:
            decode.run(q[:num_decode_tokens], data.cache, out=out[:num_decode_tokens])
        if prefill is not None:
            prefill.run(q[num_decode_tokens:], data.cache, out=out[num_decode_tokens:])
        return out

    def path() -> str:
        parts = ["FlashInfer XQA decode"] if xqa is not None else []
        if decode is not None:
            try:
                chosen = f", {decode.resolved_backend}"
            except Exception:  # older wrappers have no resolved_backend
                chosen = ""
            parts.append(f"FlashInfer decode (tensor cores{chosen})")
        if prefill is not None:
            parts.append("FlashInfer paged prefill")
        return " + ".join(parts)

    return Prepared(run_paged, rows, path)


def prepare_fa4(data: CaseData, paged: bool | None = None) -> Prepared:
    """FlashAttention-4's varlen call directly: through the page table (decode, mixed, and
    prefill when `paged`; FA4's own KV-split heuristic for decode and mixed where it has one,
    sm100+) or over the fresh prefill's contiguous K/V."""
    fa4 = _import("flash_attn.cute", "FlashAttention-4", data.device)
    spec, shape, device = data.spec, data.shape, data.device
    is_prefill = spec.section == "prefill"
    if paged is None:
        paged = not is_prefill
    elif not paged and not is_prefill:
        raise Skip("n/a (contiguous K/V only for fresh prefill)")
    cu_seqlens = data.query_start_loc.to(device)
    kwargs: dict[str, object] = {
        "cu_seqlens_q": cu_seqlens,
        "max_seqlen_q": max(spec.query_lens),
        "max_seqlen_k": max(spec.seq_lens),
        "softmax_scale": shape.scale,
        "causal": True,
    }
    if paged:
        kwargs["seqused_k"] = torch.tensor(spec.seq_lens, dtype=torch.int32, device=device)
        kwargs["page_table"] = data.block_table.to(device, torch.int32).contiguous()
        # 0 lets FA4 pick a KV split; its sm90 kernel has none (asserts num_splits == 1).
        can_split = not is_prefill and torch.cuda.get_device_capability(device)[0] >= 10
        kwargs["num_splits"] = 0 if can_split else 1
        key, value = data.cache[:, 0], data.cache[:, 1]
    else:
        kwargs["cu_seqlens_k"] = cu_seqlens
        key, value = data.key, data.value

    def run(slot: int) -> torch.Tensor:
        result = fa4.flash_attn_varlen_func(data.queries[slot], key, value, **kwargs)
        return result[0] if isinstance(result, tuple) else result

    label = "FA4 paged (page table)" if paged else "FA4 varlen (contiguous K/V)"
    if paged and not is_prefill:
        label += ", KV split auto" if kwargs["num_splits"] == 0 else ", no KV split"
    return Prepared(run, lambda out: out, lambda: label)


def prepare_sdpa(data: CaseData, backend: str) -> Prepared:
    """torch SDPA with one backend ("cudnn", "flash", "math") over contiguous K/V of a
    uniform batch: `[B, H, Lq, D]` views, GQA through `enable_gqa` (K/V expanded to every
    query head only for prefill, when the backend refuses GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec, shape = data.spec, data.shape
    kinds = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "math": SDPBackend.MATH,
    }
    if not spec.is_uniform:
        raise Skip("n/a (varlen batch)")
    num_reqs, query_len, seq_len = spec.num_reqs, spec.query_lens[0], spec.seq_lens[0]
    if 1 < query_len < seq_len:
        raise Skip("n/a (chunked prefill)")
    k, v = dense_kv(data)
    keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, num_kv_heads, seq_len, D]
    heads, size = shape.num_heads, shape.head_size
    queries = [q.view(num_reqs, query_len, heads, size).transpose(1, 2) for q in data.queries]
    state = {"gqa": True, "note": ""}

    def call(q: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([kinds[backend]]):
            return F.scaled_dot_product_attention(
                q, keys, values, is_causal=query_len > 1, scale=shape.scale,
                enable_gqa=state["gqa"],
            )  # fmt: skip

    try:
        call(queries[0])
    except RuntimeError:
        if query_len == 1:
            raise
        group = heads // shape.num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        state.update(gqa=False, note=", K/V expanded to every head")

    def run(slot: int) -> torch.Tensor:
        return call(queries[slot])

    def rows(out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2).reshape(num_reqs * query_len, heads, size)

    return Prepared(run, rows, lambda: f"SDPA {backend}{state['note']}")


def prepare_flex(data: CaseData) -> Prepared:
    """torch FlexAttention called directly, compiled for the case's shapes, as a user of the
    library would call it on the same inputs with the keys already laid out (untimed), in two
    calls (FLEX_ATTENTION itself makes one call over the whole step, decodes included, so this
    peer bounds what a decode-specific layout would give):

    - its single-token decodes: the batch is the requests, `[num_decodes, H, 1, D]` queries
      over each request's keys `[num_decodes, KVH, longest, D]` (GQA by `enable_gqa`), with a
      length mask where lengths differ (FlexAttention's decoding kernel);
    - its other requests: one call over their keys packed back to back (`[1, KVH, keys, D]`)
      with a document-causal block mask.

    A mixed batch makes both calls, each on its own requests' queries (picked out untimed) and
    with its own output. FLEX_ATTENTION's forward also writes into the caller's output and
    copies the keys out of the paged cache first (every call); those copies are part of its
    cost. (Eager on the CPU, where it serves the benchmark's tests.)"""
    spec = data.spec
    decodes = [r for r, n in enumerate(spec.query_lens) if n == 1]
    others = [r for r, n in enumerate(spec.query_lens) if n != 1]
    calls = [
        make(data, reqs)
        for make, reqs in ((_flex_decode_call, decodes), (_flex_packed_call, others))
        if reqs
    ]
    shape = data.queries[0].shape

    def run(slot: int) -> tuple[torch.Tensor, ...]:
        return tuple(call.run(slot) for call in calls)

    def rows(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        out = torch.empty(shape, dtype=outs[0].dtype, device=outs[0].device)
        for call, result in zip(calls, outs, strict=True):
            out[call.tokens] = call.rows(result)
        return out

    path = " + ".join(call.path for call in calls)
    return Prepared(run, rows, lambda: f"FlexAttention, {path}")


@dataclass
class _FlexCall:
    """One FlexAttention call of `prepare_flex` over some of the case's requests.

    Attributes:
        run: `run(slot)` on query set `slot`, returning FlexAttention's output.
        rows: that output as `[len(tokens), num_heads, head_size]` rows.
        tokens: int64 the rows' token indices in the case (arrival order).
        path: how tables name the call.
    """

    run: Callable[[int], torch.Tensor]
    rows: Callable[[torch.Tensor], torch.Tensor]
    tokens: torch.Tensor
    path: str


def _flex_attention_for(device: torch.device) -> Callable:
    """FlexAttention compiled for static shapes on CUDA, eager elsewhere (the CPU serves the
    benchmark's tests). Every compiled call shares `flex_attention`'s code object, so
    torch.compile's recompile limit counts all of a run's shapes together; past it a call would
    run eagerly, silently, and be timed so: raised here well above a run's count (8 today)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def _request_tokens(data: CaseData, reqs: list[int]) -> torch.Tensor:
    """int64 token indices of requests `reqs`, in order, on the case's device."""
    loc = data.query_start_loc.tolist()
    return torch.cat([torch.arange(loc[r], loc[r + 1]) for r in reqs]).to(data.device)


def _flex_queries(data: CaseData, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each query set's rows `tokens` (`[len(tokens), H, D]`): the sets themselves where the
    tokens are all of them, else copies (made before anything is timed)."""
    if tokens.shape[0] == data.spec.num_tokens:  # tokens are 0 ... num_tokens - 1 then
        return list(data.queries)
    return [q[tokens] for q in data.queries]


def _flex_packed_call(data: CaseData, reqs: list[int]) -> _FlexCall:
    """Requests `reqs` in one batch entry, their keys packed back to back, document-causal."""
    from torch.nn.attention.flex_attention import create_block_mask

    spec, shape, device = data.spec, data.shape, data.device
    keys, values = (x.unsqueeze(0) for x in _packed_kv(data, reqs))
    key_req, key_pos, q_req, q_pos = [], [], [], []
    for i, r in enumerate(reqs):
        n_new, n_keys = spec.query_lens[r], spec.seq_lens[r]
        key_req.append(torch.full((n_keys,), i))
        key_pos.append(torch.arange(n_keys))
        q_req.append(torch.full((n_new,), i))
        q_pos.append(torch.arange(n_keys - n_new, n_keys))
    kv_req, kv_pos = torch.cat(key_req).to(device), torch.cat(key_pos).to(device)
    tok_req, tok_pos = torch.cat(q_req).to(device), torch.cat(q_pos).to(device)

    def document_causal(b, h, q_idx, kv_idx):
        return (tok_req[q_idx] == kv_req[kv_idx]) & (kv_pos[kv_idx] <= tok_pos[q_idx])

    tokens = _request_tokens(data, reqs)
    num_tokens = tokens.shape[0]
    mask = create_block_mask(document_causal, None, None, num_tokens, keys.shape[2], device=device)
    attend = _flex_attention_for(device)
    # [T, H, D] -> [1, H, T, D] views of each input set
    queries = [q.transpose(0, 1).unsqueeze(0) for q in _flex_queries(data, tokens)]
    # Under 128 queries Inductor picks its flex-decoding kernel, which found no valid config for
    # 64 queries over 262144 keys on the H200 (torch 2.11: NoValidChoicesError); the main one.
    options = {"FORCE_USE_FLEX_ATTENTION": True} if num_tokens < 128 else None

    def run(slot: int) -> torch.Tensor:
        return attend(
            queries[slot], keys, values, block_mask=mask, scale=shape.scale, enable_gqa=True,
            kernel_options=options,
        )  # fmt: skip

    def rows(out: torch.Tensor) -> torch.Tensor:
        return out[0].transpose(0, 1)

    return _FlexCall(run, rows, tokens, "packed K/V, document-causal block mask")


def _packed_kv(data: CaseData, reqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Requests `reqs`' keys and values out of the paged cache, back to back:
    `[KVH, their keys, D]` each, contiguous."""
    spec, bs = data.spec, data.shape.block_size
    blocks, offsets = [], []
    for r in reqs:
        positions = torch.arange(spec.seq_lens[r])
        blocks.append(data.block_table[r, positions // bs].long())
        offsets.append(positions % bs)
    blocks_d, offsets_d = torch.cat(blocks).to(data.device), torch.cat(offsets).to(data.device)
    # [keys, KVH, D] -> [KVH, keys, D]
    return tuple(data.cache[blocks_d, i, offsets_d].transpose(0, 1).contiguous() for i in (0, 1))  # type: ignore[return-value]


def _flex_decode_call(data: CaseData, reqs: list[int]) -> _FlexCall:
    """Single-token requests `reqs`, one batch entry each (FlexAttention's decoding kernel)."""
    from torch.nn.attention.flex_attention import create_block_mask

    shape, device = data.shape, data.device
    seq_lens = [data.spec.seq_lens[r] for r in reqs]
    longest = max(seq_lens)
    packed = _packed_kv(data, reqs)
    # [requests, KVH, longest, D], each request's keys from position 0 (zeros past its end)
    keys, values = (
        torch.zeros(len(reqs), *x.shape[:1], longest, x.shape[2], dtype=x.dtype, device=device)
        for x in packed
    )
    start = 0
    for i, n_keys in enumerate(seq_lens):
        keys[i, :, :n_keys] = packed[0][:, start : start + n_keys]
        values[i, :, :n_keys] = packed[1][:, start : start + n_keys]
        start += n_keys
    mask = None
    if len(set(seq_lens)) > 1:
        lens = torch.tensor(seq_lens, device=device)

        def within(b, h, q_idx, kv_idx):
            return kv_idx < lens[b]

        mask = create_block_mask(within, len(reqs), None, 1, longest, device=device)
    attend = _flex_attention_for(device)
    tokens = _request_tokens(data, reqs)
    # [requests, H, D] -> [requests, H, 1, D] views of each input set
    queries = [q.unsqueeze(2) for q in _flex_queries(data, tokens)]

    def run(slot: int) -> torch.Tensor:
        return attend(
            queries[slot], keys, values, block_mask=mask, scale=shape.scale, enable_gqa=True
        )

    def rows(out: torch.Tensor) -> torch.Tensor:
        return out[:, :, 0]

    return _FlexCall(run, rows, tokens, "a batch entry per decode")


def make_contenders(
    backends: Sequence[str], peers: Sequence[str], torch_max_kv_tokens: int | None
) -> list[Contender]:
    contenders = [
        Contender(
            name,
            functools.partial(prepare_backend, name, torch_max_kv_tokens=torch_max_kv_tokens),
        )
        for name in backends
    ]
    table = {
        "fi": Contender("FlashInfer", prepare_flashinfer),
        "fa4": Contender("FA4", prepare_fa4),
        "fa4-paged": Contender("FA4 paged", _prepare_fa4_paged_prefill),
        "sdpa-cudnn": Contender("SDPA cuDNN", functools.partial(prepare_sdpa, backend="cudnn")),
        "sdpa-flash": Contender("SDPA flash", functools.partial(prepare_sdpa, backend="flash")),
        "flex": Contender("FlexAttention", prepare_flex),
    }
    return contenders + [table[p] for p in peers]


def _prepare_fa4_paged_prefill(data: CaseData) -> Prepared:
    if data.spec.section != "prefill":
        raise Skip("n/a (FA4 is paged here already)")
    return prepare_fa4(data, paged=True)


# --- running a case --------------------------------------------------------------------------


@dataclass
class Result:
    """One contender on one case. `status`: ok, wrong (timed, but off the reference), skip,
    error; `error`: max abs error against float64; `setup_s`: set-up and first call (JIT)."""

    spec: CaseSpec
    contender: str
    status: str
    time_us: float = math.nan
    error: float = math.nan
    path: str = ""
    message: str = ""
    setup_s: float = math.nan


@dataclass
class WrapperResult:
    spec: CaseSpec
    backend: str
    peer: str
    wrapper_us: float
    direct_us: float


@dataclass(frozen=True, slots=True)
class Options:
    warmup: int = 5
    reps: int = 50
    wrapper_rounds: int = 7
    wrapper_reps: int = 20
    build_reps: int = 300
    build_rounds: int = 5


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_case(
    data: CaseData, contenders: Sequence[Contender], options: Options, compare_wrappers: bool
) -> tuple[list[Result], list[WrapperResult]]:
    """Check and time every contender on one case; with `compare_wrappers`, time each wrapped
    backend against its direct call in alternating rounds."""
    spec, device = data.spec, data.device
    reference = make_reference(data)
    results: list[Result] = []
    prepared: dict[str, Prepared] = {}
    for contender in contenders:
        start = time.perf_counter()
        try:
            ready = contender.prepare(data)
            rows = ready.rows(ready.run(0))
            synchronize(device)
            error, ok = compare(rows, reference, data.shape.dtype)
            setup_s = time.perf_counter() - start
            elapsed = median_us(ready.run, len(data.queries), options.warmup, options.reps, device)
            status = "ok" if ok else "wrong"
            result = Result(spec, contender.name, status, elapsed, error, ready.path(), "", setup_s)
            if ok:
                prepared[contender.name] = ready
        except Skip as skip:
            result = Result(spec, contender.name, "skip", message=str(skip))
        except Exception as e:  # one failing contender must not end the run
            result = Result(spec, contender.name, "error", message=_first_line(e))
            _log("".join(traceback.format_exception(e, limit=-3)).rstrip())
        results.append(result)
        _log(
            f"[{spec.section} {spec.label}] {contender.name}: {result.status} "
            f"{result.message or f'{result.time_us:.1f} us, err {result.error:.2e}, '}"
            f"{'' if math.isnan(result.setup_s) else f'setup {result.setup_s:.1f} s'}"
        )
    wrappers = []
    for backend, peers in WRAPPER_PAIRS.items() if compare_wrappers else ():
        peer = peers[spec.section]
        if backend in prepared and peer in prepared:
            wrapper_us, direct_us = interleaved_us(
                prepared[backend].run, prepared[peer].run, len(data.queries),
                options.wrapper_rounds, options.wrapper_reps, device,
            )  # fmt: skip
            wrappers.append(WrapperResult(spec, backend, peer, wrapper_us, direct_us))
    return results, wrappers


# --- build() host time -----------------------------------------------------------------------


@dataclass
class BuildResult:
    backend: str
    status: str  # ok, skip, error
    median_us: float = math.nan
    p90_us: float = math.nan
    sync: str = ""
    message: str = ""
    quietest_us: float = math.nan  # the lowest of the rounds' medians


@dataclass
class PreparedBuild:
    """A backend's builder set up and warm for one build case, ready to be timed."""

    backend: str
    build: Callable[[], object]
    sync: str


def time_build(
    name: str, shape: Shape, device: torch.device | str, reps: int, *args, **kwargs
) -> BuildResult:
    """`prepare_build(name, shape, device, *args, **kwargs)` and `time_builds` of it, `reps`
    calls in one round (see both)."""
    prepared = prepare_build(name, shape, device, *args, **kwargs)
    if isinstance(prepared, BuildResult):
        return prepared
    return time_builds([prepared], reps, rounds=1)[0]


def time_builds(
    prepared: Sequence[PreparedBuild | BuildResult], reps: int, rounds: int
) -> list[BuildResult]:
    """Host microseconds of each prepared build, `reps` calls each, timed in `rounds`
    interleaved rounds (every case once per round, in turn), so that a slow phase of the host
    falls on every case alike rather than on whichever ran then. The median and p90 are over
    all calls; `quietest_us` is the lowest of the rounds' medians. A `BuildResult` (a skip or an
    error) passes through."""
    times: dict[int, list[float]] = {i: [] for i, p in enumerate(prepared)}
    round_medians: dict[int, list[float]] = {i: [] for i in times}
    per_round = max(1, reps // rounds)
    for _ in range(rounds):
        for i, case in enumerate(prepared):
            if isinstance(case, PreparedBuild):
                chunk = cpu_times_us(case.build, per_round)
                times[i] += chunk
                round_medians[i].append(statistics.median(chunk))
    results = []
    for i, case in enumerate(prepared):
        if isinstance(case, BuildResult):
            results.append(case)
            continue
        ordered = sorted(times[i])
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        median = statistics.median(ordered)
        quietest = min(round_medians[i])
        results.append(BuildResult(case.backend, "ok", median, p90, case.sync, "", quietest))
    return results


def prepare_build(
    name: str,
    shape: Shape,
    device: torch.device | str,
    num_reqs: int = 256,
    seq_len: int = 2048,
    varied: bool = False,
    graphs: bool = False,
    persistent: bool = False,
) -> PreparedBuild | BuildResult:
    """A builder for `num_reqs` decodes of `seq_len` keys, its `build` called once; on CUDA,
    then 20 calls under `torch.cuda.set_sync_debug_mode("error")` (a sync raises and is
    reported). The timed calls (`time_builds`) run without that check, which slows every CUDA
    call. A skip or a set-up error comes back as a `BuildResult`.

    The builder gets one layer's record (`impl.layer_params()`), as an engine's model runner
    gives it every layer's, so a library's planning per layer (FLASHINFER) is in the time;
    after the first call, steady state. `varied=True` spreads the requests'
    lengths over `[seq_len / 2, 3 * seq_len / 2)` (mean about `seq_len`), as a real decode batch
    has them, so that planners which take a shortcut for equal lengths are timed without it.
    `graphs=True` times the build of a step that replays a captured decode graph (the engine's
    usual decode step with CUDA graphs): the batch size is captured first
    (`build_for_cudagraph_capture`), and a backend without decode graphs is skipped;
    `persistent=True` sets `BatchLimits.has_persistent_graph_inputs` (the engine's runner does),
    whose promise holds here: capture and replay pass the same tensors, of the captured size."""
    device = torch.device(device)
    seq_lens = [seq_len] * num_reqs
    if varied:
        # a fixed spread (997 is prime to seq_len's powers of two): no random draw to seed
        seq_lens = [seq_len // 2 + (i * 997) % seq_len for i in range(num_reqs)]
        name = f"{name} (varied lengths)"
    if graphs:
        name = f"{name} (CUDA-graph replay{', persistent inputs' if persistent else ''})"
    try:
        cls = resolve_backend(name.split(" ")[0], shape, device)
        kbs = cls.get_kernel_block_size(shape.block_size)
        block_table, _ = assign_blocks(seq_lens, shape.block_size)
        common = make_common_attn_metadata(
            [1] * num_reqs,
            seq_lens,
            expand_block_table(block_table, shape.block_size, kbs),
            kbs,
            device,
        )
        limits = BatchLimits(
            max_num_reqs=num_reqs,
            max_num_tokens=num_reqs,
            max_model_len=max(seq_lens),
            cudagraph_capture_sizes=(num_reqs,) if graphs else (),
            has_persistent_graph_inputs=graphs and persistent,
        )
        kv_spec = AttentionSpec(kbs, shape.num_kv_heads, shape.head_size, shape.dtype)
        if graphs:
            support = cls.get_cudagraph_support(kv_spec, limits)
            if support < AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE:
                raise Skip(f"no decode CUDA graphs (support {support.name})")
        impl = cls.get_impl_cls()(shape.num_heads, shape.head_size, shape.scale, shape.num_kv_heads)
        builder = cls.get_builder_cls()(kv_spec, {"bench.0": impl.layer_params()}, limits, device)

        def build() -> object:
            return builder.build(0, common)

        if graphs:
            builder.build_for_cudagraph_capture(common)
        build()
        synchronize(device)
    except Skip as skip:
        return BuildResult(name, "skip", message=str(skip))
    except Exception as e:
        return BuildResult(name, "error", message=_first_line(e))
    sync = "n/a (cpu)"
    if device.type == "cuda":
        # The sync check first, on fewer calls; the debug mode makes every CUDA call slower
        # (microseconds each), so the timed calls run without it.
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            cpu_times_us(build, 20)
            sync = "none"
        except Exception as e:
            sync = _first_line(e)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        synchronize(device)
    return PreparedBuild(name, build, sync)


def host_yardstick_us(device: torch.device | str, reps: int = 300) -> float:
    """Median host microseconds of the primitive most builds pay for: one 2 KiB int32 array
    copied to `device` without waiting (through pinned memory on CUDA). Printed next to the
    build times, so that runs on hosts of different speed can be told apart: the same code
    measured 1.3-2x slower build times on one lease of the H200 machine than on another."""
    device = torch.device(device)
    host = np.arange(513, dtype=np.int32)

    def copy() -> object:
        tensor = torch.from_numpy(host)
        if device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    copy()
    synchronize(device)
    return statistics.median(cpu_times_us(copy, reps))


# --- report ----------------------------------------------------------------------------------


def _rate_cell(result: Result, shape: Shape) -> str:
    """The cell of one ok/wrong result: the section's figure of merit and the time."""
    spec, t = result.spec, result.time_us
    tbps = kv_bytes(spec, shape) / t / 1e6
    tflops = case_flops(spec, shape) / t / 1e6
    if spec.section == "decode":
        text = f"{tbps:.2f} ({t:.0f} us)"
    elif spec.section == "prefill":
        text = f"{tflops:.0f} ({t / 1e3:.2f} ms)"
    else:
        text = f"{t:.0f} us, {tbps:.2f} TB/s, {tflops:.0f} TFLOP/s"
    return text if result.status == "ok" else f"{text} WRONG"


def _cell(result: Result, shape: Shape) -> str:
    if result.status in ("ok", "wrong"):
        return _rate_cell(result, shape)
    if result.status == "error":
        return f"error: {result.message[:100]}"
    return result.message


def section_table(section: str, results: Sequence[Result], shape: Shape) -> str:
    """One markdown table for a section: a row per contender, a column per case, then the
    kernel path(s) and the largest error against the float64 reference."""
    results = [r for r in results if r.spec.section == section]
    specs = list(dict.fromkeys(r.spec for r in results))
    names = list(dict.fromkeys(r.contender for r in results))
    by_key = {(r.spec, r.contender): r for r in results}
    rows, not_run = [], []
    for name in names:
        row = [by_key[(spec, name)] for spec in specs if (spec, name) in by_key]
        messages = {r.message for r in row}
        if all(r.status == "skip" for r in row) and len(messages) == 1:
            not_run.append(f"{name}: {row[0].message}")
            continue
        paths = list(dict.fromkeys(r.path for r in row if r.path))
        errors = [r.error for r in row if not math.isnan(r.error)]
        rows.append(
            [
                name,
                *[_cell(r, shape) for r in row],
                " / ".join(paths) or "-",
                f"{max(errors):.1e}" if errors else "-",
            ]
        )
    unit = {"decode": "TB/s of K+V", "prefill": "TFLOP/s", "mixed": "time, KV TB/s, TFLOP/s"}
    headers = ["contender", *[f"{s.label} ({unit[section]})" for s in specs]]
    text = markdown_table([*headers, "kernel path", "max err"], rows)
    if not_run:
        text += "\n\nNot run: " + "; ".join(not_run) + "."
    return text


def _find(results: Sequence[Result], spec: CaseSpec, name: str) -> Result | None:
    return next((r for r in results if r.spec == spec and r.contender == name), None)


def ratio_table(results: Sequence[Result]) -> str:
    """TRITON's throughput over FlashInfer's (decode, mixed) and FA4's (prefill), measured in
    this run, against TRITON's targets: decode at least 0.9, prefill 16 x 1024 at least 1.0 and
    the longer prefills at least 0.8, mixed none."""
    targets = {"16 x 1024": 1.0, "4 x 4096": 0.8, "1 x 16384": 0.8}
    rows = []
    for spec in dict.fromkeys(r.spec for r in results):
        peer = "FA4" if spec.section == "prefill" else "FlashInfer"
        target = targets.get(spec.label) if spec.section == "prefill" else None
        if spec.section == "decode":
            target = 0.9
        ours, theirs = _find(results, spec, "TRITON"), _find(results, spec, peer)
        missing = [
            f"{name}: {r.status if r else 'not run'}"
            for name, r in (("TRITON", ours), (peer, theirs))
            if r is None or r.status != "ok"
        ]
        if missing or ours is None or theirs is None:
            value, verdict = "n/a (" + ", ".join(missing) + ")", "-"
        else:
            ratio = theirs.time_us / ours.time_us
            value = f"{ratio:.2f}"
            verdict = "-" if target is None else ("met" if ratio >= target else "MISSED")
        goal = "-" if target is None else f">= {target}"
        rows.append([f"TRITON / {peer} {spec.section}", spec.label, value, goal, verdict])
    return markdown_table(["ratio (throughput)", "case", "value", "target", "verdict"], rows)


def wrapper_table(wrappers: Sequence[WrapperResult]) -> str:
    """Wrapper cost: forward of the backend over its library called directly (target: at most
    1.03)."""
    rows = []
    for w in wrappers:
        ratio = w.wrapper_us / w.direct_us
        rows.append(
            [
                w.backend,
                f"{w.spec.section} {w.spec.label}",
                f"{w.wrapper_us:.1f}",
                f"{w.direct_us:.1f} ({w.peer})",
                f"{ratio:.3f}",
                "met" if ratio <= 1.03 else "MISSED",
            ]
        )
    if not rows:
        return (
            "No pair measured: a wrapper or its library did not run correctly on any case "
            "(see the tables above and stderr)."
        )
    headers = ["backend", "case", "forward us", "direct us", "ratio", "target <= 1.03"]
    return markdown_table(headers, rows)


def build_table(builds: Sequence[BuildResult]) -> str:
    rows = []
    for b in builds:
        if b.status != "ok":
            rows.append([b.backend, b.message, "-", "-", "-"])
            continue
        rows.append([b.backend, f"{b.median_us:.1f}", f"{b.p90_us:.1f}",
                     f"{b.quietest_us:.1f}", b.sync])  # fmt: skip
    # No build-time target: what users pay is the whole step (benchmarks/engine_host.py).
    headers = ["backend", "build median us", "p90 us", "quietest round us", "host sync"]
    return markdown_table(headers, rows)


def _version(distribution: str, module: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception as e:
        return f"not importable ({type(e).__name__})"


def header(
    device: torch.device, options: Options, argv: Sequence[str], block_size: int = 16
) -> str:
    props = torch.cuda.get_device_properties(device)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions = (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"triton {_version('triton', 'triton')}, "
        f"flashinfer {_version('flashinfer-python', 'flashinfer')}, "
        f"flash_attn (FA4) {_version('flash-attn-4', 'flash_attn.cute')}"
    )
    return "\n".join(
        [
            "## GPU kernels (`benchmarks/kernels.py`)",
            "",
            f"{now}, {props.name} (sm{props.major}{props.minor}, "
            f"{props.multi_processor_count} SMs), {versions}.",
            f"Command: `python3 benchmarks/kernels.py {' '.join(argv)}`.",
            f"bf16, 32 query / 8 KV heads, head_size 128, block {block_size}, K/V in shuffled "
            "blocks of a "
            "pool 1.5x the need (block 0 = null block), random data. Each contender is checked "
            "against a float64 reference on a slice of rows, then timed: median of "
            f"{options.reps} calls timed one by one with CUDA events after {options.warmup} "
            "warm-up calls, queued behind a sleep kernel so that the events see device time "
            "only (host overhead is excluded, as under CUDA graphs), input sets cycling; every "
            "case's working set exceeds the 60 MB L2. "
            "Only `impl.forward` is timed for anyattn backends (`build` runs once before).",
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="anyattn backends (comma list)"
    )
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"direct library calls and bounds: {', '.join(PEERS)} (or 'none')",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)"
    )
    parser.add_argument(
        "--torch-max-kv-tokens",
        type=int,
        default=300_000,
        help="skip TORCH on cases attending more keys than this (0: never skip)",
    )
    args = parser.parse_args(argv)
    args.only = _csv(parser, args.only, SECTIONS, "--only")
    args.backends = [name.upper() for name in _split(args.backends)]
    args.peers = [] if args.peers == "none" else _csv(parser, args.peers, PEERS, "--peers")
    return args


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _csv(parser: argparse.ArgumentParser, text: str, valid: Sequence[str], flag: str) -> list[str]:
    parts = _split(text)
    unknown = [p for p in parts if p not in valid]
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(unknown)} (expected {', '.join(valid)})")
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.py: no CUDA device (torch.cuda.is_available() is False); nothing to time.")
        return 0
    device = torch.device("cuda")
    options = Options(2, 10, 3, 5, 50) if args.quick else Options()
    shape = Shape(block_size=args.block_size)
    started = time.perf_counter()
    print(header(device, options, argv, shape.block_size) + "\n", flush=True)
    contenders = make_contenders(args.backends, args.peers, args.torch_max_kv_tokens or None)
    tables = [s for s in ("decode", "prefill", "mixed") if s in args.only]
    compare_wrappers = "wrapper" in args.only
    plan = [spec for section in tables for spec in CASES[section]]
    if compare_wrappers and not tables:
        plan = list(WRAPPER_CASES)
        needed = set(WRAPPER_PAIRS) | {p for v in WRAPPER_PAIRS.values() for p in v.values()}
        contenders = [c for c in contenders if c.name in needed]
    results: list[Result] = []
    wrappers: list[WrapperResult] = []
    with torch.no_grad():
        for i, spec in enumerate(plan):
            data = make_case_data(
                spec, shape, device, num_slots=4 if spec.section == "decode" else 2
            )
            case_results, case_wrappers = run_case(data, contenders, options, compare_wrappers)
            results += case_results
            wrappers += case_wrappers
            del data
            gc.collect()
            torch.cuda.empty_cache()
            last_of_section = i + 1 == len(plan) or plan[i + 1].section != spec.section
            if last_of_section and spec.section in tables:
                print(f"### {spec.section}\n\n{section_table(spec.section, results, shape)}\n")
                if spec.section == "mixed":
                    print(
                        "The prefills (seq_len = context + new tokens) arrive among the decodes; "
                        "builders that ask for decodes first get the batch reordered.\n"
                    )
        if set(tables) & {"decode", "prefill", "mixed"}:
            print(f"### ratios against TRITON's targets\n\n{ratio_table(results)}\n")
        if compare_wrappers:
            print(
                "### wrapper cost: forward vs the library called directly, GPU time, "
                f"{options.wrapper_rounds} alternating rounds of {options.wrapper_reps} calls\n\n"
                f"{wrapper_table(wrappers)}\n"
            )
        if "build" in args.only:
            cases = [prepare_build(n, shape, device) for n in args.backends]
            cases += [prepare_build(n, shape, device, varied=True) for n in args.backends]
            cases += [
                prepare_build(n, shape, device, varied=True, graphs=True, persistent=persistent)
                for persistent in (False, True)
                for n in args.backends
            ]
            builds = time_builds(cases, options.build_reps, options.build_rounds)
            print(
                "### build() host time: 256 decodes of 2048 keys (varied: 1024-3071 keys), "
                f"median of {options.build_reps} calls in {options.build_rounds} rounds that "
                "take every case in turn (host sync: 20 calls under "
                "torch.cuda.set_sync_debug_mode('error'))\n\n"
                f"{build_table(builds)}\n\n"
                "Host yardstick (one 2 KiB copy to the device, pinned, not waited for): "
                f"{host_yardstick_us(device):.1f} us.\n"
            )
    print(f"Total wall time {time.perf_counter() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
