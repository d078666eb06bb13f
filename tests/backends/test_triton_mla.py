"""TRITON_MLA on the CPU: the MLA conformance kit and extra cases under the Triton interpreter
(this file run as a script with `TRITON_INTERPRET=1`), then declarations, selection and the
builder's plans. float32 and float16 under the interpreter (it computes bf16 wrongly, see
docs/semantics.md, "Tolerance"); bf16, every declared split and CUDA graphs in
test_triton_mla_gpu.py.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from triton_mla_case import InterpretedTritonMLA, InterpretedTritonMLABuilder

from anyattn import AttentionSelectorConfig, BatchLimits, DeviceInfo, select_backend
from anyattn.backends.torch_mla import TorchMLABackend
from anyattn.backends.triton_mla import TritonMLABackend, TritonMLAImpl
from anyattn.backends.triton_mla_builder import (
    TritonMLAMetadata,
    TritonMLAMetadataBuilder,
    choose_num_splits,
)
from anyattn.config import MLAAttentionSpec
from anyattn.metadata import make_common_attn_metadata
from anyattn.testing import MLACase, MLAShape, check_backend, get_spec, run_mla_case
from anyattn.types import AttentionCGSupport

SIZES = {"kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 24}
SM90 = DeviceInfo.parse("sm90")


class SplittingBuilder(InterpretedTritonMLABuilder):
    """Split-KV from 8 keys per split, so that the kit's tiny decodes split."""

    min_keys_per_split = 8


class SplittingTritonMLA(InterpretedTritonMLA):
    @staticmethod
    def get_builder_cls() -> type[TritonMLAMetadataBuilder]:
        return SplittingBuilder


def _failed(results) -> list[str]:
    return [f"{r.name}: {r.detail} ({r.max_error:.3g} > {r.bound:.3g})" for r in results
            if not r.passed]  # fmt: skip


def check_kit(dtype: torch.dtype) -> list[str]:
    report = check_backend(InterpretedTritonMLA, "cpu", dtype, quick=True)
    return [f"kit {dtype}: {c.name}" for c in report.failures]


def check_split_kv(dtype: torch.dtype) -> list[str]:
    """The kit's decodes and mixed batch with LSE, split-KV forced on their short contexts."""
    spec = MLAAttentionSpec(block_size=16, dtype=dtype, **SIZES)
    builder = SplittingBuilder(spec, {"l": _impl().layer_params()}, _limits(), "cpu")
    many = get_spec("many_decodes", quick=True)
    md = builder.build(0, make_common_attn_metadata(list(many.query_lens), list(many.seq_lens),
                                                    _table(many.seq_lens), 16))  # fmt: skip
    failures = [] if md.decode_plan.num_splits > 1 else ["split-kv: no split planned"]
    shape = MLAShape(**SIZES)
    for name in ("many_decodes", "mixed"):
        case = MLACase(f"split/{name}", "decode", get_spec(name, quick=True), shape=shape,
                       check_lse=True)  # fmt: skip
        failures += _failed(run_mla_case(SplittingTritonMLA, case, "cpu", dtype, seed=1))
    return failures


def check_wide_values(dtype: torch.dtype) -> list[str]:
    """Vd wider than P + R (queries and keys padded instead of values), over context chunks."""
    shape = MLAShape(64, 16, 8, 40)
    case = MLACase("wide_values", "chunked", get_spec("chunked_prefill", quick=True),
                   shape=shape, workspace_tokens=32, min_context_chunks=3)  # fmt: skip
    return _failed(run_mla_case(InterpretedTritonMLA, case, "cpu", dtype, seed=2))


def run_interpreter_cases() -> list[str]:
    failures = []
    for dtype in (torch.float32, torch.float16):
        for check in (check_kit, check_split_kv, check_wide_values):
            try:
                failures += check(dtype)
            except Exception as error:
                failures.append(f"{check.__name__} {dtype}: {type(error).__name__}: {error}")
    return failures


@pytest.mark.slow  # about 30 s of interpreted kernels
def test_kernels_under_interpreter(triton_interpreter: Callable[..., str]) -> None:
    triton_interpreter(__file__, timeout=600)


# --- declarations and selection -----------------------------------------------------------


def test_declarations_and_reasons() -> None:
    splits = TritonMLABackend.get_supported_mla_splits()
    assert len(splits) == 96 and (512, 64) in splits and (16, 16) in splits
    assert TritonMLABackend.describe()["mla_splits"] == "{16, 32, ..., 512}+{16, 32, 64}"
    level = TritonMLABackend.get_cudagraph_support()
    assert level is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    base = AttentionSelectorConfig(
        576, "bfloat16", use_mla=True, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
    )
    assert TritonMLABackend.validate_configuration(base, SM90) == []
    assert TritonMLABackend.validate_configuration(base.replace(needs_lse=True), SM90) == []
    fp8 = base.replace(kv_cache_dtype="fp8_e4m3")
    assert TritonMLABackend.validate_configuration(fp8, SM90) == []
    assert TritonMLABackend.validate_configuration(fp8, DeviceInfo.parse("sm80")) == [
        "fp8 e4m3 KV cache needs compute capability >= 8.9 (Triton's e4m3 casts)"
    ]
    odd = base.replace(head_size=520 + 64)
    assert TritonMLABackend.validate_configuration(odd, SM90) == [
        "MLA latent split 520+64 not supported (supported kv_lora_rank+qk_rope_head_dim: "
        "{16, 32, ..., 512}+{16, 32, 64})"
    ]
    assert TritonMLABackend.validate_configuration(base.replace(head_size=600, qk_rope_head_dim=88),
                                                   SM90)  # fmt: skip
    assert TritonMLABackend.validate_configuration(base.replace(dtype="float32"), SM90) == [
        "dtype float32 not supported (supported: float16, bfloat16)"
    ]
    assert "device cpu not supported (supported: cuda)" in TritonMLABackend.validate_configuration(
        base, DeviceInfo.cpu()
    )


def test_chosen_before_torch_mla_on_cuda_only() -> None:
    pytest.importorskip("triton")
    config = AttentionSelectorConfig(
        576, "bfloat16", use_mla=True, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
    )
    for device in ("sm80", "sm90", "sm100"):
        assert select_backend(config, device=device) is TritonMLABackend
    assert select_backend(config, device="cpu") is TorchMLABackend
    # A split TRITON_MLA does not declare falls back to the reference on CUDA.
    assert select_backend(config.replace(head_size=576 + 8, qk_rope_head_dim=72), SM90) is (
        TorchMLABackend
    )


def test_impl_refuses_what_the_kernels_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"latent split not supported .*kv_lora_rank=72"):
        TritonMLAImpl(4, 0.1, **{**SIZES, "kv_lora_rank": 72})
    # The constructor applies the selector's rule: its message holds the same reason.
    wide = {**SIZES, "qk_nope_head_dim": 256}
    reason = TritonMLABackend.get_mla_head_dims_reason(256, 16, 24)
    assert reason is not None and "qk_rope_head_dim = 272, v_head_dim = 24 not supported" in reason
    with pytest.raises(ValueError) as error:
        TritonMLAImpl(4, 0.1, **wide)
    assert str(error.value).startswith(f"TRITON_MLA impl: {reason} (got qk_nope_head_dim=256")
    TritonMLAImpl(4, 0.1, **{**SIZES, "qk_nope_head_dim": 240, "v_head_dim": 256})  # at the limit


# --- the builder's plans --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_rows", "programs_per_row", "max_seq_len", "expected"),
    [
        (8, 1, 32768, 16),  # 8 x 32768 at 16 heads: 128 programs of 2048 keys
        (8, 2, 32768, 8),  # at 128 heads (two 64-head tiles)
        (64, 1, 4096, 2),
        (256, 1, 2048, 1),  # over 128 programs already
        (1, 1, 1000, 2),  # at least 256 keys per split
        (3, 1, 255, 1),
        (0, 1, 0, 1),
    ],
)
def test_choose_num_splits(num_rows, programs_per_row, max_seq_len, expected) -> None:
    assert choose_num_splits(num_rows, programs_per_row, max_seq_len) == expected


def test_choose_num_splits_takes_its_policy_as_arguments() -> None:
    assert choose_num_splits(8, 1, 32768, target_programs=528, max_splits=64) == 64
    assert choose_num_splits(8, 1, 32768, max_splits=16) == 16
    assert choose_num_splits(8, 1, 32768, 2048) == 16  # at least 2048 keys per split


def _impl(**changes) -> TritonMLAImpl:
    return TritonMLAImpl(4, 0.2, **{**SIZES, **changes})


def _limits(**changes) -> BatchLimits:
    return BatchLimits(**{"max_num_reqs": 8, "max_num_tokens": 256, "max_model_len": 4096,
                          **changes})  # fmt: skip


def _table(seq_lens, block_size: int = 16) -> torch.Tensor:
    blocks = [-(-s // block_size) for s in seq_lens]
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 1
    for r, n in enumerate(blocks):
        table[r, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    return table


def _builder(cls=TritonMLAMetadataBuilder, workspace_tokens: int = 8192, **limits):
    spec = MLAAttentionSpec(block_size=16, dtype=torch.float16, **SIZES)
    impl = _impl(workspace_tokens=workspace_tokens)
    return cls(spec, {"l": impl.layer_params()}, _limits(**limits), "cpu")


def test_decode_plan_reads_the_step_in_place_and_keeps_one_workspace() -> None:
    builder = _builder(SplittingBuilder)
    cm = make_common_attn_metadata([1, 1, 1], [40, 9, 300], _table([40, 9, 300]), 16)
    md = builder.build(0, cm)
    assert isinstance(md, TritonMLAMetadata)
    assert md.decode.seq_lens.data_ptr() == cm.seq_lens.data_ptr()
    assert md.decode.block_table.data_ptr() == cm.block_table_tensor.data_ptr()
    plan = md.decode_plan
    assert plan.num_splits == choose_num_splits(3, 1, 300, 8) == 32
    assert tuple(plan.workspace[0].shape) == (3, 4, 32, 64)
    cm2 = make_common_attn_metadata([1] * 5, [20] * 5, _table([20] * 5), 16)
    plan2 = builder.build(0, cm2).decode_plan
    assert plan2.num_splits == 2 and tuple(plan2.workspace[1].shape) == (5, 4, 2)
    # One buffer, allocated once: every step's views start at the same address.
    assert plan2.workspace[0].data_ptr() == plan.workspace[0].data_ptr()
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.decode_plan = None


def test_capture_needs_persistent_inputs_and_uniform_decodes() -> None:
    cm = make_common_attn_metadata([1, 1], [40, 9], _table([40, 9]), 16)
    with pytest.raises(ValueError, match="has_persistent_graph_inputs=False, expected True"):
        _builder().build_for_cudagraph_capture(cm)
    builder = _builder(has_persistent_graph_inputs=True, cudagraph_capture_sizes=(2, 4))
    md = builder.build_for_cudagraph_capture(cm)
    # The split choice assumes max_model_len (4096) keys: 2 rows x 1 head tile -> 32 splits,
    # then 16 for at least 256 keys each.
    assert md.decode_plan.num_splits == choose_num_splits(2, 1, 4096) == 16
    mixed = make_common_attn_metadata([1, 3], [40, 9], _table([40, 9]), 16)
    with pytest.raises(ValueError, match="only batches of single-token decodes are captured"):
        builder.build_for_cudagraph_capture(mixed)


def test_prefill_plan_lays_out_dense_launches_exactly() -> None:
    """Three prefills: contexts 20, 0 and 30 in a workspace of 32 rows; the fresh request
    between them holds no piece of the chunks but gets an empty entry in the first's launch."""
    builder = _builder(workspace_tokens=32)
    query_lens, context = [1, 3, 2, 4], [7, 20, 0, 30]
    seq_lens = [q + c for q, c in zip(query_lens, context, strict=True)]
    md = builder.build(0, make_common_attn_metadata(query_lens, seq_lens, _table(seq_lens), 16))
    new, chunks = md.prefill_plan.new_tokens, md.prefill_plan.chunks
    assert (new.q_start, new.q_end, new.num_reqs, new.causal) == (0, 9, 3, True)
    assert new.query_start_loc.tolist() == [0, 3, 5, 9] and new.seq_lens.tolist() == [3, 2, 4]
    # Entries past a request's keys are never read (clamped into the rows).
    assert new.block_table.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [5, 6, 7, 8]]
    assert [c.num_tokens for c in md.prefill.chunks] == [32, 18]
    first, second = chunks
    # Chunk 1: request 0's 20 rows, request 1 (no context) empty, request 2's first 12 rows.
    assert (first.q_start, first.q_end, first.num_reqs, first.causal) == (0, 9, 3, False)
    assert first.query_start_loc.tolist() == [0, 3, 5, 9]
    assert first.seq_lens.tolist() == [20, 0, 12]
    table = first.block_table.numpy()
    assert table.shape == (3, 20)
    assert (table[0] == np.arange(20)).all() and (table[2, :12] == np.arange(20, 32)).all()
    # Chunk 2: request 2's last 18 rows.
    assert (second.q_start, second.q_end, second.num_reqs) == (5, 9, 1)
    assert second.seq_lens.tolist() == [18] and second.block_table.tolist() == [list(range(18))]


if __name__ == "__main__":
    # Run by test_kernels_under_interpreter with TRITON_INTERPRET=1.
    failed = run_interpreter_cases()
    for failure in failed:
        print(failure, file=sys.stderr)
    sys.exit(1 if failed else 0)
