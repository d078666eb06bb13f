"""Cross attention through FLASH_ATTN and through FlashAttention-4 called directly, vs float64.

A reproducer for one failing configuration (8 query heads on 1 KV head, long encoders, block 16,
NHD; the kit's `cross_attention_long` batch): for each dtype and head size it prints the error
of the FLASH_ATTN backend and of FA4's public `flash_attn_varlen_func` called directly on the
same paged cache, with a few of its options, against the float64 oracle, and the kit's bound.
Run on a CUDA machine with FA4 installed: `python benchmarks/fa4_cross_attention_repro.py`.
"""

from __future__ import annotations

import torch

from anyattn.registry import get_backend_class
from anyattn.testing import attention_oracle, build_batch, get_spec, run_case
from anyattn.testing.cases import Case
from anyattn.testing.tolerance import error_bound, max_abs_error
from anyattn.types import AttentionType


def _direct(batch, scale: float, **options) -> torch.Tensor:
    from flash_attn.cute import flash_attn_varlen_func

    cm = batch.common_attn_metadata
    n, r = batch.num_actual_tokens, cm.num_reqs
    cache = batch.expected_kv_cache  # the encoder K/V as the backend must have written them
    out = flash_attn_varlen_func(
        batch.query[:n],
        cache[:, 0],
        cache[:, 1],
        cu_seqlens_q=cm.query_start_loc[: r + 1],
        seqused_k=cm.encoder_seq_lens[:r],
        page_table=cm.block_table_tensor[:r],
        max_seqlen_q=cm.max_query_len,
        softmax_scale=scale,
        causal=False,
        **options,
    )
    return out[0] if isinstance(out, tuple) else out


def main() -> None:
    backend = get_backend_class("FLASH_ATTN")
    spec = get_spec("cross_attention_long")
    cross = AttentionType.ENCODER_DECODER
    print("dtype     head  via                       error      bound")
    for dtype in (torch.float16, torch.bfloat16):
        for head_size in (64, 80, 96, 128):
            case = Case("cross", "x", spec, 8, 1, head_size, attn_type=cross)
            (result,) = run_case(backend, case, "cuda", dtype)[:1]
            row = f"{str(dtype)[6:]:9} {head_size:4}"
            print(f"{row}  FLASH_ATTN               {result.max_error:9.3g}  {result.bound:9.3g}")
            batch = build_batch(
                backend,
                spec,
                num_heads=8,
                num_kv_heads=1,
                head_size=head_size,
                dtype=dtype,
                device="cuda",
                attn_type=cross,
            )
            n = batch.num_actual_tokens
            args = (batch.query[:n], batch.oracle_key, batch.oracle_value)
            lens = (batch.spec.query_lens, batch.kv_lens)
            ref64, _ = attention_oracle(*args, *lens, scale=case.scale, causal=False)
            low, _ = attention_oracle(
                *args, *lens, scale=case.scale, causal=False, compute_dtype=dtype
            )
            bound = error_bound(ref64, low, dtype)
            for label, options in (
                ("fa4 direct", {}),
                ("fa4 pack_gqa=False", {"pack_gqa": False}),
                ("fa4 num_splits=1", {"num_splits": 1}),
                ("fa4 both", {"pack_gqa": False, "num_splits": 1}),
            ):
                try:
                    error = max_abs_error(_direct(batch, case.scale, **options), ref64)
                    print(f"{row}  {label:24} {error:9.3g}  {bound:9.3g}")
                except Exception as e:  # report and go on: this is a diagnosis
                    print(f"{row}  {label:24} raised {type(e).__name__}: {str(e)[:80]}")


if __name__ == "__main__":
    main()
