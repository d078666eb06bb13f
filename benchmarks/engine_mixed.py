"""The mixed workload of `benchmarks/engine_gpu.py`: steps that mix decodes and chunked prefills.

A batch submitted at once is prefilled in its first few steps and then only decodes, so its
steps barely mix. Here more requests are submitted than may run at once (`requests` against
`max_num_seqs`), with prompt lengths and output lengths drawn per request (fixed seed): as
running requests finish, waiting ones are admitted, and their prompts are prefilled, in chunks
of the step's token budget (`max_num_batched_tokens`), in the same steps as the other requests'
decodes. The engine runs with prefix caching off, so every run computes every prompt. The step mix
(steps of decodes only, of prefills only, and mixed) is counted from the scheduler's batches
and reported with the row, so that a reader can see the steps were mixed.

Throughput: output tokens of all requests over the wall time of one `LLM.generate` call, after
a warm-up on another draw (a quarter of the requests) that compiles the step shapes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["MixedWorkload", "StepMix", "counting_steps", "mixed_requests", "time_mixed"]


@dataclass(frozen=True, slots=True)
class MixedWorkload:
    """Requests, engine limits and length ranges (inclusive) of the mixed workload."""

    requests: int = 128
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    prompt_len: tuple[int, int] = (256, 2048)
    new_tokens: tuple[int, int] = (16, 192)

    @property
    def max_model_len(self) -> int:
        return self.prompt_len[1] + self.new_tokens[1] + 16

    def describe(self) -> str:
        return (
            f"{self.requests} requests, at most {self.max_num_seqs} running, prompts "
            f"{self.prompt_len[0]}-{self.prompt_len[1]} tokens, outputs {self.new_tokens[0]}-"
            f"{self.new_tokens[1]}, {self.max_num_batched_tokens} tokens per step"
        )


def mixed_requests(workload: MixedWorkload, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The workload's `requests` prompts of random token ids and their output lengths (the same
    draw on every call)."""
    import numpy as np

    rng = np.random.default_rng(0)
    count = workload.requests
    lengths = rng.integers(workload.prompt_len[0], workload.prompt_len[1] + 1, size=count)
    outputs = rng.integers(workload.new_tokens[0], workload.new_tokens[1] + 1, size=count)
    prompts = [rng.integers(2, vocab, size=int(n)).tolist() for n in lengths]
    return prompts, [int(n) for n in outputs]


@dataclass
class StepMix:
    """Steps by kind: only one-token requests (decode), none (prefill), both (mixed)."""

    decode: int = 0
    prefill: int = 0
    mixed: int = 0

    def add(self, num_new_tokens: list[int]) -> None:
        has_decode = any(n == 1 for n in num_new_tokens)
        has_prefill = any(n > 1 for n in num_new_tokens)
        if has_decode and has_prefill:
            self.mixed += 1
        elif has_prefill:
            self.prefill += 1
        elif has_decode:
            self.decode += 1


@contextlib.contextmanager
def counting_steps(llm) -> Iterator[StepMix]:
    """Count the kinds of the steps `llm` runs meanwhile (its scheduler's batches)."""
    mix = StepMix()
    schedule = llm.scheduler.schedule

    def counted():
        batch = schedule()
        mix.add(batch.num_new_tokens)
        return batch

    llm.scheduler.schedule = counted
    try:
        yield mix
    finally:
        llm.scheduler.schedule = schedule


def _generate(llm, prompts: list[list[int]], new_tokens: list[int]) -> int:
    from anyattn.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in new_tokens]
    outputs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def time_mixed(
    llm, workload: MixedWorkload, vocab: int, repeats: int, sync: Callable[[], None]
) -> dict:
    """Run the workload once untimed on `llm` (made with prefix caching off), then time it
    `repeats` times on the same draw. Returns the row's measured fields.

    The untimed run is the whole draw: its steps have the shapes the timed runs will have, so
    every kernel variant they need (Triton and FA4 compile one per new shape class) is compiled
    before the clock starts; a shorter warm-up left compilations inside the timed run."""
    prompts, new_tokens = mixed_requests(workload, vocab)
    _generate(llm, prompts, new_tokens)
    seconds: list[float] = []
    mix = StepMix()
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        with counting_steps(llm) as counted:
            produced = _generate(llm, prompts, new_tokens)
        sync()
        seconds.append(time.perf_counter() - start)
        mix = counted
    assert produced == sum(new_tokens), f"{produced} tokens, expected {sum(new_tokens)}"
    return {
        "requests": len(prompts),
        "output_tokens": produced,
        "prompt_tokens": sum(map(len, prompts)),
        "all_seconds": seconds,
        "steps": {"decode": mix.decode, "mixed": mix.mixed, "prefill": mix.prefill},
    }
