"""Run the conformance cases on a backend and judge them against the float64 oracle:
`check_backend`, `run_case` (`MLACase`s by `anyattn.testing.mla_check`) and their report.

The kit plays the model's attention layer, calling the impl's entry points directly as an
engine may: `do_kv_cache_update` when `forward_includes_kv_cache_update` is False (not for
encoder attention, which has no cache, nor cross attention steps without key/value), then
`forward` with `output` and `output_lse` filled with NaN.

A case fails when the backend raises, when its output (or LSE, natural log, with a float32
floor) is further from the oracle than the tolerance rule allows, or when an exact check breaks:
the cache after the step must hold exactly the kit's expected writes (nothing in the null block,
at padding slots, or from a KV-sharing layer), and output rows past `num_actual_tokens` must be
untouched.
"""

from __future__ import annotations

import math
import time
import traceback
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from anyattn.backend import AttentionBackend, AttentionImpl
from anyattn.testing.cases import Case, plan_cases
from anyattn.testing.mla_cases import MLACase
from anyattn.testing.mla_check import run_mla_case
from anyattn.testing.oracle import attention_oracle
from anyattn.testing.paged import PagedBatch, build_batch
from anyattn.testing.tolerance import (
    CaseResult,
    cache_problems,
    judge_against_oracle,
    judge_lse,
    num_changed,
)
from anyattn.types import ENCODER_TYPES

__all__ = ["ConformanceReport", "KitLayer", "check_backend", "run_case"]

# The `Case` fields `build_batch` takes under the same names.
_BATCH_FIELDS = (
    "num_heads", "num_kv_heads", "head_size", "block_size", "layout", "kv_cache_dtype",
    "attn_type", "causal", "sliding_window", "num_padding_tokens",
)  # fmt: skip


@dataclass
class KitLayer:
    """The `layer` argument the kit passes to `forward` / `do_kv_cache_update`.

    Attributes:
        layer_name: the layer's name (the KV-sharing target of another layer).
        k_scale, v_scale: float32 `[]` or `[num_kv_heads]`; 1.0 for non-fp8 caches.
    """

    layer_name: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor


@dataclass
class ConformanceReport:
    """Every check run on one backend for one device and dtype: `cases`, one `CaseResult` per
    check in run order, and `not_declared`, the features (or single cases) not run because the
    backend does not declare them, each with the reason (listed, never hidden). A report passes
    when at least one case ran and every case passed."""

    cases: list[CaseResult] = field(default_factory=list)
    not_declared: list[str] = field(default_factory=list)
    backend: str = ""
    device: str = ""
    dtype: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    def summary(self) -> str:
        """A plain-text table of the cases, then what was not declared."""
        title = f"conformance of {self.backend or '?'} on {self.device or '?'}, {self.dtype or '?'}"
        rows = [("case", "feature", "max error", "bound", "result", "time", "detail")]
        for c in self.cases:
            result = "ok" if c.passed else "FAIL"
            rows.append((c.name, c.feature, _number(c.max_error), _number(c.bound), result,
                         f"{c.seconds:.2f}s", c.detail))  # fmt: skip
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        lines = [title]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            lines.append("  ".join([*cells, row[-1]]).rstrip())
        passed = sum(c.passed for c in self.cases)
        lines.append(f"{passed}/{len(self.cases)} passed")
        if self.not_declared:
            lines.append("not declared (not run):")
            lines.extend(f"  - {item}" for item in self.not_declared)
        return "\n".join(lines)

    def assert_passed(self) -> None:
        """Raise AssertionError naming every failing case (usable directly in a pytest test).

        Raises:
            AssertionError: a case failed, or no case ran at all.
        """
        if not self.cases:
            raise AssertionError(
                f"no conformance case ran for {self.backend or 'the backend'}; "
                f"not declared: {'; '.join(self.not_declared) or 'nothing'}"
            )
        if failed := self.failures:
            names = ", ".join(c.name for c in failed)
            raise AssertionError(
                f"{len(failed)} of {len(self.cases)} conformance cases failed for "
                f"{self.backend or 'the backend'} ({self.dtype}): {names}\n{self.summary()}"
            )


def _number(value: float) -> str:
    return str(value) if math.isnan(value) or math.isinf(value) else f"{value:.3g}"


def _make_impls(
    backend: type[AttentionBackend], case: Case, sinks: torch.Tensor | None
) -> tuple[AttentionImpl, ...]:
    """The impls of layer.0 and, with KV sharing, of layer.1 (which reads layer.0's cache)."""
    args = (
        case.num_heads, case.head_size, case.scale, case.num_kv_heads, case.alibi_slopes(),
        case.sliding_window, case.kv_cache_dtype, case.logits_soft_cap, case.attn_type,
    )  # fmt: skip
    targets = (None, "layer.0") if case.kv_sharing else (None,)
    return tuple(backend.get_impl_cls()(*args, target, sinks) for target in targets)


def _step(
    backend: type[AttentionBackend], impl: AttentionImpl, layer_name: str, batch: PagedBatch,
    inputs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """What the model's attention layer does for one step; returns (output, output_lse)."""
    query, key, value = inputs
    layer = KitLayer(layer_name, batch.k_scale, batch.v_scale)
    md = batch.attn_metadata
    has_cache = batch.attn_type not in ENCODER_TYPES
    if has_cache and key is not None and not backend.forward_includes_kv_cache_update:
        slot_mapping = batch.common_attn_metadata.slot_mapping
        impl.do_kv_cache_update(layer, key, value, batch.kv_cache, slot_mapping, md)
    # NaN everywhere: rows the backend forgets to write show up as NaN errors.
    output = torch.full_like(query, math.nan)
    output_lse = None
    if want_lse:
        lse_shape = (query.shape[1], query.shape[0])
        output_lse = torch.full(lse_shape, math.nan, dtype=torch.float32, device=query.device)
    impl.forward(layer, query, key, value, batch.kv_cache, md, output, output_lse=output_lse)
    return output, output_lse


def _run(
    backend: type[AttentionBackend], case: Case | MLACase, device: torch.device, dtype: torch.dtype,
    seed: int,
) -> list[CaseResult]:  # fmt: skip
    if isinstance(case, MLACase):
        return run_mla_case(backend, case, device, dtype, seed)
    if case.expect_rejection:
        try:
            _make_impls(backend, case, None)
        except (ValueError, NotImplementedError) as e:
            detail = f"rejected with {type(e).__name__}"
            return [CaseResult(case.name, 0.0, 0.0, True, detail, case.feature)]
        detail = f"impl accepted head_size {case.head_size}, which the backend does not declare"
        return [CaseResult(case.name, 0.0, 0.0, False, detail, case.feature)]
    generator = torch.Generator().manual_seed(seed)
    sinks = None
    if case.use_sinks:
        sinks = (torch.randn(case.num_heads, generator=generator) + 1.0).to(device)
    # Impls first: the builder learns its layers before it builds, as in the engine.
    impls = _make_impls(backend, case, sinks)
    k_scale, v_scale = case.scales()
    batch = build_batch(
        backend, case.spec, dtype=dtype, device=device, k_scale=k_scale, v_scale=v_scale,
        layers={f"layer.{i}": impl.layer_params() for i, impl in enumerate(impls)}, seed=seed,
        **{name: getattr(case, name) for name in _BATCH_FIELDS},
    )  # fmt: skip
    inputs = (batch.query, batch.key, batch.value)
    if case.kv_sharing:
        _step(backend, impls[0], "layer.0", batch, inputs, case.check_lse)
        # layer.1 reads layer.0's cache; its own key/value differ and must never be written.
        inputs = tuple(  # type: ignore[assignment]
            torch.randn(x.shape, generator=generator).to(x.dtype).to(x.device) for x in inputs
        )
    impl = impls[-1]
    outcome = _step(backend, impl, f"layer.{len(impls) - 1}", batch, inputs, case.check_lse)
    return _judge(case, batch, impl, inputs[0], *outcome, sinks, dtype)


def _judge(
    case: Case, batch: PagedBatch, impl: AttentionImpl, query: torch.Tensor, output: torch.Tensor,
    output_lse: torch.Tensor | None, sinks: torch.Tensor | None, dtype: torch.dtype,
) -> list[CaseResult]:  # fmt: skip
    """Exact checks (cache contents, padding rows) and the oracle comparison."""
    n = batch.num_actual_tokens
    problems = cache_problems(batch.kv_cache, batch.expected_kv_cache)
    padding = output[n:]
    if num_changed(padding, torch.full_like(padding, math.nan)):
        problems.append("output padding rows were written")
    semantics = dict(
        scale=case.scale, causal=batch.causal, sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap, alibi_slopes=case.alibi_slopes(), sinks=sinks,
    )  # fmt: skip
    args = (query[:n], batch.oracle_key, batch.oracle_value, batch.spec.query_lens, batch.kv_lens)
    ref64, lse64 = attention_oracle(*args, **semantics)
    ref_lowp, lse_lowp = attention_oracle(*args, compute_dtype=dtype, **semantics)
    results = [
        judge_against_oracle(case.name, output[:n], ref64, ref_lowp, dtype, problems, case.feature)
    ]
    if output_lse is not None:
        base_on_e = getattr(impl, "lse_base_on_e", True)
        lse = output_lse[:, :n]
        results.append(judge_lse(case.name, lse, base_on_e, lse64, lse_lowp, case.feature))
    return results


def run_case(
    backend: type[AttentionBackend], case: Case | MLACase, device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> list[CaseResult]:  # fmt: skip
    """Run one planned case (`plan_cases`; `MLACase`s as `anyattn.testing.mla_check` says).

    Returns:
        The case's result, plus `<name>.lse` when the case checks the LSE. A backend exception
        becomes a failed result whose detail names the exception and where it arose.
    """
    start = time.perf_counter()
    # Seeds come from the case name, so a case sees the same data whatever else runs.
    case_seed = (zlib.crc32(case.name.encode()) + seed) % 2**31
    try:
        results = _run(backend, case, torch.device(device), dtype, case_seed)
    except Exception as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
        detail = f"raised {type(e).__name__} at {where}: {e}"
        results = [CaseResult(case.name, math.nan, math.nan, False, detail, case.feature)]
    seconds = time.perf_counter() - start
    return [replace(r, seconds=seconds) for r in results]


def check_backend(
    backend: type[AttentionBackend], device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32, features: Iterable[str] | None = None, quick: bool = False,
    seed: int = 0,
) -> ConformanceReport:  # fmt: skip
    """Run every case `backend` declares and judge it against the float64 oracle.

    Args:
        device: where to run (a type among the backend's `supported_device_types`).
        dtype: model dtype of query, key, value and output.
        features: names from `FEATURES` (`MLA_FEATURES` for an MLA backend); default: all.
        quick: small shapes (`QUICK_CATALOGUE`) for slow kernels (the Triton interpreter).
        seed: added to every case's own seed.

    Returns:
        A `ConformanceReport`; `report.assert_passed()` fails a pytest test naming the failing
        cases. Features the backend does not declare are listed in `report.not_declared`; a
        report where nothing ran does not pass.

    Raises:
        ValueError: an unknown feature name.
    """
    cases, not_declared = plan_cases(backend, device, dtype, features, quick)
    report = ConformanceReport(
        not_declared=not_declared, backend=backend.get_name(), device=str(torch.device(device)),
        dtype=str(dtype).removeprefix("torch."),
    )  # fmt: skip
    for case in cases:
        report.cases.extend(run_case(backend, case, device, dtype, seed))
    return report
