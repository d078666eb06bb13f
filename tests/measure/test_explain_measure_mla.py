"""`anyattn explain --measure --use-mla`: an MLA config is checked and timed on the CPU, with
the no-rope and value sizes of --qk-nope-head-dim / --v-head-dim (defaults only without them);
TORCH_MLA alone, then with a registered test MLA backend as a second candidate."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import ClassVar

import pytest

from anyattn.backends.torch_mla import TorchMLAImpl
from anyattn.cli import main
from anyattn.config import AttentionSelectorConfig
from anyattn.measure.layer_shape import DEFAULT_MLA_NOPE_DIM, DEFAULT_MLA_V_DIM, resolve_layer

# L = 64, R = 8, P = 16, Vd = 24: no size equals a default.
ARGS = [
    "explain", "--use-mla", "--head-size", "72", "--qk-rope-head-dim", "8",
    "--qk-nope-head-dim", "16", "--v-head-dim", "24", "--dtype", "float32", "--num-heads", "2",
    "--device", "cpu", "--measure", "--max-num-seqs", "2", "--max-num-batched-tokens", "8",
    "--max-model-len", "32", "--no-measure-cache", "--json",
]  # fmt: skip


class SizeRecordingImpl(TorchMLAImpl):
    """TORCH_MLA, recording the (qk_nope_head_dim, v_head_dim) of every impl made."""

    sizes: ClassVar[set[tuple[int, int]]] = set()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        type(self).sizes.add((self.qk_nope_head_dim, self.v_head_dim))


def _measurement(capsys) -> dict:
    assert main(ARGS) == 0
    return json.loads(capsys.readouterr().out)["measurement"]


def test_layer_sizes_come_from_the_config_else_the_defaults():
    config = AttentionSelectorConfig(
        head_size=72, dtype="float32", num_heads=2, use_mla=True, qk_rope_head_dim=8
    )
    given = resolve_layer(config.replace(qk_nope_head_dim=16, v_head_dim=24))
    assert (given.kv_lora_rank, given.qk_nope_head_dim, given.v_head_dim) == (64, 16, 24)
    assert given.scale == pytest.approx((16 + 8) ** -0.5)
    default = resolve_layer(config)
    defaults = (DEFAULT_MLA_NOPE_DIM, DEFAULT_MLA_V_DIM)
    assert (default.qk_nope_head_dim, default.v_head_dim) == defaults
    assert default.scale == pytest.approx((DEFAULT_MLA_NOPE_DIM + 8) ** -0.5)


def test_explain_measure_mla_on_the_cpu_chooses_torch_mla(capsys):
    data = _measurement(capsys)
    assert data["order"] == ["TORCH_MLA"] and data["rejected"] == {}
    assert data["is_mla"] is True
    assert {c["backend"] for c in data["choices"].values()} == {"TORCH_MLA"}


def test_explain_measure_mla_times_a_second_backend_at_the_given_sizes(
    capsys, register_mla_variant
):
    SizeRecordingImpl.sizes = set()
    register_mla_variant("TEST_MLA", SizeRecordingImpl, priority=MappingProxyType({"cpu": 1}))
    data = _measurement(capsys)
    assert data["order"] == ["TORCH_MLA", "TEST_MLA"] and data["rejected"] == {}
    assert set(data["timings"]) == {"TORCH_MLA", "TEST_MLA"}
    assert data["choices"]["overall"]["backend"] in ("TORCH_MLA", "TEST_MLA")
    # The oracle check and every timed step built the test backend's impl with P = 16, Vd = 24.
    assert SizeRecordingImpl.sizes == {(16, 24)}
