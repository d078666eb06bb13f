"""`benchmarks/deepseek_gpu_check.py` on the CPU with two short prompts, so that the GPU check
cannot rot between GPU runs: `--save` writes a reference that agrees with transformers,
`--check` passes TORCH_MLA in float32 (the reference's own path: same tokens, same logits) and
in bfloat16, skips backends that cannot run here, and fails a run that picks a token the
reference outranks by more than bfloat16's bound."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("deepseek_gpu_check")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def saved(script, tmp_path_factory) -> Path:
    """A reference of two prompts (the 40-token one prefilled in chunks of 32), 4 tokens each."""
    folder = tmp_path_factory.mktemp("ds_check")
    argv = ["--save", str(folder), "--prompt-lens", "5", "40", "--new-tokens", "4"]
    assert script.main(argv) == 0
    return folder


def _check(script, folder: Path, tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "verdicts.json"
    code = script.main(["--check", str(folder), "--device", "cpu", "--json", str(out), *args])
    return code, json.loads(out.read_text())


def test_save_writes_a_reference_that_agrees_with_transformers(saved):
    reference = json.loads((saved / "reference.json").read_text())
    assert [len(p) for p in reference["prompts"]] == [5, 40]
    assert [len(t) for t in reference["tokens"]] == [4, 4]
    for entry in reference["sanity"]:
        assert entry["max_logit_error_vs_transformers"] <= 1e-3
        assert entry["transformers_generate_parts_at"] is None
        assert 0 < entry["median_bound"] < 1
    config = json.loads((saved / "model" / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert (config["qk_nope_head_dim"], config["v_head_dim"]) == (128, 128)
    assert config["rope_parameters"]["rope_type"] == "yarn"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_passes_torch_mla_and_skips_gpu_backends(script, saved, tmp_path, dtype):
    args = ["--backends", "TORCH_MLA", "TRITON_MLA", "NO_SUCH_MLA", "--dtype", dtype]
    code, results = _check(script, saved, tmp_path, *args)
    assert code == 0
    verdict = results["backends"]["TORCH_MLA"]
    assert verdict["passed"] and verdict["median_error_over_bound"] <= 1
    if dtype == "float32":  # the reference's own computation
        assert [p["verdict"] for p in verdict["prompts"]] == ["same", "same"]
        assert verdict["max_error_over_bound"] == 0
    assert "cuda" in results["backends"]["TRITON_MLA"]["skipped"]
    assert "not registered" in results["backends"]["NO_SUCH_MLA"]["skipped"]


def test_check_fails_a_token_the_reference_outranks_by_more_than_the_bound(script, saved, tmp_path):
    # a reference whose step-1 token of prompt 1 is another one, 1.0 above the run's
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(saved, tmp_path / "edited")
    reference = json.loads((folder / "reference.json").read_text())
    tensors = load_file(str(folder / "reference.safetensors"))
    logits = tensors["logits.1"]
    chosen = reference["tokens"][1][1]
    other = int(torch.argmin(logits[1]))
    logits[1, other] = logits[1, chosen] + 1.0
    reference["tokens"][1][1] = other
    (folder / "reference.json").write_text(json.dumps(reference))
    save_file(tensors, str(folder / "reference.safetensors"))
    code, results = _check(
        script, folder, tmp_path, "--backends", "TORCH_MLA", "--dtype", "float32"
    )
    assert code == 1
    verdict = results["backends"]["TORCH_MLA"]
    first = verdict["prompts"][1]["partings"][0]
    assert (first["step"], first["token"], first["reference_token"]) == (1, chosen, other)
    assert first["verdict"] == "MISMATCH" and first["gap"] == pytest.approx(1.0)
    assert verdict["prompts"][0]["verdict"] == "same" and not verdict["passed"]
