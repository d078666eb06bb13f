"""Launching a small Triton kernel every step for a few microseconds of host time.

`kernel[grid](*args)` binds the arguments, works out their specialisation (pointer alignment,
integers equal to 1 or divisible by 16) and hashes it into a cache key, in Python, on every
call: on the H200 machine's host about three times the launch itself. A builder that launches
one kernel per step pays that in its whole budget. `CompiledLaunch` pays it once per
configuration: the first call goes through Triton's JIT (which compiles, or loads from its
cache) and keeps the compiled kernel it returns; later calls launch that kernel directly, as
`CompiledKernel[grid]` does (with Triton 3.6's launcher, through the fields it reads).

That is only sound for a kernel whose compiled form cannot depend on the arguments' values:
every integer argument in `do_not_specialize`, every pointer argument in
`do_not_specialize_on_alignment`, the dtypes fixed by the caller's checks, and the integers
below 2**31 (Triton types larger ones int64). `CompiledLaunch` checks the flags when it is made;
the caller checks dtypes and ranges before each launch. Under `TRITON_INTERPRET=1` the JIT
returns no compiled kernel, and every call takes the JIT.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

try:
    from triton import knobs
    from triton.runtime.driver import driver
except ImportError:  # triton is an optional extra (nothing here runs without it)
    knobs = driver = None

# (torch's: the same as Triton's driver answers on CUDA, without its lazy proxy)
_current_device = torch.cuda.current_device if torch.cuda.is_available() else None

__all__ = ["CompiledLaunch"]


class CompiledLaunch:
    """A `@triton.jit` kernel launched through its compiled form after the first call.

    Args:
        kernel: the jitted function. Its constexpr parameters come last; each other parameter
            is named in its `do_not_specialize` (integers) or `do_not_specialize_on_alignment`
            (pointers).
        pointers: the names of its pointer parameters (the rest but the constexprs are
            integers).

    Raises:
        ValueError: a parameter the kernel would specialise on, or a constexpr before a
            runtime parameter.
    """

    def __init__(self, kernel: Any, pointers: tuple[str, ...]) -> None:
        params = _parameters(kernel)
        unknown = set(pointers) - {name for name, is_constexpr, _, _ in params if not is_constexpr}
        if unknown:
            raise ValueError(
                f"CompiledLaunch: pointers names no runtime parameter of {kernel.__name__} (got "
                f"{sorted(unknown)})."
            )
        constexprs = [name for name, is_constexpr, _, _ in params if is_constexpr]
        runtime = [p for p in params if not p[1]]
        if [p[0] for p in params[len(runtime) :]] != constexprs:
            raise ValueError(
                f"CompiledLaunch: {kernel.__name__}'s constexpr parameters must come last (got "
                f"{[p[0] for p in params]})."
            )
        for name, _, fixed_value, fixed_alignment in runtime:
            flag = "do_not_specialize_on_alignment" if name in pointers else "do_not_specialize"
            if not (fixed_alignment if name in pointers else fixed_value):
                raise ValueError(
                    f"CompiledLaunch: {kernel.__name__} specialises on {name} (expected it in "
                    f"{flag}): its compiled form would depend on the argument's value."
                )
        self._kernel = kernel
        self._constexprs = constexprs
        self._compiled: dict[tuple[Any, ...], Any] = {}

    def __call__(self, grid: tuple[int, int, int], *args: Any, **options: Any) -> None:
        """Launch on `grid` with the runtime `args` (in parameter order) on the current CUDA
        device and stream, as Triton's JIT does; `options` holds every constexpr by name and
        Triton's launch options (`num_warps`, ...), the same at every call for one compiled
        kernel."""
        # (the current device: the one Triton compiles for, loads into and launches on)
        device = _current_device() if _current_device is not None else None
        launch = self._compiled.get((device, *options.items()))
        if launch is not None:
            launch(grid, *args)
            return
        compiled = self._kernel[grid](*args, **options)
        # (None under the interpreter; a CompiledKernel otherwise, once compiled)
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            constexprs = tuple(options[name] for name in self._constexprs)
            self._compiled[(device, *options.items())] = _Launcher(compiled, device, constexprs)

    def bound(self, **options: Any) -> _Launcher | None:
        """The kept compiled kernel of `options` on the current device, as a launch
        `bound(grid, *args)` (None before a call with these options compiled it there).

        For a caller that launches one configuration every step: a bound launch skips the
        device and options lookup, and takes each pointer argument as a tensor or as its raw
        device address (an int, which Triton's launcher passes on without the method call and
        driver query a tensor costs it). The caller checks what the JIT would have: the
        dtypes, and that every pointer is on `bound.device`, the current device."""
        device = _current_device() if _current_device is not None else None
        return self._compiled.get((device, *options.items()))


class _Launcher:
    """One compiled kernel's launch on one device: what `CompiledKernel[grid](*args)` does
    (Triton 3.6), less its per-call closure and launch-metadata dictionary, which only launch
    hooks (profilers) read (with a hook installed, that path itself), and, for a kernel that
    needs no scratch memory, less the Python wrapper of Triton's C launcher (`CudaLauncher`,
    which would only allocate that scratch)."""

    def __init__(self, compiled: Any, device: int | None, constexprs: tuple[Any, ...]) -> None:
        self.device = device
        self._compiled = compiled
        self._constexprs = constexprs
        self._function = compiled.function
        self._metadata = compiled.packed_metadata
        self._stream = driver.active.get_current_stream
        self._hooks = knobs.runtime
        run = compiled.run  # (the loaded module's launcher, after the first launch)
        self._run = run
        self._c_launch = None
        fields = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size",
                  "profile_scratch_size")  # fmt: skip
        if all(hasattr(run, name) for name in fields) and not (
            run.global_scratch_size or run.profile_scratch_size
        ):
            self._c_launch = run.launch
            self._grid_flags = (run.launch_cooperative_grid, run.launch_pdl)

    def __call__(self, grid: tuple[int, int, int], *args: Any) -> None:
        hooks = self._hooks
        if hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
            self._compiled[grid](*args, *self._constexprs)
            return
        stream = self._stream(self.device)
        if self._c_launch is not None:
            # (CudaLauncher's own call: grid, stream, function, its two flags, no scratch, then
            # the kernel metadata, no launch metadata or hooks, and the arguments)
            self._c_launch(*grid, stream, self._function, *self._grid_flags, None, None,
                           self._metadata, None, None, None, *args, *self._constexprs)  # fmt: skip
            return
        self._run(*grid, stream, self._function, self._metadata, None, None, None, *args,
                  *self._constexprs)  # fmt: skip


def _parameters(kernel: Any) -> list[tuple[str, bool, bool, bool]]:
    """(name, is constexpr, in do_not_specialize, in do_not_specialize_on_alignment) of each
    parameter of a jitted kernel, or of the interpreter's stand-in for one."""
    if hasattr(kernel, "params"):  # a JITFunction
        return [
            (p.name, p.is_constexpr, p.do_not_specialize, p.do_not_specialize_on_alignment)
            for p in kernel.params
        ]
    # (TRITON_INTERPRET=1: the function and the options given to triton.jit)
    options = getattr(kernel, "kwargs", {})
    values = set(options.get("do_not_specialize") or ())
    alignments = set(options.get("do_not_specialize_on_alignment") or ())
    return [
        (p.name, "constexpr" in str(p.annotation), p.name in values, p.name in alignments)
        for p in inspect.signature(kernel.fn).parameters.values()
    ]
