"""On a GPU (`gpu`): a pair with CUDA graphs. Decodes replay TRITON's graphs, prefills (and the
prefill rows of mixed steps) run eagerly on FLASH_ATTN or FLASHINFER when one can run here,
else TORCH; the greedy tokens equal the single TRITON run's (with graphs)."""

from __future__ import annotations

import pytest
import torch

from anyattn.engine.sampling_params import SamplingParams
from anyattn.registry import get_backend_class


def _prefill_backend() -> str:
    """FLASH_ATTN or FLASHINFER when one is installed and runs on this GPU, else TORCH."""
    for name in ("FLASH_ATTN", "FLASHINFER"):
        if get_backend_class(name).get_unavailable_reason() is None:
            return name
    return "TORCH"


@pytest.mark.gpu
def test_a_pair_replays_decode_graphs_and_gives_the_single_backend_tokens(tiny_llm) -> None:
    if get_backend_class("TRITON").get_unavailable_reason():
        pytest.skip(
            f"TRITON cannot run here: {get_backend_class('TRITON').get_unavailable_reason()}"
        )
    prefill = _prefill_backend()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # prompts of 5 to 40 tokens under a 16-token budget: chunked prefills share steps with
    # decodes; then pure decode steps, replayed from graphs
    prompts = [[5, 9, 17, 33, 2], [12, 13, 14], list(range(40, 80)), [7] * 21]
    kwargs = dict(device="cuda", dtype=torch.float16, block_size=16, max_num_batched_tokens=16)
    single, _ = tiny_llm("llama_h64", backend="TRITON", **kwargs)
    pair, _ = tiny_llm("llama_h64", backend=("TRITON", prefill), **kwargs)
    group = pair.runner.groups[0]
    assert group.prefill_backend is get_backend_class(prefill)
    assert pair.runner.cuda_graphs is not None, pair.runner.cuda_graph_plan.message
    assert "TRITON supports" in pair.runner.cuda_graph_plan.message
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in pair.generate(prompts, params)]
    assert pair.runner.cuda_graphs.num_replays >= 8  # the decode steps after the prefills
    assert got == expected, f"decode TRITON, prefill {prefill}"
