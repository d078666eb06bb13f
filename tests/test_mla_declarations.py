"""MLA declarations beyond the latent split: a backend whose prefill limits the up-projected
head sizes (Q/K rows P + R, V rows Vd) declares it, and the selector, `anyattn explain`, the
layer and the impl's constructor all refuse sizes it does not take, naming them."""

from __future__ import annotations

import json

import pytest

from anyattn import AttentionSelectorConfig, DeviceInfo, MLAAttention
from anyattn.backends.torch_mla import TorchMLABackend, TorchMLAImpl
from anyattn.cli import main
from anyattn.declarations import format_mla_splits

CPU = DeviceInfo.cpu()
LIMIT = 192


class HeadDimBackend(TorchMLABackend):
    """TORCH_MLA, declared as if its prefill kernel took head sizes up to 192 only."""

    @staticmethod
    def get_name() -> str:
        return "HEAD_DIM_MLA"

    @staticmethod
    def get_impl_cls() -> type:
        return HeadDimImpl

    @classmethod
    def get_mla_head_dims_reason(cls, qk_nope_head_dim, qk_rope_head_dim, v_head_dim):
        if None in (qk_nope_head_dim, qk_rope_head_dim, v_head_dim):
            return (
                f"MLA head sizes unknown (qk_nope_head_dim, qk_rope_head_dim and v_head_dim "
                f"needed; supported: P + R and Vd up to {LIMIT})"
            )
        qk = qk_nope_head_dim + qk_rope_head_dim
        if max(qk, v_head_dim) > LIMIT:
            return (
                f"MLA head sizes P + R = {qk}, Vd = {v_head_dim} not supported (supported: up "
                f"to {LIMIT})"
            )
        return None


class HeadDimImpl(TorchMLAImpl):
    backend = HeadDimBackend


def _config(**changes):
    values = {"head_size": 576, "dtype": "bfloat16", "use_mla": True, "qk_rope_head_dim": 64,
              "qk_nope_head_dim": 128, "v_head_dim": 128, **changes}  # fmt: skip
    return AttentionSelectorConfig(**values)


def test_selection_reasons_name_the_head_sizes():
    assert HeadDimBackend.validate_configuration(_config(), CPU) == []
    assert HeadDimBackend.validate_configuration(_config(qk_nope_head_dim=192), CPU) == [
        "MLA head sizes P + R = 256, Vd = 128 not supported (supported: up to 192)"
    ]
    assert HeadDimBackend.validate_configuration(_config(v_head_dim=None), CPU) == [
        "MLA head sizes unknown (qk_nope_head_dim, qk_rope_head_dim and v_head_dim needed; "
        "supported: P + R and Vd up to 192)"
    ]
    # TORCH_MLA takes any sizes, known or not.
    assert TorchMLABackend.validate_configuration(_config(qk_nope_head_dim=512), CPU) == []
    assert TorchMLABackend.validate_configuration(_config(v_head_dim=None), CPU) == []


def test_config_takes_the_sizes_for_mla_only():
    with pytest.raises(ValueError, match=r"^AttentionSelectorConfig: v_head_dim is for MLA layers "
                       r"\(got v_head_dim=128 with use_mla=False, expected None\)"):  # fmt: skip
        AttentionSelectorConfig(128, "bfloat16", v_head_dim=128)
    with pytest.raises(ValueError, match=r"qk_nope_head_dim must be a positive int or None "
                       r"\(got 0\)"):  # fmt: skip
        _config(qk_nope_head_dim=0)


def test_explain_judges_the_declared_head_sizes(register, capsys):
    register("HEAD_DIM_MLA", HeadDimBackend)
    args = ["explain", "--use-mla", "--head-size", "576", "--qk-rope-head-dim", "64",
            "--device", "cpu", "--json", "--backend", "HEAD_DIM_MLA"]  # fmt: skip
    assert main([*args, "--qk-nope-head-dim", "128", "--v-head-dim", "128"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == "HEAD_DIM_MLA"
    assert (data["config"]["qk_nope_head_dim"], data["config"]["v_head_dim"]) == (128, 128)
    assert main([*args, "--qk-nope-head-dim", "192", "--v-head-dim", "128"]) != 0
    out = capsys.readouterr()
    assert "MLA head sizes P + R = 256, Vd = 128 not supported" in out.out + out.err


def test_layer_and_impl_refuse_sizes_the_backend_does_not_take():
    sizes = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10}
    layer = MLAAttention(32, 2, **sizes, scale=0.3, backend=HeadDimBackend, device="cpu")
    assert layer.config.qk_nope_head_dim == 12 and layer.config.v_head_dim == 10
    big = {**sizes, "v_head_dim": 200}
    refused = r"^MLAAttention\(attn\): backend HEAD_DIM_MLA cannot serve this layer: MLA head"
    with pytest.raises(ValueError, match=rf"{refused} sizes P \+ R = 20, Vd = 200 not supported"):
        MLAAttention(32, 2, **big, scale=0.3, backend=HeadDimBackend, device="cpu")
    with pytest.raises(ValueError, match=r"^HEAD_DIM_MLA impl: MLA head sizes P \+ R = 20, "
                       r"Vd = 200 not supported \(supported: up to 192\) \(got "
                       r"qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=200\)"):  # fmt: skip
        HeadDimImpl(2, 0.3, **big)


def test_split_text_is_shared():
    assert format_mla_splits([(512, 64), (256, 32)]) == "512+64, 256+32"
