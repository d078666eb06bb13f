"""The engine with decodes on one backend and prefills on another (TORCH and FLEX_ATTENTION
both run on the CPU): the same greedy tokens as each backend alone and as transformers, over
pure decode, pure prefill and mixed steps (decodes + chunked prefill) and under preemption;
K/V written once per layer and step; one cache per layer in the layout both take; pairs that
cannot share a cache refused; `backend="fastest"` taking a measured pair or saying why not."""

from __future__ import annotations

import pytest
import torch

import anyattn.engine.backend_choice as backend_choice
import anyattn.engine.model_runner as model_runner
import anyattn.ops.reshape_and_cache as cache_writer
from anyattn.engine.sampling_params import SamplingParams
from anyattn.measure import Phase, StepTiming
from anyattn.phase_metadata import PhaseSplitMetadata
from anyattn.registry import get_backend_class
from anyattn.selector import measure_backends

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 17, 33, 2, 80, 41, 7, 7, 150, 3], [99], [12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PAIR = ("TORCH", "FLEX_ATTENTION")


def _hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids.append(int(hf_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _record_steps(monkeypatch, llm):
    """Per executed eager step: its token count, which parts it had, and the rows each K/V
    write stored (every write of every layer)."""
    steps: list[tuple[int, bool, bool]] = []
    writes: list[int] = []
    build = model_runner.build_by_phase

    def recording_build(group, common, threshold, cascade_len):
        built, prefix = build(group, common, threshold, cascade_len)
        if group is llm.runner.groups[0]:
            steps.append(
                (common.num_actual_tokens, built.decode is not None, built.prefill is not None)
            )
        return built, prefix

    original_write = cache_writer.reshape_and_cache_unchecked

    def counting_write(key, *args):
        writes.append(key.shape[0])
        return original_write(key, *args)

    monkeypatch.setattr(model_runner, "build_by_phase", recording_build)
    monkeypatch.setattr(cache_writer, "reshape_and_cache_unchecked", counting_write)
    return steps, writes


@pytest.mark.parametrize("pair", [PAIR, PAIR[::-1]], ids=["torch+flex", "flex+torch"])
def test_pair_gives_the_tokens_of_each_backend_alone_and_of_transformers(
    tiny_llm, monkeypatch, pair
):
    # a budget of 7 tokens: prompts are chunked and decodes share steps with prefill chunks
    llm, hf_model = tiny_llm("llama", max_num_batched_tokens=7, backend=pair)
    group = llm.runner.groups[0]
    assert len(llm.runner.groups) == 1 and group.prefill_builder is not None
    assert (group.backend.get_name(), group.prefill_backend.get_name()) == pair
    assert group.describe() == f"{pair[0]} (decode) + {pair[1]} (prefill)"
    assert sorted(llm.backend_names) == sorted(pair)
    # one cache per layer, in the decode backend's preferred layout (both take it)
    layout = get_backend_class(pair[0]).supported_kv_cache_layouts()[0]
    assert group.layout == layout and group.kernel_block_size == 4
    assert len(llm.runner.kv_caches) == 3
    for cache in llm.runner.kv_caches.values():
        heads_outer = cache.stride(3) > cache.stride(2)  # [.., block_size, heads, ..] strides
        assert heads_outer == (layout == "HND")
    steps, writes = _record_steps(monkeypatch, llm)
    got = _tokens(llm, PROMPTS)
    pair_steps, pair_writes = list(steps), list(writes)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == _hf_greedy(hf_model, prompt, 8)
    for single in pair:
        alone, _ = tiny_llm("llama", max_num_batched_tokens=7, backend=single)
        assert alone.runner.groups[0].prefill_builder is None
        assert _tokens(alone, PROMPTS) == got
    kinds = {(has_decode, has_prefill) for _, has_decode, has_prefill in pair_steps}
    assert kinds == {(True, False), (False, True), (True, True)}  # decode, prefill, mixed
    # K/V written once per layer and step, the whole step at once
    assert pair_writes == [num_tokens for num_tokens, _, _ in pair_steps for _ in range(3)]


def test_pair_under_preemption_changes_no_output(tiny_llm):
    prompts = [[3 + i, 40 + i, 7, 9, 11, 60 + i, 2] * 2 for i in range(6)]
    relaxed, _ = tiny_llm("llama", backend="TORCH")
    expected = _tokens(
        relaxed, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    # a block: 4 tokens x 3 layers x 1 KV head x 16 x 4 bytes x 2 (K, V) = 1536 bytes; 14 blocks
    # hold about two of these 26-token sequences at a time
    pressed, _ = tiny_llm(
        "llama", backend="TORCH,FLEX_ATTENTION", kv_cache_memory=14 * 1536, max_num_seqs=6,
        max_num_batched_tokens=16,
    )  # fmt: skip
    assert pressed.runner.groups[0].prefill_backend is get_backend_class("FLEX_ATTENTION")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert _tokens(pressed, prompts, params) == expected
    assert pressed.scheduler.num_preemptions > 0


@pytest.mark.parametrize("backend", ["TORCH", "TORCH,FLEX_ATTENTION"])
def test_every_build_runs_under_inference_mode(tiny_llm, backend):
    # A builder's lazily made buffer is an inference tensor when first made under inference
    # mode (graph capture); updating it in place in a later build outside that mode fails, as
    # FlashInfer's planned wrappers did in a pair's mixed steps. So every build is in the mode.
    llm, _ = tiny_llm("llama", backend=backend, max_num_batched_tokens=7)
    group = llm.runner.groups[0]
    modes: list[bool] = []
    for builder in filter(None, (group.builder, group.prefill_builder)):
        build = builder.build

        def recording(*args, build=build):
            modes.append(torch.is_inference_mode_enabled())
            return build(*args)

        builder.build = recording
    _tokens(llm, PROMPTS)
    assert modes and all(modes), modes


def _split_kv_shape(cls, num_blocks, block_size, num_kv_heads, head_size, cache_dtype="auto"):
    return (2, num_blocks, block_size, num_kv_heads, head_size)  # K and V outermost


def test_a_pair_that_cannot_share_a_cache_is_refused(tiny_llm, make_backend, register):
    torch_backend = get_backend_class("TORCH")
    fake = make_backend(
        "SPLIT_KV",
        supported_kv_cache_layouts=torch_backend.supported_kv_cache_layouts,
        get_kv_cache_stride_order=torch_backend.get_kv_cache_stride_order,
        get_kv_cache_shape=classmethod(_split_kv_shape),
    )
    register("SPLIT_KV", fake)
    with pytest.raises(ValueError) as refused:
        tiny_llm("llama", backend=("TORCH", "SPLIT_KV"))
    assert str(refused.value) == (
        "Attention(model.layers.0.self_attn.attn): decodes on TORCH and prefills on SPLIT_KV "
        "need one KV cache: KV cache shared by TORCH and SPLIT_KV: the logical cache shapes "
        "differ for 8 blocks of 4 tokens, num_kv_heads 1, head_size 16 (TORCH: (8, 2, 4, 1, 16) "
        "in order (0, 1, 3, 2, 4); SPLIT_KV: (2, 8, 4, 1, 16) in order (0, 1, 3, 2, 4)). Use "
        "one backend for both, or a pair that shares a cache."
    )


@pytest.mark.parametrize(
    ("backend", "error", "match"),
    [
        (("TORCH",), ValueError, r"a backend pair is two backend names or classes"),
        ("TORCH,FLEX_ATTENTION,TRITON", ValueError, r"a backend pair is two"),
        (("TORCH", "fastest"), ValueError, r"'fastest' chooses both phases itself"),
        (("TORCH", 3), ValueError, r"a backend pair is two backend names or classes"),
        (3.5, TypeError, r"LLM: backend must be a backend name, .* \(got float\)"),
    ],
)
def test_bad_backend_requests_are_refused_before_loading(backend, error, match, tmp_path):
    from anyattn.engine.llm import LLM

    with pytest.raises(error, match=match):
        LLM(tmp_path / "missing", backend=backend, device="cpu")


def _timer_where(winners: dict[str, str]):
    """Fake timings: each phase's winner takes 10 us a step, every other backend 100 us."""

    def timer(backend, step):
        base = 10.0 if winners[step.phase.value] == backend.get_name() else 100.0
        return StepTiming(step.name, (base, base, base), first_call_us=base, build_us=1.0)

    return timer


def _measure_with(monkeypatch, winners) -> list[dict]:
    """Fake timings for the engine's measurement; returns the list of each call's arguments."""
    calls: list[dict] = []

    def measure(config, limits, device, **kwargs):
        calls.append(dict(kwargs))
        kwargs |= {"timer": _timer_where(winners), "checker": lambda backend: None}
        return measure_backends(config, limits, device, **kwargs)

    monkeypatch.setattr(backend_choice, "measure_backends", measure)
    return calls


def test_fastest_runs_a_measured_pair(tiny_llm, monkeypatch):
    # FLEX_ATTENTION's mixed steps are fast too: the pair, counting a mixed step as both
    # backends' step, clearly beats TORCH alone.
    winners = {"decode": "TORCH", "prefill": "FLEX_ATTENTION", "mixed": "FLEX_ATTENTION"}
    calls = _measure_with(monkeypatch, winners)
    llm, hf_model = tiny_llm("llama", backend="fastest", max_num_batched_tokens=7)
    # One measurement for the one layer config, its build shared by all the model's layers.
    num_layers = len(list(llm.runner.model.attention_layers()))
    assert [c["layers_per_step"] for c in calls] == [num_layers] and num_layers > 1
    group = llm.runner.groups[0]
    assert (group.backend.get_name(), group.prefill_backend.get_name()) == PAIR
    assert (
        len(llm.backend_notes) == 1
        and "per-phase pair used: decodes on TORCH" in (llm.backend_notes[0])
    )
    for prompt, tokens in zip(PROMPTS, _tokens(llm, PROMPTS), strict=True):
        assert tokens == _hf_greedy(hf_model, prompt, 8)


def test_fastest_falls_back_to_the_overall_choice_and_says_why(
    tiny_llm, monkeypatch, make_backend, register
):
    torch_backend = get_backend_class("TORCH")
    fake = make_backend(
        "SPLIT_KV",
        priority={"cpu": 50},
        supported_kv_cache_layouts=torch_backend.supported_kv_cache_layouts,
        get_kv_cache_stride_order=torch_backend.get_kv_cache_stride_order,
        get_kv_cache_shape=classmethod(_split_kv_shape),
    )
    register("SPLIT_KV", fake)
    _measure_with(monkeypatch, {"decode": "TORCH", "prefill": "SPLIT_KV", "mixed": "TORCH"})
    llm, _ = tiny_llm("llama", backend="fastest")
    assert llm.backend_names == ["TORCH"] and llm.runner.groups[0].prefill_builder is None
    assert (
        "one backend, TORCH (overall), for every step: TORCH (decode) and SPLIT_KV "
        in (llm.backend_notes[0])
    )
    assert (
        "cannot share one KV cache (KV cache shared by TORCH and SPLIT_KV: the logical"
        in (llm.backend_notes[0])
    )


def test_mla_layers_refuse_a_pair(tiny_llm):
    with pytest.raises(ValueError, match=r"backend pair for MLA layer .*run one backend"):
        tiny_llm("deepseek_v2", backend=("TORCH_MLA", "TORCH"))


def test_decode_steps_of_a_pair_get_a_split_with_no_prefill_part(tiny_llm, run_step):
    llm, _ = tiny_llm("llama", backend=PAIR)
    runner = llm.runner
    seen = []
    layer = llm.model.attention_layers()[0]
    original = type(layer).forward

    def spy(self, query, key, value, kv_cache, attn_metadata, output_lse=None):
        seen.append(attn_metadata)
        return original(self, query, key, value, kv_cache, attn_metadata, output_lse)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(layer), "forward", spy)
        run_step(runner, [[5, 6, 7], [8, 9]], [2, 1], [1, 1], [[1], [2]])
    split = seen[0]
    assert isinstance(split, PhaseSplitMetadata)
    assert split.prefill is None and split.num_decode_tokens == 2 == split.num_actual_tokens
    assert Phase.DECODE.value == "decode"
