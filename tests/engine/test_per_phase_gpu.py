"""On a GPU (`gpu`): a pair with CUDA graphs. Decodes replay TRITON's graphs, prefills (and the
prefill rows of mixed steps) run eagerly on FLASH_ATTN or FLASHINFER when one can run the
layer here, else TORCH; the greedy tokens equal the single TRITON run's (with graphs), the
graph plan counts the decode backend only, and the eager steps ran both parts."""

from __future__ import annotations

import pytest
import torch

import anyattn.engine.model_runner as model_runner
from anyattn.config import AttentionSelectorConfig
from anyattn.engine.sampling_params import SamplingParams
from anyattn.registry import get_backend_class
from anyattn.types import DeviceInfo


def _prefill_backend(config: AttentionSelectorConfig) -> str:
    """FLASH_ATTN or FLASHINFER when one is installed and takes `config` on this GPU, else
    TORCH."""
    device = DeviceInfo.current("cuda")
    for name in ("FLASH_ATTN", "FLASHINFER"):
        cls = get_backend_class(name)
        if cls.get_unavailable_reason() is None and not cls.validate_configuration(config, device):
            return name
    return "TORCH"


@pytest.mark.gpu
def test_a_pair_replays_decode_graphs_and_gives_the_single_backend_tokens(
    tiny_llm, monkeypatch
) -> None:
    if get_backend_class("TRITON").get_unavailable_reason():
        pytest.skip(
            f"TRITON cannot run here: {get_backend_class('TRITON').get_unavailable_reason()}"
        )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # prompts of 3 to 40 tokens under a 16-token budget: chunked prefills share steps with
    # decodes (4 such steps); then 11 pure decode steps, replayed from graphs
    prompts = [[5, 9, 17, 33, 2], [12, 13, 14], list(range(40, 80)), [7] * 21]
    kwargs = dict(device="cuda", dtype=torch.float16, block_size=16, max_num_batched_tokens=16)
    single, _ = tiny_llm("llama_h64", backend="TRITON", **kwargs)
    prefill = _prefill_backend(next(iter(single.model.attention_layers())).config)
    pair, _ = tiny_llm("llama_h64", backend=("TRITON", prefill), **kwargs)
    group = pair.runner.groups[0]
    assert group.prefill_backend is get_backend_class(prefill)
    assert group.describe() == f"TRITON (decode) + {prefill} (prefill)"
    assert pair.runner.cuda_graphs is not None, pair.runner.cuda_graph_plan.message
    message = pair.runner.cuda_graph_plan.message
    assert "TRITON supports" in message and f"{prefill} supports" not in message, message
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    parts: list[tuple[bool, bool]] = []  # per eager step: (has a decode part, has a prefill part)
    build = model_runner.build_by_phase

    def recording_build(group, common, threshold, cascade_len):
        built, prefix = build(group, common, threshold, cascade_len)
        parts.append((built.decode is not None, built.prefill is not None))
        return built, prefix

    monkeypatch.setattr(model_runner, "build_by_phase", recording_build)
    got = [o.outputs[0].token_ids for o in pair.generate(prompts, params)]
    assert pair.runner.cuda_graphs.num_replays >= 8  # the decode steps after the prefills
    assert (True, True) in parts and (False, True) in parts, parts  # mixed and prefill steps
    assert got == expected, f"decode TRITON, prefill {prefill}"
