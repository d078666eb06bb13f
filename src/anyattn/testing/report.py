"""What `check_backend` returns: one result per check, and what the backend did not declare."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["CaseResult", "ConformanceReport"]


@dataclass(frozen=True, slots=True)
class CaseResult:
    """The outcome of one check.

    Attributes:
        name: the case ("mixed", "fp8/fp8_e5m2", ...); LSE checks end in ".lse".
        max_error: `max|out - ref64|` (NaN when the backend raised or wrote NaN; 0 for checks
            that are exact, such as a constructor rejecting an undeclared head size).
        bound: the tolerance the error must not exceed.
        passed: the error is within bound and every exact check (cache contents, padding rows
            untouched, null block unused) held.
        detail: why it failed, or what was run.
        feature: the feature name the case belongs to (see `anyattn.testing.FEATURES`).
        seconds: wall time of the case.
    """

    name: str
    max_error: float
    bound: float
    passed: bool
    detail: str = ""
    feature: str = ""
    seconds: float = 0.0


@dataclass
class ConformanceReport:
    """Every check run on one backend for one device and dtype.

    A report passes when at least one case ran and every case passed; what the backend did not
    declare is listed in `not_declared` (it is not run, and it is not hidden).

    Attributes:
        cases: one `CaseResult` per check, in run order.
        not_declared: features (or single cases) skipped because the backend does not declare
            them, each with the reason.
        backend, device, dtype: what was checked.
    """

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
        failed = self.failures
        if failed:
            names = ", ".join(c.name for c in failed)
            raise AssertionError(
                f"{len(failed)} of {len(self.cases)} conformance cases failed for "
                f"{self.backend or 'the backend'} ({self.dtype}): {names}\n{self.summary()}"
            )


def _number(value: float) -> str:
    return str(value) if math.isnan(value) or math.isinf(value) else f"{value:.3g}"
