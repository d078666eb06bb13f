"""Host time of the engine's whole decode step at 1, 64 and 256 running requests.

Every request is past its prompt, so each timed step is a pure decode step of N requests. One
`LLM.step()` is timed with `time.perf_counter`:

- schedule: the scheduler's `schedule()`;
- prepare: from the start of `ModelRunner.execute` to the model's forward (step inputs and
  every metadata build; eager steps only, "nan" where the step replays a CUDA graph);
- launch: from the step's start to the return of `ModelRunner.execute`, i.e. to the launch of
  the model's last kernel (scheduler, step preparation, every metadata builder, the layer calls,
  the logits); the sampler's argmax follows;
- step: the whole `LLM.step()` (sampling, the scheduler's update, detokenisation included);
- steady: what a decode step costs when steps follow each other as in `generate`: `--steps`
  steps back to back with no synchronisation between them, the total divided by their
  number. With asynchronous scheduling (the default on CUDA) a step's host work overlaps the
  previous step's kernels, so only this column shows its gain; the columns above time one
  step launched on an idle device (and, with asynchronous scheduling, returning the previous
  step's tokens).

On CUDA the device is synchronised before each step starts and never inside it, so a step
finds an idle GPU and `launch` is host time (unless the step itself synchronises); `step`
includes waiting for the GPU. On the CPU kernels run synchronously, so every figure includes
the model's compute: the default CPU model (`tiny`: 16 layers of width 64) keeps that small.
Figures are medians over `--steps` steps after `--warmup` steps.

Run: `python benchmarks/engine_host.py [--backend NAME] [--batches 1 64 256] [--src CHECKOUT]`
(`--src` measures another checkout's `src/`; CUDA when present, `--device cpu` to force).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="attention backend (default: selected)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--model", default=None, help="preset (tiny, llama-1b) or a model path")
    parser.add_argument("--modes", nargs="+", default=None, choices=["graphs", "eager"])
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[64, 192], metavar=("LO", "HI"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--src", type=Path, default=None, help="checkout whose src/ to measure")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--async-scheduling", choices=["default", "on", "off"], default="default",
        help="the engine's async_scheduling (default: the engine's default, not passed)"
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="print cProfile's top N entries of "
        "the timed steps at the largest batch (the timings then include the profiler)"
    )  # fmt: skip
    parser.add_argument(
        "--device-profile", type=int, default=0, metavar="N", help="CUDA: print torch.profiler's "
        "top N kernels by device time over the timed steps at the smallest batch"
    )  # fmt: skip
    return parser.parse_args(argv)


class StepClock:
    """Wraps an LLM's scheduler and runner to stamp the end of `schedule` and `execute`."""

    def __init__(self, llm) -> None:
        self.marks: dict[str, float] = {}
        self.num_seqs = self.num_tokens = 0
        schedule, execute = llm.scheduler.schedule, llm.runner.execute
        model = llm.runner.model
        forward = model.forward

        def timed_schedule(*args, **kwargs):
            batch = schedule(*args, **kwargs)
            self.marks["schedule"] = time.perf_counter()
            self.num_seqs, self.num_tokens = len(batch.seqs), batch.num_tokens
            return batch

        def timed_execute(*args, **kwargs):
            self.marks["execute"] = time.perf_counter()
            self.marks["forward"] = float("nan")
            out = execute(*args, **kwargs)
            self.marks["launch"] = time.perf_counter()
            return out

        def timed_forward(*args, **kwargs):
            self.marks["forward"] = time.perf_counter()
            return forward(*args, **kwargs)

        llm.scheduler.schedule = timed_schedule
        model.forward = timed_forward
        llm.runner.execute = timed_execute


def _fill(llm, num_reqs: int, lengths: list[int], max_tokens: int, vocab: int) -> list[int]:
    """Queue `num_reqs` requests and step until each is past its prompt (all decoding)."""
    import numpy as np

    from anyattn.engine.sampling_params import SamplingParams

    rng = np.random.default_rng(num_reqs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [
        llm.add_request(rng.integers(2, vocab, size=length).tolist(), params)
        for length in lengths[:num_reqs]
    ]
    running = llm.scheduler.running
    while len(running) < num_reqs or any(s.num_tokens - s.num_computed_tokens > 1 for s in running):
        llm.step()
    return ids


def _measure(llm, clock: StepClock, num_reqs: int, args, sync) -> dict[str, float]:
    import torch

    times: dict[str, list[float]] = {"schedule": [], "prepare": [], "launch": [], "step": []}
    profiler = device_profiler = None
    if args.profile and num_reqs == max(args.batches):
        import cProfile

        profiler = cProfile.Profile()
    if args.device_profile and num_reqs == min(args.batches) and torch.cuda.is_available():
        device_profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        )
    for i in range(args.warmup + args.steps):
        sync()
        if profiler is not None and i >= args.warmup:
            profiler.enable()
        if device_profiler is not None and i == args.warmup:
            device_profiler.start()
        start = time.perf_counter()
        llm.step()
        end = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        assert clock.num_seqs == clock.num_tokens == num_reqs, "not a pure decode step"
        if i >= args.warmup:
            times["schedule"].append(clock.marks["schedule"] - start)
            times["prepare"].append(clock.marks["forward"] - clock.marks["execute"])
            times["launch"].append(clock.marks["launch"] - start)
            times["step"].append(end - start)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    sync()
    steady = (time.perf_counter() - start) / args.steps
    if device_profiler is not None:
        sync()
        device_profiler.stop()
        _print_device_profile(device_profiler, args.steps, args.device_profile, num_reqs)
    if profiler is not None:
        import pstats

        print(f"cProfile of {args.steps} decode steps of {num_reqs} requests (tottime):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    figures = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    return {**figures, "steady": steady * 1e3}


def _print_device_profile(profiler, steps: int, top: int, num_reqs: int) -> None:
    """Kernels and copies by device time per step (a CUDA graph's kernels are listed one by one).
    Only device events count: an operator's own row would repeat the time of its kernels."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    events = [
        e for e in profiler.key_averages() if e.device_type == cuda and e.self_device_time_total > 0
    ]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / steps
    print(f"device time per decode step of {num_reqs} requests: {total / 1e3:.3f} ms "
          f"({sum(e.count for e in events) // steps} kernels and copies per step)")  # fmt: skip
    for e in events[:top]:
        print(f"  {e.self_device_time_total / steps:9.1f} us  x{e.count // steps:<4} {e.key[:90]}")


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parse(argv)
    if args.src is not None:
        sys.path.insert(0, str(args.src.resolve() / "src"))
    import numpy as np
    import torch

    import anyattn
    from anyattn.engine.llm import LLM

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = args.model or ("llama-1b" if device.type == "cuda" else "tiny")
    modes = args.modes or (["graphs", "eager"] if device.type == "cuda" else ["eager"])
    max_reqs = max(args.batches)
    lo, hi = args.prompt_len
    lengths = np.random.default_rng(0).integers(lo, hi + 1, size=max_reqs).tolist()
    max_tokens = 2 * (args.warmup + 2 * args.steps) + 8
    max_model_len = hi + max_tokens + 16

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # passed only when asked, so that a `--src` checkout without the argument still runs
    extra = {}
    if args.async_scheduling != "default":
        extra["async_scheduling"] = args.async_scheduling == "on"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(model)
        if not path.exists():
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from engine_model import save_random_llama

            path = Path(tmp) / model
            save_random_llama(path, model, dtype)
        print(
            f"anyattn from {Path(anyattn.__file__).parent}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {device}, {dtype}, model {model}, "
            f"async_scheduling {args.async_scheduling}"
        )
        print(f"{'mode':>6} {'backend':>14} {'reqs':>5} {'schedule ms':>12} {'prepare ms':>11} "
              f"{'launch ms':>10} {'step ms':>8} {'steady ms':>10}")  # fmt: skip
        for mode in modes:
            llm = LLM(
                path,
                backend=args.backend,
                dtype=dtype,
                device=device,
                block_size=16,
                kv_cache_memory="8GiB" if device.type == "cuda" else "1GiB",
                max_num_seqs=max_reqs,
                max_num_batched_tokens=max(4096, hi),
                max_model_len=max_model_len,
                enforce_eager=mode == "eager",
                **extra,
            )
            clock = StepClock(llm)
            backend = ",".join(llm.backend_names)
            vocab = llm.model_config.vocab_size
            for num_reqs in args.batches:
                ids = _fill(llm, num_reqs, lengths, max_tokens, vocab)
                figures = _measure(llm, clock, num_reqs, args, sync)
                for request_id in ids:
                    llm.abort_request(request_id)
                row = {"mode": mode, "backend": backend, "num_reqs": num_reqs, **figures}
                rows.append(row)
                print(
                    f"{mode:>6} {backend:>14} {num_reqs:>5} {figures['schedule']:>12.3f} "
                    f"{figures['prepare']:>11.3f} "
                    f"{figures['launch']:>10.3f} {figures['step']:>8.3f} "
                    f"{figures['steady']:>10.3f}",
                    flush=True,
                )
            del llm
    if args.json is not None:
        args.json.write_text(json.dumps({"device": str(device), "model": model, "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
