"""check_backend: the tolerance rule, the report, case planning, and broken backends caught."""

from __future__ import annotations

import math

import pytest
import torch

from anyattn.testing import (
    FEATURES,
    CaseResult,
    ConformanceReport,
    check_backend,
    error_bound,
    max_abs_error,
    plan_cases,
)
from anyattn.types import AttentionType

try:
    from anyattn.backends.torch_attn import TorchAttentionBackend, TorchAttentionImpl
except ImportError:  # the TORCH backend is written in parallel; the kit's own tests still run
    TorchAttentionBackend = TorchAttentionImpl = None

needs_torch_backend = pytest.mark.skipif(
    TorchAttentionBackend is None, reason="anyattn.backends.torch_attn is not importable"
)


# --- tolerance --------------------------------------------------------------------------------


def test_max_abs_error_flags_nan_and_unmatched_infinities() -> None:
    ref = torch.tensor([1.0, -math.inf], dtype=torch.float64)
    assert max_abs_error(torch.tensor([1.5, -math.inf]), ref) == 0.5
    assert math.isnan(max_abs_error(torch.tensor([math.nan, -math.inf]), ref))
    assert max_abs_error(torch.tensor([1.0, 3.0]), ref) == math.inf


def test_error_bound_is_twice_the_lowp_error_plus_the_dtype_floor() -> None:
    ref64 = torch.tensor([0.1, 1.0, -2.0], dtype=torch.float64)
    assert error_bound(ref64, ref64, torch.float64) < 1e-15  # float64: only its own rounding
    ref_lowp = ref64 + torch.tensor([0.0, 1e-3, 0.0], dtype=torch.float64)
    bound = error_bound(ref64, ref_lowp, torch.bfloat16)
    rounded = ref64.to(torch.bfloat16)
    floor = 2 * (((rounded + 0.3) - 0.3).double() - ref64).abs().max().item()
    assert bound == pytest.approx(2e-3 + floor)
    assert floor > 0 and error_bound(ref64, ref64, torch.float32) < floor


def test_error_bound_allows_float32_kernels_four_times_the_lowp_error() -> None:
    """float32: exp2 with the hardware's approximate ex2 (see tolerance.py's docstring)."""
    ref64 = torch.tensor([0.1, 1.0, -2.0], dtype=torch.float64)
    ref_lowp = ref64 + torch.tensor([0.0, 1e-6, 0.0], dtype=torch.float64)
    floor = error_bound(ref64, ref64, torch.float32)
    assert error_bound(ref64, ref_lowp, torch.float32) == pytest.approx(4e-6 + floor)


# --- report -----------------------------------------------------------------------------------


def _report(*passed: bool) -> ConformanceReport:
    cases = [CaseResult(f"case{i}", 0.1, 0.2 if ok else 0.05, ok) for i, ok in enumerate(passed)]
    return ConformanceReport(
        cases=cases, not_declared=["alibi: supports_alibi() is False"], backend="X", dtype="float32"
    )


def test_report_passes_only_when_every_case_passed() -> None:
    assert _report(True, True).passed
    _report(True, True).assert_passed()
    report = _report(True, False, False)
    assert not report.passed and [c.name for c in report.failures] == ["case1", "case2"]
    with pytest.raises(AssertionError, match=r"2 of 3 conformance cases failed .*case1, case2"):
        report.assert_passed()


def test_report_that_ran_nothing_does_not_pass() -> None:
    report = _report()
    assert not report.passed
    with pytest.raises(AssertionError, match=r"no conformance case ran.*supports_alibi"):
        report.assert_passed()


def test_summary_lists_cases_and_what_was_not_declared() -> None:
    text = _report(True, False).summary()
    assert "case0" in text and "FAIL" in text and "1/2 passed" in text
    assert "not declared" in text and "supports_alibi() is False" in text


# --- planning ---------------------------------------------------------------------------------


def test_plan_rejects_unknown_features(make_backend) -> None:
    with pytest.raises(ValueError, match="unknown feature"):
        plan_cases(make_backend(), features=["decode", "warp_speed"])


def test_backend_declaring_less_is_listed_not_excused(make_backend) -> None:
    plain = make_backend("PLAIN", head_sizes=(64,))
    cases, not_declared = plan_cases(plain)
    features = {c.feature for c in cases}
    assert {"decode", "prefill", "mixed", "gqa", "padding", "kv_sharing"} <= features
    listed = "\n".join(not_declared)
    for feature in (
        "sinks",
        "alibi",
        "soft_cap",
        "sliding_window",
        "lse",
        "cascade",
        "non_causal",
        "encoder",
        "encoder_decoder",
        "fp8",
        "per_head_scales",
    ):
        assert f"{feature}:" in listed
    assert "head_size 128 not declared" in listed
    # An undeclared head size must be refused by the constructor.
    assert any(c.expect_rejection for c in cases)


def test_combination_constraints_are_listed_per_case(make_backend) -> None:
    def no_head_size_128(config, device):
        return "no head_size 128" if config.head_size == 128 else None

    backend = make_backend("PICKY", combination=no_head_size_128)
    cases, not_declared = plan_cases(backend, features=["head_sizes"])
    assert [c.name for c in cases] == ["head_size80"]
    assert any("case head_size128: no head_size 128" in x for x in not_declared)


def test_nothing_runs_for_an_undeclared_dtype_or_device(make_backend) -> None:
    half_only = make_backend("HALF", dtypes=(torch.float16,), devices=("cuda",))
    report = check_backend(half_only, "cpu", torch.float32)
    assert report.cases == [] and not report.passed
    assert any("dtype" in x for x in report.not_declared)
    assert any("device cpu" in x for x in report.not_declared)


def test_every_feature_has_a_description() -> None:
    assert all(FEATURES.values())
    assert "cascade" in FEATURES and "encoder_decoder" in FEATURES


# --- running on real (and deliberately broken) backends --------------------------------------


def _backend_with_impl(name: str, impl_cls: type) -> type:
    return type(
        f"{name}Backend",
        (TorchAttentionBackend,),
        {
            "get_name": staticmethod(lambda: name),
            "get_impl_cls": staticmethod(lambda: impl_cls),
        },
    )


@needs_torch_backend
def test_reference_backend_passes_a_subset_quickly() -> None:
    report = check_backend(TorchAttentionBackend, features=["decode", "mixed", "lse"], quick=True)
    assert report.passed, report.summary()
    assert [c.name for c in report.cases] == [
        "single_decode",
        "many_decodes",
        "mixed",
        "mixed_lse",
        "mixed_lse.lse",
    ]
    assert report.not_declared == []


@needs_torch_backend
def test_wrong_scale_fails_every_case_and_names_them() -> None:
    class WrongScale(TorchAttentionImpl):
        def __init__(self, num_heads, head_size, scale, *args):
            super().__init__(num_heads, head_size, scale * 1.01, *args)

    report = check_backend(
        _backend_with_impl("WRONG_SCALE", WrongScale), features=["decode", "mixed"], quick=True
    )
    assert not report.passed
    assert {c.name for c in report.failures} == {"single_decode", "many_decodes", "mixed"}
    with pytest.raises(AssertionError, match=r"WRONG_SCALE.*single_decode, many_decodes, mixed"):
        report.assert_passed()


@needs_torch_backend
def test_ignored_sliding_window_fails_only_the_window_cases() -> None:
    class NoWindow(TorchAttentionImpl):
        def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi, window, *args):
            super().__init__(num_heads, head_size, scale, num_kv_heads, alibi, None, *args)

    report = check_backend(
        _backend_with_impl("NO_WINDOW", NoWindow), features=["mixed", "sliding_window"]
    )
    assert [c.name for c in report.failures] == ["window33", "window7"]
    assert all("error above bound" in c.detail for c in report.failures)


@needs_torch_backend
def test_writing_padding_rows_or_shared_caches_is_caught() -> None:
    class Sloppy(TorchAttentionImpl):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            output[attn_metadata.num_actual_tokens :] = 0
            return output

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping, md=None):
            from anyattn.ops.reshape_and_cache import reshape_and_cache

            # Ignores kv_sharing_target_layer_name: a shared layer overwrites its target's cache.
            reshape_and_cache(
                key,
                value,
                kv_cache,
                slot_mapping,
                self.kv_cache_dtype,
                layer.k_scale,
                layer.v_scale,
            )

    report = check_backend(
        _backend_with_impl("SLOPPY", Sloppy),
        features=["mixed", "padding", "kv_sharing"],
        quick=True,
    )
    failures = {c.name: c.detail for c in report.failures}
    assert set(failures) == {"padding", "kv_sharing"}
    assert "padding rows were written" in failures["padding"]
    assert "KV cache differs" in failures["kv_sharing"]


@needs_torch_backend
def test_lse_without_the_sink_term_is_caught() -> None:
    class KeysOnlyLse(TorchAttentionImpl):
        def __init__(self, *args):
            super().__init__(*args)
            self.sink_logits = args[10]

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            lse = kw.get("output_lse")
            if lse is not None and self.sink_logits is not None:
                full, sink = lse.double(), self.sink_logits.double().view(-1, 1)
                lse.copy_(torch.log(torch.exp(full) - torch.exp(sink)))
            return output

    report = check_backend(_backend_with_impl("KEYS_ONLY_LSE", KeysOnlyLse), features=["sinks"])
    assert [c.name for c in report.failures] == ["sinks.lse"]


@needs_torch_backend
def test_a_backend_that_raises_fails_with_the_exception_named() -> None:
    class Crashes(TorchAttentionImpl):
        def forward(self, *args, **kwargs):
            raise RuntimeError("kernel exploded")

    report = check_backend(_backend_with_impl("CRASHES", Crashes), features=["decode"], quick=True)
    assert len(report.failures) == 2
    assert all(math.isnan(c.max_error) for c in report.failures)
    assert "raised RuntimeError" in report.failures[0].detail
    assert "kernel exploded" in report.failures[0].detail


@needs_torch_backend
def test_results_are_deterministic() -> None:
    runs = [
        check_backend(TorchAttentionBackend, features=["mixed", "sinks"], quick=True)
        for _ in range(2)
    ]
    assert [c.max_error for c in runs[0].cases] == [c.max_error for c in runs[1].cases]


@needs_torch_backend
def test_encoder_types_run_only_when_declared() -> None:
    decoder_only = type(
        "DecoderOnly", (TorchAttentionBackend,), {"supported_attn_types": (AttentionType.DECODER,)}
    )
    cases, not_declared = plan_cases(decoder_only, features=["encoder", "encoder_decoder"])
    assert cases == []
    assert not_declared == [
        "encoder: attn_type encoder not in supported_attn_types",
        "encoder_decoder: attn_type encoder_decoder not in supported_attn_types",
    ]
