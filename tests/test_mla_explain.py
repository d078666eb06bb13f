"""Selection for MLA layers: `anyattn explain --use-mla` chooses TRITON_MLA on CUDA where
FlashInfer is not installed (FLASHINFER_MLA ranks first on sm90 but is unavailable on this
machine; TORCH_MLA on the CPU) and says why every standard backend was rejected; MLA backends
rank among themselves; declared splits show."""

from __future__ import annotations

import json

import pytest

from anyattn import AttentionSelectorConfig, DeviceInfo, select_backend
from anyattn.backends.torch_mla import TorchMLABackend
from anyattn.backends.triton_mla import TritonMLABackend
from anyattn.cli import main
from anyattn.registry import backend_names
from anyattn.selector import explain, priority_list

SM90 = DeviceInfo.parse("sm90")
MLA_ORDER = ("FLASHINFER_MLA", "TRITON_MLA", "TORCH_MLA")
ARGS = ["explain", "--use-mla", "--head-size", "576", "--qk-rope-head-dim", "64", "--device"]
DEEPSEEK = {"qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


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
    assert "config: head_size=576 dtype=bfloat16 use_mla=True qk_rope_head_dim=64\n" in out
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
    config = AttentionSelectorConfig(576, "bfloat16", use_mla=True, **DEEPSEEK)
    assert select_backend(config, "cpu") is TorchMLABackend
    assert select_backend(config, SM90) is TritonMLABackend
    assert priority_list(SM90, use_mla=True)[:3] == list(MLA_ORDER)
    assert priority_list(DeviceInfo.cpu(), use_mla=True)[0] == "TORCH_MLA"
    # For standard layers the MLA backends rank after every standard backend of the platform.
    standard = priority_list(SM90)
    assert standard.index("TORCH_MLA") > standard.index("TORCH")
    standard_config = config.replace(
        use_mla=False, qk_rope_head_dim=None, qk_nope_head_dim=None, v_head_dim=None
    )
    assert explain(standard_config, SM90).chosen != "TORCH_MLA"


def test_backends_lists_torch_mla_with_its_splits(capsys):
    assert main(["backends", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    mla = records["TORCH_MLA"]
    assert mla["features"]["mla"] is True and mla["mla_splits"] == "any"
    assert mla["kv_cache_layouts"] == ["NHD"] and mla["attn_types"] == ["decoder"]
    assert records["TORCH"]["mla_splits"] is None


def test_backends_table_has_an_mla_splits_row_for_mla_backends_only(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    tables: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        if line and not line.startswith(" "):
            rows = tables.setdefault(line.strip(), {})
        elif line.strip():
            field, _, value = line.strip().partition("  ")
            rows[field] = value.strip()
    assert tables["TRITON_MLA"]["mla splits"] == (
        "{16, 32, ..., 512}+{16, 32, 64} (kv_lora_rank+qk_rope_head_dim)"
    )
    assert tables["TORCH_MLA"]["mla splits"] == "any"
    assert list(tables["TRITON_MLA"]).index("mla splits") == (
        list(tables["TRITON_MLA"]).index("head sizes") + 1
    )
    for name in ("TORCH", "TRITON", "FLEX_ATTENTION"):
        assert "mla splits" not in tables[name], name


# --- TRITON_MLA's prefill head sizes ---------------------------------------------------------

TRITON_LIMIT = (
    "supported: qk_nope_head_dim + qk_rope_head_dim and v_head_dim each <= 256, the prefill "
    "kernel's widest head"
)


def _triton_mla_reasons(result) -> list[str]:
    return list(next(v for v in result.verdicts if v.name == "TRITON_MLA").reasons)


def test_prefill_head_sizes_outside_triton_mla_give_torch_mla_on_cuda():
    pytest.importorskip("triton")
    config = AttentionSelectorConfig(576, "bfloat16", use_mla=True, **DEEPSEEK)
    # P + R = 256 and Vd = 256: the widest the prefill kernel takes.
    assert select_backend(config.replace(qk_nope_head_dim=192, v_head_dim=256), SM90) is (
        TritonMLABackend
    )
    wide = config.replace(qk_nope_head_dim=193)
    assert select_backend(wide, SM90) is TorchMLABackend
    assert _triton_mla_reasons(explain(wide, SM90)) == [
        "MLA prefill head sizes qk_nope_head_dim + qk_rope_head_dim = 257, v_head_dim = 128 "
        f"not supported ({TRITON_LIMIT})"
    ]
    wide_v = config.replace(v_head_dim=257)
    assert select_backend(wide_v, SM90) is TorchMLABackend
    # Sizes the config does not give are left to the impl's constructor, which knows them.
    unknown = config.replace(qk_nope_head_dim=None, v_head_dim=None)
    assert select_backend(unknown, SM90) is TritonMLABackend
    assert _triton_mla_reasons(explain(config.replace(v_head_dim=None), SM90)) == []


def test_explain_says_why_triton_mla_refuses_the_sizes(capsys):
    pytest.importorskip("triton")
    args = ["explain", "--use-mla", "--head-size", "576", "--qk-rope-head-dim", "64",
            "--device", "sm90", "--json"]  # fmt: skip
    assert main([*args, "--qk-nope-head-dim", "256", "--v-head-dim", "300"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == "TORCH_MLA"
    verdicts = {v["name"]: v for v in data["backends"]}
    assert verdicts["TRITON_MLA"]["reasons"] == [
        "MLA prefill head sizes qk_nope_head_dim + qk_rope_head_dim = 320, v_head_dim = 300 "
        f"not supported ({TRITON_LIMIT})"
    ]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["chosen"] == "TRITON_MLA"


def test_hints_name_a_backend_that_fits_as_given_not_after_a_change(capsys):
    pytest.importorskip("triton")
    args = ["explain", "--use-mla", "--head-size", "576", "--qk-rope-head-dim", "64",
            "--device", "sm90", "--json", "--backend", "TRITON_MLA"]  # fmt: skip
    assert main([*args, "--qk-nope-head-dim", "256", "--v-head-dim", "300"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] is None
    # TORCH_MLA fits with the given dtype: no hint pretends a dtype change is what it takes.
    assert data["hints"] == [
        "TORCH_MLA fits this config as given (the selector's choice when TRITON_MLA is not "
        "requested)"
    ]
    # A change that makes the requested backend fit is hinted with that backend.
    fp32 = ["--qk-nope-head-dim", "128", "--v-head-dim", "128", "--dtype", "float32"]
    assert main([*args, *fp32]) == 1
    assert json.loads(capsys.readouterr().out)["hints"] == [
        "TORCH_MLA fits this config as given (the selector's choice when TRITON_MLA is not "
        "requested)",
        "with dtype=bfloat16, TRITON_MLA would fit",
        "with dtype=float16, TRITON_MLA would fit",
    ]
