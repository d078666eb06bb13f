"""A per-phase pair as a contender of `benchmarks/fastest.py`: one case's decode rows on one
backend and its prefill rows on another over one KV cache, as the engine runs a layer with a
prefill backend (docs/per_phase.md): the step laid out decodes first, cut by
`anyattn.phase_metadata.split_by_phase`, each part built by its own backend's builder. Set up
like `kernels.prepare_backend` (K/V written once, untimed); the timed call is the two forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import kernels
import torch

from anyattn.config import AttentionSpec, BatchLimits
from anyattn.kv_cache_sharing import KVCacheNotShareableError, plan_shared_kv_cache
from anyattn.metadata import expand_block_table, make_common_attn_metadata
from anyattn.phase_metadata import split_by_phase
from anyattn.types import AttentionType

__all__ = ["prepare_pair"]


@dataclass
class _Layer:
    """The `layer` argument of forward: name and (unused, non-fp8) KV scales."""

    layer_name: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def _impl(cls: type, shape: kernels.Shape) -> object:
    return cls.get_impl_cls()(
        shape.num_heads,
        shape.head_size,
        shape.scale,
        shape.num_kv_heads,
        None,
        None,
        "auto",
        None,
        AttentionType.DECODER,
        None,
        None,
    )


def _decode_threshold(decode_builder: object, prefill_builder: object) -> int:
    """The threshold the model runner splits at: the smaller of the decode builder's (1, one-
    token decodes, when it asks for none) and the prefill builder's, when it asks."""
    asked = [getattr(decode_builder, "reorder_batch_threshold", None) or 1]
    asked.append(getattr(prefill_builder, "reorder_batch_threshold", None))
    return min(t for t in asked if t is not None)


def prepare_pair(decode: str, prefill: str, data: kernels.CaseData) -> kernels.Prepared:
    """Set up `decode` + `prefill` on `data`; raises `kernels.Skip` when either backend cannot
    run the case or the two cannot share one cache."""
    shape, spec = data.shape, data.spec
    classes = [kernels.resolve_backend(name, shape, data.device) for name in (decode, prefill)]
    try:
        shared = plan_shared_kv_cache(
            classes,
            block_size=shape.block_size,
            num_kv_heads=shape.num_kv_heads,
            head_size=shape.head_size,
            kv_cache_dtype="auto",
        )
    except KVCacheNotShareableError as error:
        raise kernels.Skip(f"no shared cache: {error}") from None
    if shared.layout != classes[0].supported_kv_cache_layouts()[0]:
        raise kernels.Skip(f"shared layout {shared.layout.value} is not {decode}'s first")
    kbs = shared.kernel_block_size
    kv_cache = kernels.backend_cache(classes[0], data, kbs)
    limits = BatchLimits(spec.num_reqs, spec.num_tokens, max(spec.seq_lens))
    kv_spec = AttentionSpec(kbs, shape.num_kv_heads, shape.head_size, shape.dtype)
    impls = [_impl(cls, shape) for cls in classes]
    builders = [
        cls.get_builder_cls()(kv_spec, {"bench.0": impl.layer_params()}, limits, data.device)
        for cls, impl in zip(classes, impls, strict=True)
    ]
    threshold = _decode_threshold(*builders)
    order = kernels.request_order(spec.query_lens, threshold)
    query_lens = [spec.query_lens[r] for r in order]
    common = make_common_attn_metadata(
        query_lens,
        [spec.seq_lens[r] for r in order],
        expand_block_table(data.block_table[order], shape.block_size, kbs),
        kbs,
        data.device,
    )
    num_decodes = next((i for i, n in enumerate(query_lens) if n > threshold), len(query_lens))
    parts = split_by_phase(common, num_decodes)
    built = [
        None if part is None else builder.build(0, part)
        for builder, part in zip(builders, parts, strict=True)
    ]
    rows = sum(query_lens[:num_decodes])
    index = kernels.gather_index(spec.query_lens, order).to(data.device)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=data.device)
    queries = [q[index] for q in data.queries]
    key, value = data.key[index], data.value[index]
    one = torch.ones((), dtype=torch.float32, device=data.device)
    layer = _Layer("bench.0", one, one)
    impls[0].do_kv_cache_update(layer, key, value, kv_cache, common.slot_mapping, common)
    outputs = [torch.empty_like(q) for q in queries]
    cuts = [slice(0, rows), slice(rows, spec.num_tokens)]

    def run(slot: int) -> torch.Tensor:
        q, out = queries[slot], outputs[slot]
        for impl, metadata, cut in zip(impls, built, cuts, strict=True):
            if metadata is not None:
                impl.forward(layer, q[cut], key[cut], value[cut], kv_cache, metadata, out[cut])
        return out

    def path() -> str:
        return f"{decode} ({num_decodes} decodes) + {prefill} ({spec.num_reqs - num_decodes})"

    return kernels.Prepared(run, lambda out: out[inverse], path)
