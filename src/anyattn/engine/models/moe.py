"""DeepSeek's mixture-of-experts feed-forward: a router (in float32, as transformers keeps it),
routed experts run only on the tokens routed to them, and shared experts run on every token.

`MoE(x) = sum_{e in topk(x)} w_e(x) * expert_e(x) + shared(x)`, every expert a SwiGLU MLP;
the routing rules of V2 and V3 are in `anyattn.engine.deepseek_config`. Checkpoints name
experts one by one (`mlp.experts.<e>.gate_proj.weight`); `split_fused_experts` renames
transformers' fused in-memory layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from anyattn.engine.deepseek_config import MoEConfig
from anyattn.engine.models.layers import ACTIVATIONS, GatedMLP, Slots
from anyattn.engine.models.weights import WeightSlot, empty_param

__all__ = ["MoE", "TopKRouter", "split_fused_experts"]

_FUSED = re.compile(r"(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


class TopKRouter(nn.Module):
    """Picks `num_experts_per_tok` experts per token and their weights, in float32 whatever
    the model dtype (the weight `[num_experts, hidden_size]` and V3's `e_score_correction_bias`
    `[num_experts]` are float32 parameters)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, *, device: torch.device | str) -> None:
        super().__init__()
        self.moe = moe
        self.weight = empty_param(moe.num_experts, hidden_size, dtype=torch.float32, device=device)
        self.e_score_correction_bias = None
        if moe.scoring == "sigmoid":
            self.e_score_correction_bias = empty_param(
                moe.num_experts, dtype=torch.float32, device=device
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: `[num_tokens, hidden_size]` -> (float32 weights, int64 expert ids), each
        `[num_tokens, num_experts_per_tok]` (in no particular order)."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight)  # [num_tokens, num_experts]
        if moe.scoring == "softmax":
            scores = logits.softmax(dim=-1)
            if moe.topk_method == "group_limited_greedy":
                # a group ranks by its best expert; experts outside the kept groups score 0
                group_scores = self._grouped(scores).max(dim=-1).values
                scores = self._keep_groups(scores, group_scores, 0.0)
            weights, ids = torch.topk(scores, moe.num_experts_per_tok, dim=-1, sorted=False)
        else:
            assert self.e_score_correction_bias is not None
            scores = logits.sigmoid()
            # the bias steers the choice only; the weights are the unbiased scores
            choice = scores + self.e_score_correction_bias
            group_scores = self._grouped(choice).topk(2, dim=-1).values.sum(dim=-1)
            choice = self._keep_groups(choice, group_scores, float("-inf"))
            ids = torch.topk(choice, moe.num_experts_per_tok, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
            if moe.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids

    def _grouped(self, scores: torch.Tensor) -> torch.Tensor:
        """`[num_tokens, num_experts]` -> `[num_tokens, n_group, experts per group]` (a view)."""
        assert self.moe.n_group is not None
        return scores.view(scores.shape[0], self.moe.n_group, -1)

    def _keep_groups(
        self, scores: torch.Tensor, group_scores: torch.Tensor, fill: float
    ) -> torch.Tensor:
        """`scores` with every expert outside the `topk_group` best groups set to `fill`."""
        assert self.moe.topk_group is not None
        best = torch.topk(group_scores, self.moe.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        # keep: [num_tokens, n_group] -> broadcast over each group's experts
        return self._grouped(scores).masked_fill(~keep[..., None], fill).view_as(scores)

    def weight_slots(self, prefix: str) -> Slots:
        yield f"{prefix}.weight", WeightSlot(self.weight)
        if self.e_score_correction_bias is not None:
            yield f"{prefix}.e_score_correction_bias", WeightSlot(self.e_score_correction_bias)


class MoE(nn.Module):
    """Routed experts (`gate_up_weight` `[num_experts, 2 * moe_intermediate_size, hidden_size]`,
    `down_weight` `[num_experts, hidden_size, moe_intermediate_size]`), the router `gate`, and
    `shared_experts` (None without).

    Each expert that got tokens runs once on their rows (pairs sorted by expert), summed in
    expert order as transformers does. The per-expert counts are read on the host, so MoE steps
    cannot be captured in a CUDA graph.
    """

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        hidden_act: str,
        *,
        has_bias: bool = False,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.act = ACTIVATIONS[hidden_act]
        num, inter = moe.num_experts, moe.moe_intermediate_size
        self.gate_up_weight = empty_param(num, 2 * inter, hidden_size, dtype=dtype, device=device)
        self.down_weight = empty_param(num, hidden_size, inter, dtype=dtype, device=device)
        self.gate = TopKRouter(hidden_size, moe, device=device)
        self.shared_experts = None
        if moe.num_shared_experts:
            self.shared_experts = GatedMLP(
                hidden_size,
                moe.num_shared_experts * inter,
                hidden_act,
                has_bias=has_bias,
                dtype=dtype,
                device=device,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[num_tokens, hidden_size]` -> same shape and dtype."""
        weights, ids = self.gate(x)  # [num_tokens, top_k] each
        top_k = ids.shape[1]
        flat_ids = ids.flatten()  # pair p = (token p // top_k, expert flat_ids[p])
        order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.moe.num_experts).tolist()
        tokens = order // top_k
        pair_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        inter = self.moe.moe_intermediate_size
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start : start + count]  # the tokens routed to `expert`
            gate, up = F.linear(x[rows], self.gate_up_weight[expert]).split(inter, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_weight[expert])  # [count, hidden_size]
            y = y * pair_weights[start : start + count, None]  # float32, as transformers
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def weight_slots(self, prefix: str) -> Slots:
        inter = self.moe.moe_intermediate_size
        for e in range(self.moe.num_experts):
            expert = f"{prefix}.experts.{e}"
            yield f"{expert}.gate_proj.weight", WeightSlot(self.gate_up_weight[e, :inter])
            yield f"{expert}.up_proj.weight", WeightSlot(self.gate_up_weight[e, inter:])
            yield f"{expert}.down_proj.weight", WeightSlot(self.down_weight[e])
        yield from self.gate.weight_slots(f"{prefix}.gate")
        if self.shared_experts is not None:
            yield from self.shared_experts.weight_slots(f"{prefix}.shared_experts")


def split_fused_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with transformers' fused expert tensors split into per-expert
    names: `<p>.experts.gate_up_proj` `[E, 2I, H]` -> `<p>.experts.<e>.gate_proj.weight` and
    `.up_proj.weight` (`[I, H]` each), `<p>.experts.down_proj` `[E, H, I]` ->
    `<p>.experts.<e>.down_proj.weight`; other tensors pass unchanged."""
    for name, tensor in weights:
        match = _FUSED.fullmatch(name)
        if match is None or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix = match["prefix"]
        for e, per_expert in enumerate(tensor.unbind(0)):
            if match["kind"] == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", per_expert
            else:
                gate, up = per_expert.chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
