"""DeepSeek's MoE feed-forward and routers against transformers' own modules on the same
weights: V2 softmax routing (greedy, group_limited_greedy), V3 sigmoid routing (correction
bias, groups, norm_topk_prob, routed_scaling_factor); experts run only on their tokens."""

from __future__ import annotations

import pytest
import torch

from anyattn.engine.model_config import ModelConfig
from anyattn.engine.models.moe import MoE, split_fused_experts
from anyattn.engine.models.weights import load_into_slots

transformers = pytest.importorskip("transformers")

_SIZES = {
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 12,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
}

# name -> (architecture, config overrides)
ROUTINGS = {
    "v2_greedy": ("DeepseekV2", {"topk_method": "greedy", "routed_scaling_factor": 1.5}),
    "v2_group_limited": (
        "DeepseekV2",
        {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
    ),
    "v3_norm": (
        "DeepseekV3",
        {"n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    ),
    "v3_no_norm_two_shared": (
        "DeepseekV3",
        {"n_group": 2, "topk_group": 1, "norm_topk_prob": False, "n_shared_experts": 2},
    ),
}


def _modules(routing: str, seed: int = 0):
    """(transformers' MoE module with random weights, ours with the same weights)."""
    arch, overrides = ROUTINGS[routing]
    hf_config = getattr(transformers, f"{arch}Config")(**{**_SIZES, **overrides})
    if arch == "DeepseekV2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as HFMoE
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as HFMoE
    hf_moe = HFMoE(hf_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in [*hf_moe.parameters(), *hf_moe.buffers()]:
            # a wide router so that routing is far from ties; a visible correction bias
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    config = ModelConfig.from_hf({**hf_config.to_dict(), "architectures": [f"{arch}ForCausalLM"]})
    ours = MoE(config.hidden_size, config.moe, config.hidden_act, dtype=torch.float32, device="cpu")
    slots = dict(ours.weight_slots("mlp"))
    state = {f"mlp.{k}": v for k, v in hf_moe.state_dict().items()}
    loaded = dict(split_fused_experts(state.items()))
    assert set(loaded) == set(slots)
    # through the loader: a CPU float32 Linear (the shared experts) also keeps a row-major copy
    load_into_slots("test", slots, loaded.items())
    return hf_moe.eval(), ours


def _hidden(num_tokens: int = 37, seed: int = 1) -> torch.Tensor:
    return torch.randn(
        num_tokens, _SIZES["hidden_size"], generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("routing", ROUTINGS)
def test_router_picks_the_experts_and_weights_transformers_picks(routing):
    hf_moe, ours = _modules(routing)
    x = _hidden()
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_moe.gate(x)
        weights, ids = ours.gate(x)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(
        weights.gather(1, order), hf_weights.gather(1, hf_order), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("routing", ROUTINGS)
def test_moe_matches_transformers(routing):
    hf_moe, ours = _modules(routing)
    x = _hidden()
    with torch.no_grad():
        expected = hf_moe(x[None])[0]
        got = ours(x)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_group_limited_routing_keeps_to_the_best_groups():
    """V3 with 4 groups of 2, top-2 groups: every chosen expert lies in the two groups whose
    two best biased scores sum highest."""
    _, ours = _modules("v3_norm")
    x = _hidden(64, seed=5)
    with torch.no_grad():
        _, ids = ours.gate(x)
        choice = torch.sigmoid(x @ ours.gate.weight.T) + ours.gate.e_score_correction_bias
    group_scores = choice.view(64, 4, 2).sum(dim=-1)  # two experts a group: top-2 = all
    best = group_scores.topk(2, dim=-1).indices
    assert torch.equal(
        (ids // 2).unsqueeze(-1).eq(best.unsqueeze(1)).any(-1),
        torch.ones_like(ids, dtype=torch.bool),
    )


def test_experts_run_only_on_their_tokens(monkeypatch):
    """Each routed expert's first projection sees exactly the tokens routed to it."""
    _, ours = _modules("v2_greedy")
    x = _hidden(11)
    with torch.no_grad():
        _, ids = ours.gate(x)
    expected = torch.bincount(ids.flatten(), minlength=8).tolist()
    seen = [0] * 8
    linear = torch.nn.functional.linear
    experts = {ours.gate_up_weight[e].data_ptr(): e for e in range(8)}

    def spy(inp, weight, bias=None):
        if weight.data_ptr() in experts and weight.shape == ours.gate_up_weight.shape[1:]:
            seen[experts[weight.data_ptr()]] += inp.shape[0]
        return linear(inp, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    with torch.no_grad():
        ours(x)
    assert seen == expected
    assert sum(seen) == 11 * 3


def test_router_stays_float32_in_a_bfloat16_model():
    hf_moe, ours32 = _modules("v3_norm")
    config = ModelConfig.from_hf(
        {**hf_moe.config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    )
    ours = MoE(config.hidden_size, config.moe, "silu", dtype=torch.bfloat16, device="cpu")
    with torch.no_grad():
        for (_, src), (_, dst) in zip(
            ours32.weight_slots("m"), ours.weight_slots("m"), strict=True
        ):
            dst.target.copy_(src.target)
    assert ours.gate.weight.dtype == torch.float32
    assert ours.gate.e_score_correction_bias.dtype == torch.float32
    assert ours.gate_up_weight.dtype == torch.bfloat16
    x = _hidden().bfloat16()
    with torch.no_grad():
        weights, ids = ours.gate(x)
        expected_weights, expected_ids = ours32.gate(x.float())
        out = ours(x)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
    assert out.dtype == torch.bfloat16


def test_split_fused_experts_passes_other_tensors_and_splits_gate_from_up():
    gate_up = torch.arange(2 * 6 * 3, dtype=torch.float32).view(2, 6, 3)
    down = torch.arange(2 * 3 * 3, dtype=torch.float32).view(2, 3, 3)
    other = torch.ones(4)
    out = dict(
        split_fused_experts(
            [
                ("l.mlp.experts.gate_up_proj", gate_up),
                ("l.mlp.experts.down_proj", down),
                ("l.mlp.down_proj.weight", other),
            ]
        )
    )
    assert torch.equal(out["l.mlp.experts.1.gate_proj.weight"], gate_up[1, :3])
    assert torch.equal(out["l.mlp.experts.1.up_proj.weight"], gate_up[1, 3:])
    assert torch.equal(out["l.mlp.experts.0.down_proj.weight"], down[0])
    assert out["l.mlp.down_proj.weight"] is other
    assert len(out) == 7
