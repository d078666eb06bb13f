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


class FakeCompiled:
    """What CompiledLaunch reads of Triton's CompiledKernel: the launcher and its handles."""

    packed_metadata = "metadata"
    function = "function"

    def __init__(self, launches: list) -> None:
        self.run = lambda *args: launches.append(("direct", args))


class FakeKernel:
    """A jitted function as CompiledLaunch sees it: parameters, and `kernel[grid](...)`."""

    __name__ = "fake"

    def __init__(self) -> None:
        param = lambda name, constexpr=False: type("P", (), dict(  # noqa: E731
            name=name, is_constexpr=constexpr, do_not_specialize=True,
            do_not_specialize_on_alignment=True))  # fmt: skip
        self.params = [param("x_ptr"), param("n"), param("TILE", constexpr=True)]
        self.jit_calls: list = []
        self.launches: list = []

    def __getitem__(self, grid):
        def call(*args, **options):
            self.jit_calls.append((grid, args, options))
            return FakeCompiled(self.launches)

        return call


def test_the_compiled_kernel_is_kept_per_options(monkeypatch) -> None:
    """The first call of a set of options goes through the JIT; the next ones launch the kept
    compiled kernel on the current stream, with the constexprs appended in parameter order."""
    import types

    from anyattn.ops import compiled_launch

    stream = types.SimpleNamespace(active=types.SimpleNamespace(get_current_stream=lambda d: 7))
    monkeypatch.setattr(compiled_launch, "driver", stream)
    monkeypatch.setattr(compiled_launch, "_current_device", lambda: 0)
    kernel = FakeKernel()
    launch = CompiledLaunch(kernel, pointers=("x_ptr",))
    launch((4, 1, 1), "x", 3, TILE=64, num_warps=4)
    launch((2, 1, 1), "y", 5, TILE=64, num_warps=4)
    launch((2, 1, 1), "z", 5, TILE=128, num_warps=4)  # other options: the JIT again
    assert [call[0] for call in kernel.jit_calls] == [(4, 1, 1), (2, 1, 1)]
    assert kernel.jit_calls[1][2] == {"TILE": 128, "num_warps": 4}
    assert kernel.launches == [
        ("direct", (2, 1, 1, 7, "function", "metadata", None, None, None, "y", 5, 64))
    ]


def test_pointers_must_name_runtime_parameters() -> None:
    with pytest.raises(ValueError, match=r"pointers names no runtime parameter of copy"):
        CompiledLaunch(_kernel(), pointers=("x_ptr", "y_ptr"))


class FakeCudaLauncher:
    """Triton 3.6's `CudaLauncher` as `_Launcher` reads it: the C launch and its flags."""

    launch_cooperative_grid = False
    launch_pdl = True
    profile_scratch_size = 0

    def __init__(self, launches: list, global_scratch_size: int = 0) -> None:
        self.global_scratch_size = global_scratch_size
        self.launch = lambda *args: launches.append(("c", args))
        self._launches = launches

    def __call__(self, *args):
        self._launches.append(("wrapper", args))


def test_a_kernel_without_scratch_is_launched_through_the_c_launcher(monkeypatch) -> None:
    """`bound` gives the kept kernel of a set of options (None before it compiled); without
    scratch memory it calls Triton's C launch with CudaLauncher's own arguments, with
    scratch CudaLauncher itself (which allocates it)."""
    import types

    from anyattn.ops import compiled_launch

    stream = types.SimpleNamespace(active=types.SimpleNamespace(get_current_stream=lambda d: 7))
    monkeypatch.setattr(compiled_launch, "driver", stream)
    monkeypatch.setattr(compiled_launch, "_current_device", lambda: 0)
    for scratch, expected in ((0, "c"), (64, "wrapper")):
        kernel = FakeKernel()
        compiled = FakeCompiled(kernel.launches)
        compiled.run = FakeCudaLauncher(kernel.launches, global_scratch_size=scratch)
        launch = CompiledLaunch(kernel, pointers=("x_ptr",))
        assert launch.bound(TILE=64, num_warps=4) is None
        # (the JIT call returns `compiled`)
        monkeypatch.setattr(
            FakeKernel, "__getitem__", lambda self, grid, c=compiled: lambda *a, **o: c
        )
        launch((4, 1, 1), "x", 3, TILE=64, num_warps=4)
        bound = launch.bound(TILE=64, num_warps=4)
        assert bound is not None and bound.device == 0
        assert launch.bound(TILE=128, num_warps=4) is None
        bound((2, 1, 1), 1234, 5)  # a raw address for the pointer
        if expected == "c":
            want = (2, 1, 1, 7, "function", False, True, None, None, "metadata", None, None,
                    None, 1234, 5, 64)  # fmt: skip
        else:
            want = (2, 1, 1, 7, "function", "metadata", None, None, None, 1234, 5, 64)
        assert kernel.launches == [(expected, want)]
