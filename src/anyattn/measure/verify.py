"""Check a backend against the float64 oracle of `anyattn.testing` before it is timed.

A backend that computes the wrong thing fast must never be chosen. Each candidate runs one
sample step first, with the layer's own shape, dtype, cache dtype, block size and features:

- standard attention: the conformance kit's "mixed" case (decodes, fresh prefills and a chunk
  over a context in one batch, small lengths) through `anyattn.testing.run_case`, which also
  checks the cache writes exactly;
- MLA: a mixed step (two decodes, a chunk over a context, a fresh prefill) through the timing
  set-up; the decode rows are compared with MQA over the cached latent rows (keys the whole
  row, values its first L columns) and the prefill rows with attention over up-projected keys
  and values (context read back from the cache, new tokens from the inputs), both computed by
  `attention_oracle` in float64 and judged by `error_bound` (docs/mla.md).
"""

from __future__ import annotations

import math

import torch

from anyattn.backend import AttentionBackend
from anyattn.config import AttentionSelectorConfig, BatchLimits
from anyattn.layer_params import LayerParams, MLALayerParams
from anyattn.measure.inputs import PreparedStep, prepare_step
from anyattn.measure.steps import MeasureStep, Phase
from anyattn.testing import Case, attention_oracle, error_bound, get_spec, max_abs_error, run_case
from anyattn.types import AttentionType

__all__ = ["check_against_oracle"]

# The kit's small values for features whose size a config does not carry.
_SAMPLE_WINDOW = 7
_SAMPLE_SOFT_CAP = 2.0
# The MLA sample: decodes over contexts of 9 and 30, a 5-token chunk over 20, a fresh prefill.
_MLA_SAMPLE = MeasureStep("check/mla", Phase.MIXED, (1, 1, 5, 6), (10, 31, 25, 6))


def _standard_case(
    backend: type[AttentionBackend], config: AttentionSelectorConfig, layer: LayerParams
) -> Case:
    return Case(
        name="measure/mixed",
        feature="mixed",
        spec=get_spec("mixed", quick=True),
        num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        block_size=config.block_size or backend.get_preferred_block_size(16),
        layout=backend.supported_kv_cache_layouts()[0],
        kv_cache_dtype=config.kv_cache_dtype,
        per_head_scales=config.use_per_head_quant_scales,
        attn_type=AttentionType.DECODER,
        causal=not config.use_non_causal,
        sliding_window=_SAMPLE_WINDOW if layer.sliding_window else None,
        logits_soft_cap=_SAMPLE_SOFT_CAP if layer.logits_soft_cap else None,
        use_alibi=layer.has_alibi,
        use_sinks=layer.has_sinks,
        check_lse=config.needs_lse,
    )


def _cached_rows(prepared: PreparedStep, request: int, count: int) -> torch.Tensor:
    """float64 `[count, L + R]`: request's first `count` latent rows as the cache holds them."""
    common = prepared.common
    block_size = prepared.kv_cache.shape[1]
    positions = torch.arange(count)
    blocks = common.block_table_cpu[request, positions // block_size].long()
    rows = prepared.kv_cache.cpu()[blocks, positions % block_size].double()
    return rows * prepared.layer.k_scale.cpu().double()


def _judge(name: str, out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, dtype):
    error, bound = max_abs_error(out, ref64), error_bound(ref64, ref_lowp, dtype)
    if error <= bound:
        return None
    shown = "NaN" if math.isnan(error) else f"{error:.3g}"
    return f"{name}: max error {shown} above the bound {bound:.3g} of the float64 oracle"


def _check_written_rows(prepared: PreparedStep) -> str | None:
    """The step's latent rows must be in the cache exactly, as the standard write stores them
    (scale 1: a plain cast to the cache dtype)."""
    slots = prepared.common.slot_mapping_cpu
    block_size = prepared.kv_cache.shape[1]
    written = prepared.kv_cache.cpu()[slots // block_size, slots % block_size]
    rows = torch.cat([prepared.inputs["kv_c"], prepared.inputs["k_pe"]], -1).cpu()
    expected = rows.float().to(written.dtype)
    if torch.equal(written.view(torch.uint8), expected.view(torch.uint8)):
        return None
    return "the step's latent rows in the cache differ from what the write must store"


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _check_mla(
    backend: type[AttentionBackend],
    config: AttentionSelectorConfig,
    layer: MLALayerParams,
    device: torch.device,
) -> str | None:
    step = _MLA_SAMPLE
    limits = BatchLimits(step.num_reqs, step.num_tokens, max(step.seq_lens))
    prepared = prepare_step(backend, config, layer, step, limits, device, seed=1)
    md = prepared.build()
    prepared.run(md)
    lat, rope = layer.kv_lora_rank, layer.qk_rope_head_dim
    nope, v_dim = layer.qk_nope_head_dim, layer.v_head_dim
    x = {k: v.cpu().double() for k, v in prepared.inputs.items()}
    kv_b = prepared.layer.kv_b.cpu().double()  # type: ignore[union-attr]
    decode = md.num_decode_tokens  # type: ignore[attr-defined]
    # Decode rows: MQA over whole cached rows, values their first L columns.
    dec_lens = step.seq_lens[:decode]
    keys = torch.cat([_cached_rows(prepared, r, n) for r, n in enumerate(dec_lens)])[:, None]
    query = torch.cat([x["q_latent"][:decode], x["q_pe"][:decode]], dim=-1)
    args = (query, keys, _pad(keys[..., :lat], lat + rope), (1,) * decode, dec_lens)
    problems = []
    if decode:
        ref64, _ = attention_oracle(*args, scale=layer.scale)
        ref_lowp, _ = attention_oracle(*args, scale=layer.scale, compute_dtype=config.dtype)
        out = prepared.outputs["output"][:decode].cpu()
        problems.append(_judge("decode", out, ref64[..., :lat], ref_lowp[..., :lat], config.dtype))
    # Prefill rows: context from the cache, new tokens from the inputs, up-projected per head.
    width = max(nope + rope, v_dim)
    all_keys, all_values = [], []
    start = decode
    for r in range(decode, step.num_reqs):
        q_len, seq_len = step.query_lens[r], step.seq_lens[r]
        context = _cached_rows(prepared, r, seq_len - q_len)
        new = torch.cat([x["kv_c"][start : start + q_len], x["k_pe"][start : start + q_len]], -1)
        rows = torch.cat([context, new])  # [seq_len, L + R]
        up = torch.einsum("nl,hdl->nhd", rows[:, :lat], kv_b)  # [seq_len, H, P + Vd]
        k_pe = rows[:, None, lat:].expand(-1, layer.num_heads, -1)
        all_keys.append(_pad(torch.cat([up[..., :nope], k_pe], -1), width))
        all_values.append(_pad(up[..., nope:], width))
        start += q_len
    total = md.num_actual_tokens  # type: ignore[attr-defined]
    if total > decode:
        pre_args = (
            _pad(x["q"][decode:total], width), torch.cat(all_keys), torch.cat(all_values),
            step.query_lens[decode:], step.seq_lens[decode:],
        )  # fmt: skip
        ref64, _ = attention_oracle(*pre_args, scale=layer.scale)
        ref_lowp, _ = attention_oracle(*pre_args, scale=layer.scale, compute_dtype=config.dtype)
        out = prepared.outputs["output_mha"][decode:total].cpu()
        problems.append(
            _judge("prefill", out, ref64[..., :v_dim], ref_lowp[..., :v_dim], config.dtype)
        )
    problems.append(_check_written_rows(prepared))
    found = [p for p in problems if p is not None]
    return "; ".join(found) if found else None


def check_against_oracle(
    backend: type[AttentionBackend],
    config: AttentionSelectorConfig,
    layer: LayerParams,
    device: torch.device,
) -> str | None:
    """Run `backend` on a sample step of `layer` and compare it with the float64 oracle.

    Returns:
        None when the results are within the kit's tolerance, else why not (an exception the
        backend raised is reported, never propagated).
    """
    try:
        if isinstance(layer, MLALayerParams):
            return _check_mla(backend, config, layer, device)
        case = _standard_case(backend, config, layer)
        failed = [r for r in run_case(backend, case, device, config.dtype) if not r.passed]
    except Exception as error:  # a candidate may fail in any way; it is then not timed
        return f"sample step raised {type(error).__name__}: {error}"
    if failed:
        return "; ".join(f"{r.name}: {r.detail}" for r in failed)
    return None
