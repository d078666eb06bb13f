"""Selection for MLA layers: `anyattn explain --use-mla` chooses TORCH_MLA and says why every
standard backend was rejected; MLA backends rank among themselves; declared splits show."""

from __future__ import annotations

import json

from anyattn import AttentionSelectorConfig, DeviceInfo, select_backend
from anyattn.backends.torch_mla import TorchMLABackend
from anyattn.cli import main
from anyattn.registry import backend_names
from anyattn.selector import explain, priority_list

SM90 = DeviceInfo.parse("sm90")
ARGS = ["explain", "--use-mla", "--head-size", "576", "--qk-rope-head-dim", "64", "--device"]


def test_explain_chooses_torch_mla_and_rejects_every_other_backend(capsys):
    assert main([*ARGS, "sm90", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == "TORCH_MLA"
    assert data["config"]["qk_rope_head_dim"] == 64
    verdicts = {v["name"]: v for v in data["backends"]}
    assert set(verdicts) == set(backend_names())
    assert data["backends"][0]["name"] == "TORCH_MLA"
    assert verdicts["TORCH_MLA"]["reasons"] == []
    for name, verdict in verdicts.items():
        if name != "TORCH_MLA":
            assert "MLA (use_mla) not supported" in verdict["reasons"], name
    assert verdicts["FLASH_ATTN"]["reasons"][0].startswith("head_size 576 not supported")


def test_explain_table_names_the_choice(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert main([*ARGS, "sm90"]) == 0
    out = capsys.readouterr().out
    assert "config: head_size=576 dtype=bfloat16 use_mla=True qk_rope_head_dim=64" in out
    assert "chosen: TORCH_MLA" in out
    names = set(backend_names())
    rows = [line.split() for line in out.splitlines()]
    rows = [row for row in rows if len(row) > 2 and row[0].isdigit() and row[1] in names]
    assert rows[0][:3] == ["0", "TORCH_MLA", "chosen"]
    assert {row[1]: row[2] for row in rows[1:]} == {
        name: "rejected" for name in backend_names() if name != "TORCH_MLA"
    }


def test_mla_order_and_standard_order():
    config = AttentionSelectorConfig(576, "bfloat16", use_mla=True, qk_rope_head_dim=64)
    assert select_backend(config, "cpu") is TorchMLABackend
    assert select_backend(config, SM90) is TorchMLABackend
    assert priority_list(SM90, use_mla=True)[0] == "TORCH_MLA"
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
