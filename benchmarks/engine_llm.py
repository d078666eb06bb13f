"""anyattn's engine as a contender of `benchmarks/engine_gpu.py`: one `LLM` per contender and
mode (a backend name, "fastest" or a pair "DECODE,PREFILL"), timed on the batch workload (the
first B prompts submitted at once, every batch on one LLM) or on the mixed workload
(`engine_mixed.py`, its own LLM). Each contender's set-up seconds (a "fastest" measurement
included), what its layers run (`KVCacheGroup.describe`), its backend notes and, for "fastest",
each measurement's choices and summed times per phase are kept.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from pathlib import Path

from engine_mixed import time_mixed

__all__ = [
    "engine_tokens", "free", "label", "make_llm", "make_row", "set_up", "sync", "time_anyattn",
    "time_anyattn_mixed", "timed",
]  # fmt: skip


def free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_llm(
    folder: Path, backend: str, mode: str, device, dtype, max_reqs: int, max_len: int,
    max_tokens: int = 8192, prefix_caching: bool = True,
):  # fmt: skip
    from anyattn.engine.llm import LLM

    return LLM(
        folder,
        backend=backend,
        dtype=dtype,
        device=device,
        block_size=16,
        kv_cache_memory="16GiB" if device.type == "cuda" else "256MiB",
        max_num_seqs=max_reqs,
        max_num_batched_tokens=max_tokens,
        max_model_len=max_len,
        enforce_eager=mode == "eager",
        enable_prefix_caching=prefix_caching,
    )


def label(backend: str) -> str:
    """How rows name an anyattn contender: a backend, "fastest", or "DECODE+PREFILL"."""
    return "+".join(p.strip() for p in backend.split(","))


def _summary(measured) -> dict:
    """What a "fastest" measurement chose and the summed time of each backend per phase (us):
    the figures that say why the engine runs a pair or one backend."""
    return {
        "choices": {phase: c.backend for phase, c in measured.choices.items()},
        "totals_us": {phase: dict(c.totals_us) for phase, c in measured.choices.items()},
        "rejected": dict(measured.rejected),
        "engine": measured.pair_note(),
        "layers_per_step": measured.layers_per_step,
        "build_us": {
            b: {step: t.build_us for step, t in per_step.items()}
            for b, per_step in measured.timings.items()
        },
        "check_s": measured.check_s,
        "timing_s": measured.timing_s,
        "from_cache": measured.from_cache,
    }


@contextlib.contextmanager
def _kept_measurements() -> Iterator[list]:
    """The measurements `LLM(backend="fastest")` makes meanwhile (it calls `measure_backends`
    through `anyattn.engine.backend_choice`)."""
    import anyattn.engine.backend_choice as backend_choice

    kept: list = []
    measure = backend_choice.measure_backends

    def keep(*args, **kwargs):
        kept.append(measure(*args, **kwargs))
        return kept[-1]

    backend_choice.measure_backends = keep
    try:
        yield kept
    finally:
        backend_choice.measure_backends = measure


def set_up(make, device) -> tuple[object, dict]:
    """An LLM and what it runs: set-up seconds (a "fastest" measurement included), its layers'
    groups, its backend notes and the summary of each measurement it made."""
    sync(device)
    start = time.perf_counter()
    with _kept_measurements() as measured:
        llm = make()
    sync(device)
    info = {
        "setup_s": time.perf_counter() - start,
        "runs": " / ".join(g.describe() for g in llm.runner.groups),
        "notes": list(llm.backend_notes),
        "measurements": [_summary(m) for m in measured],
    }
    print(f"  set up in {info['setup_s']:.1f} s; runs {info['runs']}; {info['notes']}", flush=True)
    for summary in info["measurements"]:
        for phase, totals in summary["totals_us"].items():
            cells = ", ".join(
                f"{b} {us:.0f}" for b, us in sorted(totals.items(), key=lambda x: x[1])
            )
            print(f"  measured {phase}: {cells} us (chose {summary['choices'][phase]})", flush=True)
        builds = ", ".join(
            f"{b} {max(per_step.values()):.0f}" for b, per_step in summary["build_us"].items()
        )
        print(f"  build per step (largest, us): {builds}; over {summary['layers_per_step']} "
              f"layers; checks {summary['check_s']:.1f} s, timing {summary['timing_s']:.1f} s",
              flush=True)  # fmt: skip
    return llm, info


def engine_tokens(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from anyattn.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def timed(run, device, repeats: int) -> list[float]:
    """Wall seconds of each of `repeats` runs."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def time_anyattn(folder, backend, mode, device, dtype, prompt_sets, new_tokens, repeats):
    """Rows of one contender and mode over every batch (one LLM serves them all), and what the
    LLM runs."""
    max_reqs = max(map(len, prompt_sets))
    max_len = max(len(p) for ps in prompt_sets for p in ps) + new_tokens + 16
    llm, info = set_up(
        lambda: make_llm(folder, backend, mode, device, dtype, max_reqs, max_len), device
    )
    rows = []
    for prompts in prompt_sets:
        # Twice: the timed run's prefills hit the prefix cache, as the second warm-up's do, so
        # the kernels of prefills over cached context are compiled before the clock starts.
        for _ in range(2):
            engine_tokens(llm, prompts, 2)
        times = timed(lambda p=prompts, e=llm: engine_tokens(e, p, new_tokens), device, repeats)
        contender = f"anyattn {label(backend)} {mode}"
        extra = {"backend": backend, "mode": mode, "workload": "batch", "runs": info["runs"]}
        rows.append(
            make_row(contender, len(prompts), min(times), new_tokens, all_seconds=times, **extra)
        )
    del llm
    free()
    return rows, info


def time_anyattn_mixed(folder, backend, mode, device, dtype, workload, vocab, repeats):
    """The mixed workload's row of one contender and mode (its own LLM), and what it runs."""
    llm, info = set_up(
        lambda: make_llm(
            folder, backend, mode, device, dtype, workload.max_num_seqs, workload.max_model_len,
            workload.max_num_batched_tokens, prefix_caching=False,
        ),
        device,
    )  # fmt: skip
    measured = time_mixed(llm, workload, vocab, repeats, lambda: sync(device))
    seconds = min(measured["all_seconds"])
    row = {
        "contender": f"anyattn {label(backend)} {mode}", "batch": workload.requests,
        "seconds": seconds, "tokens_per_s": measured["output_tokens"] / seconds,
        "ms_per_token": seconds / measured["output_tokens"] * 1e3, "backend": backend,
        "mode": mode, "workload": "mixed", "runs": info["runs"], **measured,
    }  # fmt: skip
    steps = measured["steps"]
    print(
        f"{row['contender']:>34} mixed {row['tokens_per_s']:>10.1f} tokens/s, steps decode "
        f"{steps['decode']} mixed {steps['mixed']} prefill {steps['prefill']}",
        flush=True,
    )
    del llm
    free()
    return [row], info


def make_row(contender: str, batch: int, seconds: float, new_tokens: int, **extra) -> dict:
    row = {
        "contender": contender,
        "batch": batch,
        "seconds": seconds,
        "tokens_per_s": batch * new_tokens / seconds,
        "ms_per_token": seconds / new_tokens * 1e3,
        **extra,
    }
    print(
        f"{contender:>34} {batch:>5} {row['tokens_per_s']:>10.1f} {row['ms_per_token']:>9.2f}",
        flush=True,
    )
    return row
