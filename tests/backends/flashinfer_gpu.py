"""What the FlashInfer GPU tests (`test_flashinfer*.py`) share: their markers, a kit batch
with the step's K/V written to the cache, one forward, and the oracle's verdict.

The layer is 8 query / 2 KV heads of 128, softmax scale 0.1, bf16 unless a test says
otherwise; the oracle is the kit's float64 reference with docs/semantics.md's error bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from anyattn.backends.flashinfer import FlashInferBackend, FlashInferImpl
from anyattn.testing import KitLayer, attention_oracle, build_batch, error_bound, max_abs_error
from anyattn.testing.batch_spec import BatchSpec
from anyattn.testing.paged import PagedBatch

HEADS, KV_HEADS, HEAD_SIZE, SCALE = 8, 2, 128, 0.1


def needs_flashinfer(test):
    """Marks a test as needing a CUDA GPU and FlashInfer."""
    test = pytest.mark.gpu(test)
    usable = torch.cuda.is_available() and FlashInferBackend.get_unavailable_reason() is None
    return pytest.mark.skipif(not usable, reason="needs a CUDA GPU and FlashInfer")(test)


def needs_flashinfer_sm90(test):
    """Marks a test as needing a Hopper-or-later GPU and FlashInfer (XQA)."""
    test = pytest.mark.gpu(test)
    usable = FlashInferBackend.get_unavailable_reason() is None and (
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    )
    return pytest.mark.skipif(not usable, reason="needs SM90+ and FlashInfer")(test)


def written_batch(
    spec: BatchSpec, *, seed: int, block_size: int = 16
) -> tuple[PagedBatch, FlashInferImpl]:
    """A kit batch on CUDA (bf16, the layer above, its builder given the layer) whose step K/V
    the impl has written to the cache, so that a forward without `key` / `value` sees every key;
    and the impl."""
    impl = FlashInferImpl(HEADS, HEAD_SIZE, SCALE, KV_HEADS)
    batch = build_batch(
        FlashInferBackend, spec, num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
        dtype=torch.bfloat16, device="cuda", seed=seed, block_size=block_size,
        layers={"layer.0": impl.layer_params()},
    )  # fmt: skip
    slots = batch.common_attn_metadata.slot_mapping
    impl.do_kv_cache_update(layer(batch), batch.key, batch.value, batch.kv_cache, slots)
    return batch, impl


def layer(batch: PagedBatch) -> KitLayer:
    """The test layer with the batch's K/V scales."""
    return KitLayer("layer.0", batch.k_scale, batch.v_scale)


def forward(
    impl: FlashInferImpl, batch: PagedBatch, md: object, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`impl.forward` of the batch's queries on metadata `md`: output `[tokens, HEADS,
    HEAD_SIZE]` (NaN where not written) and, with `with_lse`, the LSE `[HEADS, tokens]`."""
    output = torch.full_like(batch.query, math.nan)
    lse = torch.full((HEADS, batch.query.shape[0]), math.nan, device="cuda") if with_lse else None
    impl.forward(layer(batch), batch.query, batch.key, batch.value, batch.kv_cache, md, output,
                 output_lse=lse)  # fmt: skip
    return output, lse


def oracle(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The float64 oracle's output and LSE (natural log) for the batch's real tokens, and the
    error bound an output must meet (bf16)."""
    n = batch.num_actual_tokens
    lengths = (batch.spec.query_lens, batch.kv_lens)
    args = (batch.query[:n], batch.oracle_key, batch.oracle_value, *lengths)
    ref64, lse64 = attention_oracle(*args, scale=SCALE, causal=batch.causal)
    low = torch.bfloat16
    ref_lowp, _ = attention_oracle(*args, scale=SCALE, causal=batch.causal, compute_dtype=low)
    return ref64, lse64, error_bound(ref64, ref_lowp, low)


def assert_matches_oracle(batch: PagedBatch, output: torch.Tensor) -> torch.Tensor:
    """docs/semantics.md's tolerance rule against the float64 oracle; returns the oracle's LSE."""
    ref64, lse64, bound = oracle(batch)
    assert max_abs_error(output[: batch.num_actual_tokens], ref64) <= bound
    return lse64
