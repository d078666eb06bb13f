"""What the op tests' case lists share: running every case of a list so that one run reports
all the failures (the Triton-interpreter script, a GPU test over the whole list), and the
script's exit, which `test_kernel_under_interpreter` reads from a subprocess run with
`TRITON_INTERPRET=1` (see the `triton_interpreter` fixture)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import NoReturn, TypeVar

Case = TypeVar("Case")


def failures_of(
    cases: Iterable[Case], check: Callable[[Case], object], case_id: Callable[[Case], str]
) -> list[str]:
    """`check(case)` for every case; `"<case_id>: <error type>: <message>"` for each that
    raised (every exception: the script reports them all rather than stop at the first)."""
    failed = []
    for case in cases:
        try:
            check(case)
        except Exception as error:
            failed.append(f"{case_id(case)}: {type(error).__name__}: {error}")
    return failed


def exit_with_report(failures: list[str], num_cases: int) -> NoReturn:
    """The script's end: each failure on stderr, `ran N cases, F failed` on stdout (what the
    interpreter tests assert), exit status 1 where any failed."""
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"ran {num_cases} cases, {len(failures)} failed")
    sys.exit(1 if failures else 0)
