"""DeepSeek-V2/V3 hyper-parameters: multi-head latent attention (`MLAConfig`) and the
mixture-of-experts feed-forward (`MoEConfig`), read from a `config.json` dict by
`read_deepseek` with transformers 5.24's defaults, and routed as transformers 5.24 does:
- V2: softmax scores; `greedy` top-k, or `group_limited_greedy` (within the `topk_group`
  groups with the highest single score); weights the probabilities times
  `routed_scaling_factor` (`norm_topk_prob` ignored, as transformers' V2 router does).
- V3: sigmoid scores; the choice adds `e_score_correction_bias`, keeps the `topk_group` groups
  whose two best biased scores sum highest and takes the top-k there; weights the unbiased
  scores, normalised to sum 1 when `norm_topk_prob`, times `routed_scaling_factor`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from anyattn.types import check_positive_int

__all__ = ["DEEPSEEK_ARCHITECTURES", "MLAConfig", "MoEConfig", "int_field", "read_deepseek"]

DEEPSEEK_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")

# transformers 5.24's defaults for the keys read here (num_experts_per_tok has none in V2).
_MLA_DEFAULTS = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {
        **_MLA_DEFAULTS,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "moe_intermediate_size": 1407,
        "first_k_dense_replace": 0,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "scoring_func": "softmax",
    },
    "deepseek_v3": {
        **_MLA_DEFAULTS,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "rope_interleave": True,
    },
}
_TOPK_METHODS = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}
_API = "ModelConfig.from_hf"


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """The attention of a DeepSeek layer (docs/mla.md).

    Attributes:
        q_lora_rank: rank of the low-rank query (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`);
            None: one `q_proj`.
        kv_lora_rank: L, the latent cached per token; qk_rope_head_dim: R, the rotary part
            (one key shared by all heads); qk_nope_head_dim: P; v_head_dim: Vd.
        is_rope_interleaved: rotary pairs are `(x0, x1), (x2, x3), ...` (DeepSeek's layout:
            always in V2, `rope_interleave` in V3) rather than NeoX's `(x_i, x_{i + R/2})`.
        scale: the softmax scale, `(P + R) ** -0.5`, times `mscale(factor, mscale_all_dim)^2`
            when the RoPE scaling sets `mscale_all_dim`.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    is_rope_interleaved: bool
    scale: float


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The feed-forward of a DeepSeek model: `first_k_dense_replace` dense layers, then MoE.

    Attributes:
        num_experts, num_experts_per_tok (top-k), moe_intermediate_size: the routed experts.
        num_shared_experts: shared experts, run on every token as one gated MLP of
            `num_shared_experts * moe_intermediate_size` (0: none).
        scoring: "softmax" (V2) or "sigmoid" (V3); topk_method: "greedy",
            "group_limited_greedy" (V2) or "noaux_tc" (V3).
        n_group, topk_group: the top-k chosen within the best `topk_group` of `n_group` expert
            groups (None for V2's greedy).
        norm_topk_prob: weights renormalised to sum 1 before scaling (V3 only).
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int
    scoring: str
    topk_method: str
    n_group: int | None
    topk_group: int | None
    norm_topk_prob: bool
    routed_scaling_factor: float

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has the MoE feed-forward (else a dense MLP)."""
        return index >= self.first_k_dense_replace


def read_deepseek(
    arch: str, config: Mapping[str, Any], rope_scaling: Mapping[str, Any] | None
) -> tuple[MLAConfig, MoEConfig]:
    """The MLA and MoE parts of a DeepSeek `config.json` (`rope_scaling` as `ModelConfig`
    normalised it). ValueError names a missing, ill-typed or unsupported field."""
    # null counts as absent, except q_lora_rank, where it means "no low-rank query"
    cfg = {**_DEFAULTS[arch], **{k: v for k, v in config.items() if v is not None}}
    has_q_lora = not ("q_lora_rank" in config and config["q_lora_rank"] is None)
    q_lora_rank = int_field(cfg, "q_lora_rank") if has_q_lora else None
    nope, rope = int_field(cfg, "qk_nope_head_dim"), int_field(cfg, "qk_rope_head_dim")
    if rope % 2:
        raise ValueError(f"{_API}: qk_rope_head_dim must be even for RoPE (got {rope}).")
    for key, supported in (("attention_bias", False), ("moe_layer_freq", 1)):
        if cfg.get(key, supported) != supported:
            raise ValueError(
                f"{_API}: {key} is not supported for {arch} (got {cfg[key]!r}, expected "
                f"{supported!r})."
            )
    scale = (nope + rope) ** -0.5
    m_all = (rope_scaling or {}).get("mscale_all_dim")
    if rope_scaling is not None and m_all:
        # transformers' yarn_get_mscale: 1 for factor <= 1, else 0.1 * m * ln(factor) + 1
        factor = rope_scaling["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    mla = MLAConfig(
        q_lora_rank=q_lora_rank,
        kv_lora_rank=int_field(cfg, "kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int_field(cfg, "v_head_dim"),
        is_rope_interleaved=arch == "deepseek_v2" or bool(cfg["rope_interleave"]),
        scale=scale,
    )
    return mla, _read_moe(arch, cfg)


def _read_moe(arch: str, cfg: Mapping[str, Any]) -> MoEConfig:
    scoring = "softmax" if arch == "deepseek_v2" else "sigmoid"
    if cfg["scoring_func"] != scoring:
        raise ValueError(
            f"{_API}: {arch} routes with {scoring} scores (got scoring_func "
            f"{cfg['scoring_func']!r}, expected {scoring!r})."
        )
    method = cfg["topk_method"]
    if method not in _TOPK_METHODS[arch]:
        raise ValueError(
            f"{_API}: unsupported topk_method for {arch} (got {method!r}, expected one of "
            f"{', '.join(_TOPK_METHODS[arch])})."
        )
    num_experts = int_field(cfg, "n_routed_experts")
    top_k = int_field(cfg, "num_experts_per_tok")
    is_grouped = method != "greedy"
    n_group = int_field(cfg, "n_group") if is_grouped else None
    topk_group = int_field(cfg, "topk_group") if is_grouped else None
    if top_k > num_experts:
        raise ValueError(
            f"{_API}: num_experts_per_tok exceeds n_routed_experts (got {top_k} and {num_experts})."
        )
    if n_group is not None and topk_group is not None:
        per_group = num_experts // n_group
        if num_experts % n_group or topk_group > n_group:
            raise ValueError(
                f"{_API}: n_routed_experts must split into n_group equal groups and topk_group "
                f"must be <= n_group (got n_routed_experts={num_experts}, n_group={n_group}, "
                f"topk_group={topk_group})."
            )
        # V3 ranks a group by the sum of its two best scores
        least = 2 if arch == "deepseek_v3" else 1
        if per_group < least or top_k > topk_group * per_group:
            raise ValueError(
                f"{_API}: the kept groups hold too few experts (got {topk_group} groups of "
                f"{per_group}, expected at least {least} per group and num_experts_per_tok="
                f"{top_k} in all)."
            )
    shared = cfg.get("n_shared_experts") or 0
    first_dense = cfg["first_k_dense_replace"]
    for key, value in (("n_shared_experts", shared), ("first_k_dense_replace", first_dense)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{_API}: {key} must be an int >= 0 (got {value!r}).")
    return MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int_field(cfg, "moe_intermediate_size"),
        num_shared_experts=shared,
        first_k_dense_replace=first_dense,
        scoring=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=arch == "deepseek_v3" and bool(cfg["norm_topk_prob"]),
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
    )


def int_field(cfg: Mapping[str, Any], key: str) -> int:
    """`cfg[key]`, a positive int (ValueError otherwise, naming the key)."""
    if key not in cfg:
        raise ValueError(f"{_API}: config.json has no {key!r} (expected a positive int).")
    check_positive_int(_API, key, cfg[key])
    return cfg[key]
