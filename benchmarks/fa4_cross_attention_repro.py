"""FLASH_ATTN and FlashAttention-4 called directly on the same paged batches, vs float64.

A reproducer for FA4's paged-KV results at some head sizes: for each configuration it prints
the error of the FLASH_ATTN backend (the kit's `run_case`), of FA4's public
`flash_attn_varlen_func` called directly on the same paged cache (`page_table`), and of the same
call over the same keys gathered into contiguous rows (`cu_seqlens_k`, no page table), each
against the float64 oracle, with the kit's bound. Configurations: the kit's
`cross_attention_long` batch (8 query heads on 1 KV head, encoders of 434-1100 tokens, block 16,
NHD), and its `chunked_prefill` batch (contexts up to 700) causal and not.
Run on a CUDA machine with FA4 installed: `python benchmarks/fa4_cross_attention_repro.py`.
"""

from __future__ import annotations

import sys

import torch

from anyattn.registry import get_backend_class
from anyattn.testing import attention_oracle, build_batch, get_spec, run_case
from anyattn.testing.cases import Case
from anyattn.testing.tolerance import error_bound, max_abs_error
from anyattn.types import AttentionType

CONFIGS = (  # (label, batch, attention type, causal, head sizes)
    ("cross", "cross_attention_long", AttentionType.ENCODER_DECODER, False, (64, 80, 96, 160)),
    ("causal", "chunked_prefill", AttentionType.DECODER, True, (80, 96, 160, 208, 224, 240)),
    ("noncausal", "chunked_prefill", AttentionType.DECODER, False, (80, 96)),
)


def _direct(batch, scale: float, causal: bool, paged: bool) -> torch.Tensor:
    from flash_attn.cute import flash_attn_varlen_func

    cm = batch.common_attn_metadata
    n, r = batch.num_actual_tokens, cm.num_reqs
    lens = cm.encoder_seq_lens if batch.attn_type is AttentionType.ENCODER_DECODER else cm.seq_lens
    common = dict(
        cu_seqlens_q=cm.query_start_loc[: r + 1],
        max_seqlen_q=cm.max_query_len,
        softmax_scale=scale,
        causal=causal,
    )
    if paged:
        cache = batch.expected_kv_cache  # the keys as the backend must have written them
        out = flash_attn_varlen_func(
            batch.query[:n],
            cache[:, 0],
            cache[:, 1],
            seqused_k=lens[:r],
            page_table=cm.block_table_tensor[:r],
            **common,
        )
    else:
        dtype = batch.query.dtype
        cu_k = torch.zeros(r + 1, dtype=torch.int32)
        cu_k[1:] = torch.tensor(batch.kv_lens).cumsum(0)
        out = flash_attn_varlen_func(
            batch.query[:n],
            batch.oracle_key.to(dtype),
            batch.oracle_value.to(dtype),
            cu_seqlens_k=cu_k.cuda(),
            max_seqlen_k=max(batch.kv_lens),
            **common,
        )
    return out[0] if isinstance(out, tuple) else out


def main() -> None:
    import flash_attn.cute as fa

    print("FA4 module:", fa.__file__, file=sys.stderr)
    backend = get_backend_class("FLASH_ATTN")
    dtype = torch.float16
    print("batch      head  FLASH_ATTN  fa4_paged  fa4_contiguous  bound")
    for label, spec_name, attn_type, causal, head_sizes in CONFIGS:
        spec = get_spec(spec_name)
        for head_size in head_sizes:
            heads = (8, 1) if attn_type is AttentionType.ENCODER_DECODER else (4, 2)
            case = Case(label, "x", spec, *heads, head_size, attn_type=attn_type, causal=causal)
            result = run_case(backend, case, "cuda", dtype)[0]
            batch = build_batch(
                backend,
                spec,
                num_heads=heads[0],
                num_kv_heads=heads[1],
                head_size=head_size,
                dtype=dtype,
                device="cuda",
                attn_type=attn_type,
                causal=causal,
            )
            n = batch.num_actual_tokens
            args = (batch.query[:n], batch.oracle_key, batch.oracle_value)
            lens = (batch.spec.query_lens, batch.kv_lens)
            semantics = dict(scale=case.scale, causal=causal)
            ref64, _ = attention_oracle(*args, *lens, **semantics)
            low, _ = attention_oracle(*args, *lens, compute_dtype=dtype, **semantics)
            errors = []
            for paged in (True, False):
                try:
                    out = _direct(batch, case.scale, causal, paged)
                    errors.append(f"{max_abs_error(out, ref64):9.3g}")
                except Exception as e:  # report and go on: this is a diagnosis
                    errors.append(f"raised {type(e).__name__}")
            bound = error_bound(ref64, low, dtype)
            print(
                f"{label:10} {head_size:4}  {result.max_error:9.3g}  {errors[0]}  "
                f"{errors[1]:>14}  {bound:.3g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
