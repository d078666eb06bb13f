"""Measured selection with the real CPU backends: the oracle check catches wrong results
(standard and MLA), real timing of tiny steps, the selector's refusals, `Attention.use_backend`,
and `anyattn explain --measure` run twice (the second run uses the cache)."""

from __future__ import annotations

import json

import pytest
import torch

from anyattn.backends.torch_attn import TorchAttentionBackend, TorchAttentionImpl
from anyattn.backends.torch_mla import TorchMLABackend, TorchMLAImpl
from anyattn.cli import main
from anyattn.config import AttentionSelectorConfig, BatchLimits
from anyattn.layer import Attention
from anyattn.measure import Measurement
from anyattn.measure.layer_shape import resolve_layer
from anyattn.measure.verify import check_against_oracle
from anyattn.selector import measure_backends, select_backend

CPU = torch.device("cpu")
CONFIG = AttentionSelectorConfig(head_size=64, dtype="float32", num_heads=4, num_kv_heads=2)
MLA = AttentionSelectorConfig(
    head_size=72, dtype="float32", num_heads=2, use_mla=True, qk_rope_head_dim=8, block_size=16
)
TINY = BatchLimits(2, 8, 32)


class OffImpl(TorchAttentionImpl):
    """TORCH with every output 1% too large."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs):
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
        return output.mul_(1.01)


class OffBackend(TorchAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "OFF"

    @staticmethod
    def get_impl_cls():
        return OffImpl


OffImpl.backend = OffBackend


class OffMLAImpl(TorchMLAImpl):
    """TORCH_MLA with its decode (or prefill) output 5% too large (1% is within bf16's
    rounding)."""

    wrong = "decode"

    def forward_mqa(self, layer, q_latent, q_pe, kv_cache, attn_metadata, output, lse=None):
        super().forward_mqa(layer, q_latent, q_pe, kv_cache, attn_metadata, output, lse)
        if self.wrong == "decode":
            output.mul_(1.05)

    def forward_mha(self, layer, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output):
        super().forward_mha(layer, q, kv_c_normed, k_pe, kv_cache, attn_metadata, output)
        if self.wrong == "prefill":
            output.mul_(1.05)


class OffMLABackend(TorchMLABackend):
    @staticmethod
    def get_impl_cls():
        return OffMLAImpl


OffMLAImpl.backend = OffMLABackend


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        CONFIG.replace(dtype="float16", kv_cache_dtype="fp8", has_sliding_window=True),
        CONFIG.replace(has_logits_soft_cap=True, has_sink=True, needs_lse=True),
    ],
    ids=["fp32", "fp16-fp8-window", "softcap-sinks-lse"],
)
def test_oracle_check_passes_torch_and_rejects_a_wrong_backend(config):
    layer = resolve_layer(config)
    assert check_against_oracle(TorchAttentionBackend, config, layer, CPU) is None
    reason = check_against_oracle(OffBackend, config, layer, CPU)
    assert reason is not None and "error above bound" in reason


@pytest.mark.parametrize(
    "config",
    [MLA, MLA.replace(dtype="bfloat16", kv_cache_dtype="fp8")],
    ids=["fp32", "bf16-fp8"],
)
def test_mla_oracle_check_passes_torch_mla_and_rejects_wrong_decode_or_prefill(config, monkeypatch):
    layer = resolve_layer(config)
    assert (layer.kv_lora_rank, layer.qk_rope_head_dim) == (64, 8)
    assert check_against_oracle(TorchMLABackend, config, layer, CPU) is None
    for part in ("decode", "prefill"):
        monkeypatch.setattr(OffMLAImpl, "wrong", part)
        reason = check_against_oracle(OffMLABackend, config, layer, CPU)
        assert reason is not None and reason.startswith(f"{part}: max error")


def test_mla_layer_is_measured_with_its_real_builder_and_impl():
    measured = measure_backends(MLA, TINY, "cpu", use_cache=False)
    assert measured.order == ("TORCH_MLA",) and not measured.rejected
    assert measured.overall == "TORCH_MLA"
    assert set(measured.timings["TORCH_MLA"]) == {s.name for s in measured.steps}
    assert all(min(t.times_us) > 0 for t in measured.timings["TORCH_MLA"].values())


def test_select_backend_fastest_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="policy='fastest' needs limits"):
        select_backend(CONFIG, "cpu", policy="fastest")
    with pytest.raises(ValueError, match="unknown policy"):
        select_backend(CONFIG, "cpu", policy="quickest", limits=TINY)
    with pytest.raises(ValueError, match="got backend='TORCH' too"):
        select_backend(CONFIG, "cpu", "TORCH", policy="fastest", limits=TINY)
    with pytest.raises(ValueError, match="device must be this machine's"):
        measure_backends(CONFIG, TINY, "sm90")
    with pytest.raises(ValueError, match=r"config\.num_heads must be set"):
        measure_backends(AttentionSelectorConfig(head_size=64, dtype="float32"), TINY, "cpu")
    with pytest.raises(TypeError, match="limits must be a BatchLimits"):
        measure_backends(CONFIG, (2, 8, 32), "cpu")  # type: ignore[arg-type]


def test_attention_use_backend_switches_the_impl_or_refuses():
    layer = Attention(4, 64, 0.125, 2, device="cpu", backend="TORCH")
    flex = select_backend(layer.config, "cpu", "FLEX_ATTENTION")
    layer.use_backend(flex)
    assert layer.backend is flex and type(layer.impl) is flex.get_impl_cls()
    assert (layer.impl.num_heads, layer.impl.num_kv_heads, layer.impl.scale) == (4, 2, 0.125)
    with pytest.raises(ValueError, match="backend TORCH_MLA cannot serve this layer"):
        layer.use_backend(TorchMLABackend)
    assert layer.backend is flex


def test_explain_measure_times_once_then_uses_the_cache(capsys):
    args = [
        "explain", "--head-size", "64", "--dtype", "float32", "--num-heads", "4",
        "--num-kv-heads", "2", "--device", "cpu", "--measure", "--max-num-seqs", "2",
        "--max-num-batched-tokens", "8", "--max-model-len", "32",
    ]  # fmt: skip
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["measurement"]
    assert data["order"] == ["TORCH", "FLEX_ATTENTION"] and data["rejected"] == {}
    assert [s["name"] for s in data["steps"]] == [
        "decode/1x31", "decode/1x16", "decode/2x31", "decode/2x16", "prefill/8",
        "mixed/1x16+7@8",
    ]  # fmt: skip
    assert set(data["choices"]) == {"decode", "prefill", "mixed", "overall"}
    assert data["choices"]["overall"]["backend"] in ("TORCH", "FLEX_ATTENTION")
    assert not data["from_cache"] and "saved to" in data["cache_note"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "(no timing done)" in " ".join(out.split())
    for text in ("decode/2x31", "summed time per phase", "first calls", "overall: "):
        assert text in out
    # TORCH and FLEX_ATTENTION share a cache (HND, TORCH's preference, which FLEX also takes)
    assert "decode and prefill choices share one KV cache: yes" in out
    assert f"engine: {Measurement.from_dict(data).pair_note()}" in " ".join(out.split())
    # The engine's layer count weighs each step's build into the same (cached) times.
    assert main([*args, "--num-layers", "16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(no timing done)" in out and "each step's build counted over 16 layers" in out
    assert main([*args, "--num-layers", "16", "--json"]) == 0
    counted = json.loads(capsys.readouterr().out)["measurement"]
    assert counted["layers_per_step"] == 16 and counted["from_cache"]
    assert data["layers_per_step"] is None
