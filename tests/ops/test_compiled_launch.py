"""CompiledLaunch refuses kernels whose compiled form would depend on argument values (the
launch itself is covered on the GPU by the ops that use it, e.g. test_paged_kv_layout)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from anyattn.ops.compiled_launch import CompiledLaunch  # noqa: E402


def _kernel(do_not_specialize=("n",), do_not_specialize_on_alignment=("x_ptr",)):
    def copy(x_ptr, n, TILE: tl.constexpr):
        offs = tl.arange(0, TILE)
        tl.store(x_ptr + offs, offs, mask=offs < n)

    return triton.jit(
        do_not_specialize=list(do_not_specialize),
        do_not_specialize_on_alignment=list(do_not_specialize_on_alignment),
    )(copy)


def test_a_kernel_that_specialises_on_nothing_is_accepted() -> None:
    CompiledLaunch(_kernel(), pointers=("x_ptr",))


@pytest.mark.parametrize(
    ("kernel", "match"),
    [
        (_kernel(do_not_specialize=()), "specialises on n .*do_not_specialize\\)"),
        (
            _kernel(do_not_specialize_on_alignment=()),
            "specialises on x_ptr .*do_not_specialize_on_alignment",
        ),
    ],
)
def test_a_specialising_kernel_is_refused(kernel, match) -> None:
    with pytest.raises(ValueError, match=r"^CompiledLaunch: copy " + match):
        CompiledLaunch(kernel, pointers=("x_ptr",))


def test_constexprs_must_come_last() -> None:
    def early(TILE: tl.constexpr, x_ptr, n):
        tl.store(x_ptr + tl.arange(0, TILE), 0, mask=tl.arange(0, TILE) < n)

    kernel = triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["x_ptr"])(early)
    with pytest.raises(ValueError, match="constexpr parameters must come last"):
        CompiledLaunch(kernel, pointers=("x_ptr",))
