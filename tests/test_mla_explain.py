"""Selection for MLA layers: `anyattn explain --use-mla` chooses TRITON_MLA on CUDA where
FlashInfer is not installed (FLASHINFER_MLA ranks first on sm90 but is unavailable on this
machine; TORCH_MLA on the CPU) and says why every standard backend was rejected; MLA backends
rank among themselves; declared splits show."""

from __future__ import annotations

import json

from anyattn import AttentionSelectorConfig, DeviceInfo, select_backend
from anyattn.backends.torch_mla import TorchMLABackend
from anyattn.backends.triton_mla import TritonMLABackend
from anyattn.cli import main
from anyattn.registry import backend_names
from anyattn.selector import explain, priority_list

SM90 = DeviceInfo.parse("sm90")
MLA_ORDER = ("FLASHINFER_MLA", "TRITON_MLA", "TORCH_MLA")
ARGS = ["explain", "--use-mla", "--head-size", "576", "--qk-rope-head-dim", "64", "--device"]


def test_explain_chooses_triton_mla_and_rejects_every_standard_backend(capsys):
    assert main([*ARGS, "sm90", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == "TRITON_MLA"
    assert data["config"]["qk_rope_head_dim"] == 64
    verdicts = {v["name"]: v for v in data["backends"]}
    assert set(verdicts) == set(backend_names())
    assert [b["name"] for b in data["backends"][:3]] == list(MLA_ORDER)
    assert all(verdicts[name]["reasons"] == [] for name in MLA_ORDER)
    for name, verdict in verdicts.items():
        if name not in MLA_ORDER:
            assert "MLA (use_mla) not supported" in verdict["reasons"], name
    assert verdicts["FLASH_ATTN"]["reasons"][0].startswith("head_size 576 not supported")


def test_explain_table_names_the_choice(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert main([*ARGS, "sm90"]) == 0
    out = capsys.readouterr().out
    assert "config: head_size=576 dtype=bfloat16 use_mla=True qk_rope_head_dim=64" in out
    assert "chosen: TRITON_MLA" in out
    names = set(backend_names())
    rows = [line.split() for line in out.splitlines()]
    rows = [row for row in rows if len(row) > 2 and row[0].isdigit() and row[1] in names]
    assert rows[0][:3] == ["0", "FLASHINFER_MLA", "unavailable"]
    assert rows[1][:3] == ["1", "TRITON_MLA", "chosen"]
    assert rows[2][:3] == ["2", "TORCH_MLA", "fits"]
    assert {row[1]: row[2] for row in rows[3:]} == {
        name: "rejected" for name in backend_names() if name not in MLA_ORDER
    }


def test_mla_order_and_standard_order():
    config = AttentionSelectorConfig(576, "bfloat16", use_mla=True, qk_rope_head_dim=64)
    assert select_backend(config, "cpu") is TorchMLABackend
    assert select_backend(config, SM90) is TritonMLABackend
    assert priority_list(SM90, use_mla=True)[:3] == list(MLA_ORDER)
    assert priority_list(DeviceInfo.cpu(), use_mla=True)[0] == "TORCH_MLA"
    # For standard layers the MLA backends rank after every standard backend of the platform.
    standard = priority_list(SM90)
    assert standard.index("TORCH_MLA") > standard.index("TORCH")
    assert explain(config.replace(use_mla=False, qk_rope_head_dim=None), SM90).chosen != (
        "TORCH_MLA"
    )


def test_backends_lists_torch_mla_with_its_splits(capsys):
    assert main(["backends", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    mla = records["TORCH_MLA"]
    assert mla["features"]["mla"] is True and mla["mla_splits"] == "any"
    assert mla["kv_cache_layouts"] == ["NHD"] and mla["attn_types"] == ["decoder"]
    assert records["TORCH"]["mla_splits"] is None
