"""Cases that run every value a backend declares at least once, against the float64 oracle.

`declaration_cases(backend, device)` turns a backend's declarations into `SweepCase`s:

- every declared head size with every declared dtype (the (head size, dtype) pairs);
- every declared dtype with every declared KV-cache dtype (the (dtype, cache dtype) pairs);
- every attention type, block size and KV-cache layout, each once;
- every declared feature flag (sinks, sliding window, ALiBi, soft cap, non-causal, per-head fp8
  scales, LSE, cascade), each once.

"Any" head size stands for 64, 80, 96, 128, 256 and the odd 65; `MultipleOf(n)` block sizes
for n, 16, `3 * lcm(n, 16)` and `_LARGEST_BLOCK_SIZE` (rounded up to a multiple of n). For MLA
backends the axes are the latent splits (each declared one, or the kit's `MLA_SHAPES` when any
is) with every dtype, every dtype with every cache dtype, every block size, and the decode LSE
when declared (`MLACase`s).

Each case runs one small batch (`sweep_spec`). A configuration the backend's joint rules refuse
(`validate_configuration`) is not run but listed, with the reasons, in `not_declared`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from anyattn.backend import AttentionBackend
from anyattn.testing.batch_spec import BatchSpec, get_spec
from anyattn.testing.cases import Case
from anyattn.testing.mla_cases import MLA_SHAPES, MLACase, MLAShape
from anyattn.types import (
    ENCODER_TYPES,
    AttentionType,
    DeviceInfo,
    KVCacheLayout,
    MultipleOf,
    is_fp8_cache,
)

__all__ = ["SweepCase", "declaration_cases", "sweep_spec"]

# Stand-ins for "any head size": the sizes real models use, and one odd size.
_ANY_HEAD_SIZES = (64, 80, 96, 128, 256, 65)
# The largest engine block size the sweep runs for `MultipleOf(n)` declarations.
_LARGEST_BLOCK_SIZE = 256
# Feature flag -> the change to the base case that exercises it.
# (The window depends on the block size and cascade needs its own batch: see _feature_case.)
_FEATURES = {
    "supports_sink": {"use_sinks": True}, "supports_sliding_window": {},
    "supports_alibi": {"use_alibi": True}, "supports_logits_soft_cap": {"logits_soft_cap": 2.0},
    "supports_non_causal": {"causal": False},
    "supports_per_head_quant_scales": {"per_head_scales": True},
    "supports_lse": {"check_lse": True}, "supports_cascade": {},
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class SweepCase:
    """One configuration of the sweep: run it with `run_case(backend, case, device, dtype)`.

    Attributes:
        id: "<axis>-<value>[-<value>]", unique within a backend and device (a pytest id).
        dtype: the model dtype of query, key, value and output.
        case: the layer settings and batch (an `MLACase` for MLA backends).
    """

    id: str
    dtype: torch.dtype
    case: Case | MLACase


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _off_grid(n: int, block_size: int, *others: int) -> int:
    """The smallest m >= n such that neither m nor m + o (o in `others`) is a multiple of
    `block_size` (no constraint for block sizes 1 and 2, where that is impossible)."""
    if block_size <= 2:
        return n
    while any((m % block_size) == 0 for m in (n, *(n + o for o in others))):
        n += 1
    return n


def sweep_spec(block_size: int, attn_type: AttentionType = AttentionType.DECODER) -> BatchSpec:
    """The sweep's batch for an engine block size and attention type, with no length a multiple
    of the block size (where the block size, above 2, allows it).

    Decoder: (context, query) = (>2 blocks, 9), (>1 block, 1), (0, >1 block), in that order (a
    builder that wants decodes first must reorder them). Encoder types: three fresh sequences.
    Cross attention: the decoder batch, each request reading encoder keys of more than one block
    (the fresh request writes its encoder K/V this step).
    """
    b = block_size
    chunk_query = _off_grid(9, b)
    chunk_context = _off_grid(2 * b + 1, b, chunk_query)
    decode_context = _off_grid(b + 2, b, 1)
    fresh = _off_grid(b + 3, b)
    if attn_type in ENCODER_TYPES:
        lens = (_off_grid(2 * b + 5, b), _off_grid(7, b), fresh)
        return BatchSpec(f"sweep_encoder_b{b}", lens, lens)
    query_lens = (chunk_query, 1, fresh)
    seq_lens = (chunk_context + chunk_query, decode_context + 1, fresh)
    encoder = None
    if attn_type is AttentionType.ENCODER_DECODER:
        encoder = (_off_grid(3 * b + 5, b), _off_grid(b + 6, b), _off_grid(2 * b + 7, b))
    return BatchSpec(f"sweep_b{b}", query_lens, seq_lens, encoder_seq_lens=encoder)


def _head_sizes(backend: type[AttentionBackend]) -> list[int]:
    return list(backend.get_supported_head_sizes()) or list(_ANY_HEAD_SIZES)


def _block_sizes(backend: type[AttentionBackend]) -> list[int]:
    sizes: list[int] = []
    for declared in backend.get_supported_kernel_block_sizes() or [MultipleOf(1)]:
        if not isinstance(declared, MultipleOf):
            sizes.append(declared)
            continue
        n = declared.base
        step = math.lcm(n, 16)
        sizes += [n, step, 3 * step, -(-_LARGEST_BLOCK_SIZE // n) * n]
    return sorted(set(sizes))


def _base_dtype(backend: type[AttentionBackend], device: DeviceInfo) -> torch.dtype:
    preferred = (torch.bfloat16,) if device.type == "cuda" else (torch.float32,)
    for dtype in (*preferred, torch.bfloat16, torch.float16, torch.float32):
        if backend.supports_dtype(dtype):
            return dtype
    return backend.supported_dtypes[0]


def _base_case(backend: type[AttentionBackend]) -> Case:
    head_size = 64 if backend.supports_head_size(64) else _head_sizes(backend)[0]
    block_size = backend.get_preferred_block_size(16)
    attn_type = AttentionType.DECODER
    if not backend.supports_attn_type(attn_type):
        attn_type = backend.supported_attn_types[0]
    return Case(
        name="", feature="sweep", spec=sweep_spec(block_size, attn_type), head_size=head_size,
        block_size=block_size, layout=backend.supported_kv_cache_layouts()[0], attn_type=attn_type,
        causal=attn_type is AttentionType.DECODER,
    )  # fmt: skip


def _at(base: Case | MLACase, name: str, **changes: object) -> Case | MLACase:
    """`base` with `changes`, its batch remade for the new block size / attention type."""
    case = replace(base, name=name, **changes)
    attn_type = case.attn_type if isinstance(case, Case) else AttentionType.DECODER
    return replace(case, spec=sweep_spec(case.block_size, attn_type))


def _feature_case(
    backend: type[AttentionBackend], flag: str, base: Case, device: DeviceInfo, dtype: torch.dtype
) -> Case | None:
    name = f"feature-{flag.removeprefix('supports_')}"
    if flag == "supports_cascade":
        spec = get_spec("cascade", quick=True)
        if spec.common_prefix_len % base.block_size:
            return None
        return replace(base, name=name, spec=spec, num_heads=2, num_kv_heads=1)
    changes = dict(_FEATURES[flag])
    if flag == "supports_sliding_window":
        changes["sliding_window"] = base.block_size + 3  # ends inside a block
    if flag == "supports_per_head_quant_scales":
        fp8 = [d for d in backend.supported_kv_cache_dtypes if is_fp8_cache(d)]
        if not fp8:
            return None
        changes["kv_cache_dtype"] = fp8[0]
    if flag == "supports_sink":
        # The sink's term in the LSE is checked wherever this device returns the LSE at all
        # (FLEX_ATTENTION declares LSE on CUDA only, sinks everywhere).
        with_lse = replace(base, name=name, **changes, check_lse=True)
        changes["check_lse"] = backend.supports_lse() and not backend.validate_configuration(
            with_lse.selector_config(dtype), device
        )
    return replace(base, name=name, **changes)


def _mla_shapes(backend: type[AttentionBackend]) -> list[MLAShape]:
    """The declared latent splits (each with the kit's head sizes where it knows the split,
    else P = Vd = 128), or the kit's `MLA_SHAPES` when any split is declared."""
    splits = backend.get_supported_mla_splits()
    if not splits:
        return list(MLA_SHAPES)
    known = {(s.kv_lora_rank, s.qk_rope_head_dim): s for s in MLA_SHAPES}
    return [known.get((rank, rope), MLAShape(rank, rope, 128, 128)) for rank, rope in splits]


def _candidates(
    backend: type[AttentionBackend], device: DeviceInfo
) -> list[tuple[Case | MLACase, torch.dtype]]:
    base_dtype = _base_dtype(backend, device)
    dtypes = [
        d for d in (torch.float32, torch.float16, torch.bfloat16) if backend.supports_dtype(d)
    ]
    out: list[tuple[Case | MLACase, torch.dtype]] = []
    base: Case | MLACase
    if backend.is_mla():
        shapes = _mla_shapes(backend)
        block_size = backend.get_preferred_block_size(16)
        base = MLACase("", "sweep", sweep_spec(block_size), shape=shapes[0], block_size=block_size)
        for shape in shapes:
            for dtype in dtypes:
                name = f"split-{shape.name}-{_dtype_name(dtype)}"
                out.append((replace(base, name=name, shape=shape), dtype))
    else:
        base = _base_case(backend)
        for head_size in _head_sizes(backend):
            for dtype in dtypes:
                name = f"head_size-{head_size}-{_dtype_name(dtype)}"
                out.append((replace(base, name=name, head_size=head_size), dtype))
    for dtype in dtypes:
        for cache in backend.supported_kv_cache_dtypes:
            name = f"kv_cache_dtype-{_dtype_name(dtype)}-{cache}"
            out.append((replace(base, name=name, kv_cache_dtype=cache), dtype))
    if isinstance(base, MLACase):
        out += [
            (_at(base, f"block_size-{b}", block_size=b), base_dtype) for b in _block_sizes(backend)
        ]
        if backend.supports_lse():
            out.append((replace(base, name="feature-lse", check_lse=True), base_dtype))
        return out
    for attn_type in backend.supported_attn_types:
        causal = attn_type is AttentionType.DECODER
        name = f"attn_type-{attn_type.value}"
        out.append((_at(base, name, attn_type=attn_type, causal=causal), base_dtype))
    if any(t is AttentionType.ENCODER_DECODER for t in backend.supported_attn_types):
        # Cross attention with a single KV head behind eight query heads.
        cross = _at(base, "attn_type-encoder_decoder-mqa", attn_type=AttentionType.ENCODER_DECODER)
        out.append((replace(cross, causal=False, num_heads=8, num_kv_heads=1), base_dtype))
    for block_size in _block_sizes(backend):
        out.append((_at(base, f"block_size-{block_size}", block_size=block_size), base_dtype))
    for layout in map(KVCacheLayout, backend.supported_kv_cache_layouts()):
        out.append((replace(base, name=f"layout-{layout}", layout=layout), base_dtype))
    for flag in _FEATURES:
        if getattr(backend, flag)():
            case = _feature_case(backend, flag, base, device, base_dtype)
            if case is not None:
                out.append((case, base_dtype))
    return out


def declaration_cases(
    backend: type[AttentionBackend], device: torch.device | str | DeviceInfo
) -> tuple[list[SweepCase], list[str]]:
    """Every configuration the sweep runs for `backend` on `device`, and what it skips.

    `device` may be a `DeviceInfo` (`DeviceInfo.parse("sm90")`) to plan for hardware this
    machine does not have; running the cases needs the real device.

    Returns:
        `(cases, not_declared)`: the cases in a fixed order, and one "<id>: <reasons>" entry per
        candidate the backend's declarations refuse jointly (a (dtype, cache dtype) pair its
        `supports_combination` rejects, say). Nothing is listed when the backend does not run
        on `device` at all: then both are empty.
    """
    info = device if isinstance(device, DeviceInfo) else DeviceInfo.current(device)
    if not backend.supports_device(info):
        return [], []
    cases: list[SweepCase] = []
    not_declared: list[str] = []
    for case, dtype in _candidates(backend, info):
        reasons = backend.validate_configuration(case.selector_config(dtype), info)
        if reasons:
            not_declared.append(f"{case.name}: {'; '.join(reasons)}")
        else:
            cases.append(SweepCase(case.name, dtype, case))
    return cases, not_declared
