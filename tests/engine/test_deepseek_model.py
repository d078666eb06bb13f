"""DeepSeek-V2/V3 models against transformers: logits of tiny random checkpoints over paged
latent caches (TORCH_MLA on the CPU), prefill batches and chunked prefills beside decodes;
weight loading in both expert layouts; the latent cache and grouping in the model runner."""

from __future__ import annotations

import pytest
import torch

from anyattn.config import BatchLimits, MLAAttentionSpec
from anyattn.engine.cuda_graphs import plan_cuda_graphs
from anyattn.engine.hf_loader import load_hf_folder
from anyattn.engine.model_runner import ModelRunner
from anyattn.engine.models import build_model
from anyattn.engine.models.deepseek import DeepseekForCausalLM
from anyattn.mla_layer import MLAAttention
from anyattn.types import AttentionCGSupport

transformers = pytest.importorskip("transformers")

KINDS = ("deepseek_v2", "deepseek_v2_group", "deepseek_v3", "deepseek_v3_512")
# docs/semantics.md ("Tolerance") asks for 1e-3 against transformers in fp32; these models land
# near 1e-6.
ATOL = RTOL = 2e-5


def _load(tiny_hf_model, kind: str):
    folder, hf_model = tiny_hf_model(kind)
    config, weights = load_hf_folder(folder)
    model = build_model(config, dtype=torch.float32, block_size=4)
    model.load_weights(weights)
    return model, hf_model


def _prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_batch_matches_transformers(kind, tiny_hf_model, paged_runner, hf_logits):
    model, hf_model = _load(tiny_hf_model, kind)
    vocab = model.config.vocab_size
    prompts = {"a": _prompt(1, 13, vocab), "b": _prompt(2, 1, vocab), "c": _prompt(3, 7, vocab)}
    outputs = paged_runner(model).step(list(prompts.items()))
    for (rid, prompt), logits in zip(prompts.items(), outputs, strict=True):
        ref = hf_logits(hf_model, prompt)
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL, msg=f"request {rid}")


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefills_beside_decodes_match_transformers(
    kind, tiny_hf_model, paged_runner, hf_logits
):
    """Decodes (absorbed MQA over the latent cache) lead every step; prefills continue over
    cached context (up-projected). Against transformers' logits of the full sequences."""
    model, hf_model = _load(tiny_hf_model, kind)
    vocab = model.config.vocab_size
    seqs = {"a": _prompt(4, 12, vocab), "b": _prompt(5, 9, vocab), "c": _prompt(6, 15, vocab)}
    schedule = [
        [("a", 0, 9), ("b", 0, 4)],
        [("a", 9, 10), ("b", 4, 6), ("c", 0, 7)],
        [("a", 10, 11), ("b", 6, 7), ("c", 7, 12)],
        [("a", 11, 12), ("b", 7, 8), ("c", 12, 13)],
        [("b", 8, 9), ("c", 13, 15)],
    ]
    refs = {rid: hf_logits(hf_model, seq) for rid, seq in seqs.items()}
    runner = paged_runner(model)
    for number, step in enumerate(schedule):
        outputs = runner.step([(rid, seqs[rid][start:end]) for rid, start, end in step])
        for (rid, start, end), logits in zip(step, outputs, strict=True):
            torch.testing.assert_close(
                logits,
                refs[rid][start:end],
                atol=ATOL,
                rtol=RTOL,
                msg=f"step {number}, request {rid}, positions {start}..{end - 1}",
            )


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_bfloat16_error_within_twice_transformers_bfloat16_error(
    kind, tiny_hf_model, paged_runner, hf_logits
):
    """docs/semantics.md's 16-bit whole-model rule against transformers loading the same folder
    in bf16 (routers kept in fp32 by both), per token row over four prompts (a prefill, then a
    decode).

    Routing is discrete: bf16 rounding that flips a near-tie between experts moves that row's
    logits by O(1), in either implementation and at different rows, so the rule is applied to
    the median row error."""
    folder, hf_model = tiny_hf_model(kind)
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="eager"
    )
    config, weights = load_hf_folder(folder)
    model = build_model(config, dtype=torch.bfloat16, block_size=4)
    model.load_weights(weights)
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32
    ours, theirs = [], []
    for seed in range(4):
        seq = _prompt(seed + 20, 9, config.vocab_size)
        runner = paged_runner(model)
        logits = torch.cat(runner.step([("a", seq[:8])]) + runner.step([("a", seq[8:])]))
        reference = hf_logits(hf_model, seq)
        ours.append((logits - reference).abs().amax(dim=-1))
        theirs.append((hf_logits(hf_bf16, seq) - reference).abs().amax(dim=-1))
    assert torch.cat(ours).median() <= 2 * torch.cat(theirs).median()


def test_layers_are_mla_with_their_sizes_and_moe_after_the_dense_ones(tiny_hf_model):
    model, hf_model = _load(tiny_hf_model, "deepseek_v3_512")
    assert isinstance(model, DeepseekForCausalLM)
    layers = model.attention_layers()
    assert all(isinstance(layer, MLAAttention) for layer in layers)
    assert [layer.layer_name for layer in layers] == [
        f"model.layers.{i}.self_attn" for i in range(3)
    ]
    assert {layer.backend.get_name() for layer in layers} == {"TORCH_MLA"}
    spec = layers[0].kv_cache_spec(4, torch.float32, "auto")
    assert isinstance(spec, MLAAttentionSpec)
    assert (spec.kv_lora_rank, spec.qk_rope_head_dim, spec.head_size) == (512, 64, 576)
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["GatedMLP", "GatedMLP", "MoE"]
    assert model.layers[0].self_attn.kv_a_layernorm.eps == 1e-6  # not rms_norm_eps (1e-5)
    assert hf_model.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon == 1e-6


def test_runner_allocates_one_latent_cache_per_layer_in_one_group(tiny_hf_model):
    model, _ = _load(tiny_hf_model, "deepseek_v3")
    limits = BatchLimits(max_num_reqs=4, max_num_tokens=64, max_model_len=64)
    runner = ModelRunner(
        model, num_blocks=9, block_size=4, limits=limits, device="cpu", dtype=torch.float32
    )
    assert len(runner.groups) == 1
    group = runner.groups[0]
    assert isinstance(group.spec, MLAAttentionSpec)
    assert group.layer_names == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert group.builder.reorder_batch_threshold == 1  # decodes first
    for name in group.layer_names:
        assert runner.kv_caches[name].shape == (9, 4, 48 + 16)
    assert runner.backend_names == ["TORCH_MLA"]


def test_cuda_graphs_are_off_for_models_that_cannot_be_captured():
    limits = BatchLimits(max_num_reqs=4, max_num_tokens=64, max_model_len=64)
    plan = plan_cuda_graphs(
        {"X": AttentionCGSupport.UNIFORM_BATCH},
        device_type="cuda",
        enforce_eager=False,
        limits=limits,
        model_reason="DeepseekForCausalLM steps cannot be captured",
    )
    assert not plan.enabled
    assert plan.message == "CUDA graphs off: DeepseekForCausalLM steps cannot be captured"
    assert not DeepseekForCausalLM.supports_cuda_graphs


# ---------------------------------------------------------------------------------------------
# Weight loading


def test_fused_expert_tensors_load_like_per_expert_ones(tiny_hf_model, paged_runner, hf_logits):
    """transformers' in-memory state dict fuses each layer's experts (`experts.gate_up_proj`
    `[E, 2I, H]`, `experts.down_proj`); the saved folder names them one by one."""
    model, hf_model = _load(tiny_hf_model, "deepseek_v2")
    state = hf_model.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    fused = build_model(model.config, dtype=torch.float32, block_size=4)
    fused.load_weights(state.items())
    for (name, ours), (_, theirs) in zip(
        model.state_dict().items(), fused.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, theirs), name
    prompt = _prompt(8, 6, model.config.vocab_size)
    logits = paged_runner(fused).step([("a", prompt)])[0]
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=ATOL, rtol=RTOL)


def test_extra_prediction_layers_are_skipped_and_missing_tensors_named(tiny_hf_model):
    model, hf_model = _load(tiny_hf_model, "deepseek_v3")
    state = {k: v.clone() for k, v in hf_model.state_dict().items()}
    # a V3 checkpoint's multi-token-prediction layer follows the decoder layers
    state["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)
    state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4, 4)
    model.load_weights(state.items())
    del state["model.layers.2.mlp.gate.e_score_correction_bias"]
    del state["model.layers.0.self_attn.kv_a_layernorm.weight"]
    with pytest.raises(ValueError) as info:
        model.load_weights(state.items())
    message = str(info.value)
    assert "model.layers.0.self_attn.kv_a_layernorm.weight" in message
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in message
