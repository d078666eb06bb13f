"""The `anyattn` command line, through its console script and through `main()`."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anyattn import __version__, registry
from anyattn.cli import main
from anyattn.config import AttentionSelectorConfig

ROOT = Path(__file__).resolve().parents[1]
FLAGS = list(AttentionSelectorConfig.flag_names())


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the installed console script (or `python -m anyattn.cli` where it is not installed)."""
    script = Path(sys.executable).with_name("anyattn")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "anyattn.cli"]
    environment = {**os.environ, "COLUMNS": "100", **env}
    return subprocess.run(
        command + list(args), capture_output=True, text=True, env=environment, timeout=120
    )


def flat(text: str) -> str:
    """Text with table wrapping undone: runs of whitespace become one space."""
    return " ".join(text.split())


def assert_one_error_line(stderr: str, start: str) -> None:
    assert stderr.count("\n") == 1 and stderr.endswith("\n"), stderr
    assert stderr.startswith(start), stderr
    assert "Traceback" not in stderr


# --- through the console script --------------------------------------------------------------


def test_explain_default_model_attention():
    args = ["explain", "--head-size", "64", "--num-heads", "9", "--num-kv-heads", "3"]
    result = run_cli(*args, "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert "config: head_size=64 dtype=float32 num_heads=9 num_kv_heads=3" in lines
    assert "chosen: TORCH" in lines
    assert "\x1b[" not in result.stdout  # piped: no colour codes
    assert max(len(line) for line in lines) <= 100


@pytest.mark.slow
def test_make_run_generates_a_chat_answer():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nrun:", 1)[1].splitlines()[1].strip()
    args = shlex.split(recipe)[1:]  # drop $(BIN)/anyattn
    assert args[:2] == ["generate", "--chat"]
    result = run_cli(*args, "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # the streamed answer
    assert "attention backend: TORCH" in result.stderr
    assert "tokens/s" in result.stderr.splitlines()[-1]


def test_generate_with_a_missing_model_is_one_clear_line(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert result.returncode == 2
    assert_one_error_line(
        result.stderr, "anyattn generate: error: argument --model: no such file or folder (got"
    )


def test_nothing_fits_exits_1():
    result = run_cli("explain", "--head-size", "64", "--use-mla", "--has-sink", "--device", "cpu")
    assert result.returncode == 1
    assert "chosen: none" in result.stdout
    assert "MLA (use_mla) not supported" in flat(result.stdout)
    assert "with has_sink=False, TORCH_MLA would fit" in flat(result.stdout)
    assert "with use_mla=False, TORCH would fit" in flat(result.stdout)
    assert result.stderr == (
        "anyattn explain: error: no backend fits this config on cpu; see the reasons above.\n"
    )


def test_requested_backend_that_does_not_fit_exits_1():
    result = run_cli("explain", "--head-size", "64", "--backend", "TORCH", "--use-sparse")
    assert result.returncode == 1
    assert "requested: TORCH (from --backend)" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines()]
    row = next(r for r in rows if r[:1] and r[0].isdigit() and r[1] == "TORCH")
    assert row[2:5] == ["rejected", "sparse", "attention"]
    assert_one_error_line(
        result.stderr, "anyattn explain: error: requested backend TORCH (from --backend) does not"
    )


def test_unknown_backend_exits_1():
    result = run_cli("explain", "--head-size", "64", "--backend", "NOPE")
    assert result.returncode == 1
    assert result.stdout == ""
    assert_one_error_line(
        result.stderr,
        "anyattn explain: error: --backend: unknown backend name (got 'NOPE', expected one of "
        "TORCH",
    )


def test_bad_flag_exits_2():
    result = run_cli("explain", "--head-size", "64", "--bogus")
    assert result.returncode == 2
    assert result.stderr == (
        "anyattn: error: unrecognized arguments: --bogus; see 'anyattn --help'.\n"
    )


def test_bad_dtype_is_one_clear_line():
    result = run_cli("explain", "--head-size", "64", "--dtype", "float8")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "anyattn explain: error: argument --dtype: unknown dtype (got 'float8', expected one "
        "of float32, float16, bfloat16, fp32, fp16, half, bf16); see 'anyattn explain --help'.\n"
    )


def test_env_json():
    result = run_cli("env", "--json")
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert data["anyattn"] == __version__
    assert data["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert data["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    assert set(data["versions"]) == {"python", "torch", "triton", "flashinfer", "flash-attn"}
    assert data["devices"][0]["type"] == "cpu"
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert [d["type"] for d in data["devices"]] == ["cpu"] + ["cuda"] * num_gpus


@pytest.fixture
def broken_plugin(tmp_path, monkeypatch):
    """An installed distribution whose `anyattn.backends` entry point names a missing module."""
    dist_info = tmp_path / "broken_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[anyattn.backends]\nbroken = anyattn_missing_plugin_module:Backend\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.reload_plugins()
    yield tmp_path
    registry.unregister_backend("BROKEN")


def test_broken_plugin_is_listed_not_fatal(broken_plugin):
    path = os.pathsep.join(filter(None, [str(broken_plugin), os.environ.get("PYTHONPATH")]))
    listing = run_cli("backends", PYTHONPATH=path)
    assert listing.returncode == 0, listing.stderr
    assert "TORCH" in listing.stdout and "available" in listing.stdout
    assert "BROKEN" in listing.stdout
    assert "cannot be loaded: ImportError: backend BROKEN: cannot import" in flat(listing.stdout)
    assert max(len(line) for line in listing.stdout.splitlines()) <= 100


# --- through main() --------------------------------------------------------------------------


def test_backends_json(capsys, broken_plugin):
    assert main(["backends", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["TORCH"]["error"] is None
    assert records["TORCH"]["available"] is True
    assert "float32" in records["TORCH"]["dtypes"]
    assert set(records["TORCH"]["features"]) >= {"sink", "lse", "mla"}
    assert records["BROKEN"]["error"].startswith("ImportError: backend BROKEN: cannot import")
    assert "No module named 'anyattn_missing_plugin_module'" in records["BROKEN"]["error"]


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    labels = ("status", "dtypes", "kv cache dtypes", "head sizes", "block sizes", "features")
    for label in (*labels, "cuda graphs"):
        assert f"  {label}  " in out
    assert "TORCH" in out


def test_explain_with_broken_plugin(capsys, broken_plugin, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["explain", "--head-size", "64", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "chosen: TORCH" in out.splitlines()
    assert "cannot be loaded: backend BROKEN" in flat(out)
    assert max(len(line) for line in out.splitlines()) <= 100


def test_explain_json(capsys):
    assert main(["explain", "--head-size", "64", "--dtype", "float32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == "TORCH"
    assert data["config"]["head_size"] == 64 and data["config"]["dtype"] == "float32"
    torch_verdict = next(v for v in data["backends"] if v["name"] == "TORCH")
    assert torch_verdict == {
        "name": "TORCH",
        "priority": torch_verdict["priority"],
        "fits": True,
        "reasons": [],
        "unavailable": None,
        "not_automatic": None,
    }


def test_environment_request(capsys, monkeypatch):
    monkeypatch.setenv("ANYATTN_BACKEND", "torch")
    assert main(["explain", "--head-size", "64", "--device", "cpu"]) == 0
    assert "requested: TORCH (from ANYATTN_BACKEND)" in capsys.readouterr().out.splitlines()
    monkeypatch.setenv("ANYATTN_BACKEND", "nope")
    assert main(["explain", "--head-size", "64"]) == 1
    assert_one_error_line(
        capsys.readouterr().err,
        "anyattn explain: error: ANYATTN_BACKEND: unknown backend name (got 'nope'",
    )


def test_env_table(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for label in ("anyattn", "python", "torch", "triton", "flashinfer", "flash-attn", "device"):
        assert f"  {label} " in out
    assert "cpu: " in out


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--kv-cache-dtype", "fp4"],
            "argument --kv-cache-dtype: unknown KV-cache dtype (got 'fp4', expected one of auto, "
            "float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2)",
        ),
        (
            ["--device", "gpu"],
            "argument --device: cannot read a device from 'gpu' (expected cpu, cuda, or a compute "
            "capability such as sm80, sm90, sm100, 9.0)",
        ),
        (["--head-size", "0"], "argument --head-size: must be a positive int (got '0', expected"),
        (["--head-size", "x"], "argument --head-size: must be a positive int (got 'x', expected"),
        (["--block-size", "-16"], "argument --block-size: must be a positive int (got '-16',"),
        (["--attn-type", "cross"], "argument --attn-type: invalid choice: 'cross' (choose from"),
        (
            ["--num-heads", "8", "--num-kv-heads", "3"],
            "invalid configuration: AttentionSelectorConfig: num_heads must be a multiple of "
            "num_kv_heads (got num_heads=8, num_kv_heads=3)",
        ),
    ],
)
def test_bad_input_is_one_clear_line(capsys, args, expected):
    argv = ["explain", "--head-size", "64", *args]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_error_line(captured.err, f"anyattn explain: error: {expected}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_device_without_gpu(capsys):
    assert main(["explain", "--head-size", "64", "--device", "cuda"]) == 2
    assert_one_error_line(
        capsys.readouterr().err,
        "anyattn explain: error: argument --device: 'cuda' names this machine's GPU, but torch "
        "sees none",
    )


@pytest.mark.parametrize("flag", FLAGS)
def test_every_boolean_field_has_a_flag(capsys, flag):
    status = main(["explain", "--head-size", "64", f"--{flag.replace('_', '-')}", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["config"][flag] is True
    assert [name for name in FLAGS if data["config"][name]] == [flag]
    assert status == (0 if data["chosen"] else 1)


def test_every_config_field_has_a_flag(capsys):
    argv = ["explain", "--head-size", "128", "--dtype", "float16", "--kv-cache-dtype", "fp8_e5m2"]
    argv += ["--block-size", "32", "--num-heads", "8", "--num-kv-heads", "2"]
    argv += ["--attn-type", "encoder_only", "--device", "sm90", "--json"]
    main(argv)
    data = json.loads(capsys.readouterr().out)
    expected = AttentionSelectorConfig(
        head_size=128,
        dtype=torch.float16,
        kv_cache_dtype="fp8_e5m2",
        block_size=32,
        num_heads=8,
        num_kv_heads=2,
        attn_type="encoder_only",
    )
    assert set(data["config"]) == set(AttentionSelectorConfig.__dataclass_fields__)
    assert data["config"]["dtype"] == "float16"
    assert data["config"]["attn_type"] == "encoder_only"
    for name in ("head_size", "kv_cache_dtype", "block_size", "num_heads", "num_kv_heads"):
        assert data["config"][name] == getattr(expected, name)
    assert data["device"] == "cuda sm90"


def test_table_marks_capability_and_availability_apart(capsys, monkeypatch, make_backend, register):
    monkeypatch.setenv("COLUMNS", "100")
    register("FLEX_ATTENTION", make_backend("FLEX_ATTENTION", unavailable="pip install flexy"))
    register("TRITON", make_backend("TRITON", devices=("cuda",)))
    assert main(["explain", "--head-size", "64", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "backend" in line and "verdict" in line)
    assert lines[header - 1].split() == ["capability", "availability"]
    assert lines[header].split() == ["#", "backend", "verdict", "(for", "cpu)", "(this", "machine)"]
    # The capability column starts where its header does.
    column = lines[header - 1].index("capability")
    rows = {line.split()[1]: line for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert rows["TORCH"].split()[2:] == ["chosen", "ok", "ok"]
    assert rows["FLEX_ATTENTION"].split()[2:] == ["unavailable", "ok", "pip", "install", "flexy"]
    assert rows["TRITON"].split()[2] == "rejected"
    assert rows["TRITON"][column:].startswith("device cpu not supported")


def test_nothing_fits_json(capsys):
    args = ["explain", "--head-size", "64", "--use-mla", "--has-sink", "--device", "cpu", "--json"]
    assert main(args) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["chosen"] is None
    assert data["hints"] == [
        "with has_sink=False, TORCH_MLA would fit",
        "with use_mla=False, TORCH would fit",
    ]
    assert captured.err.startswith("anyattn explain: error: no backend fits")


def test_help_and_version(capsys):
    assert main(["--help"]) == 0
    assert "explain" in capsys.readouterr().out
    assert main(["explain", "--help"]) == 0
    help_text = capsys.readouterr().out
    for flag in ["--head-size", "--backend", "--device", "--json"] + [
        f"--{f.replace('_', '-')}" for f in FLAGS
    ]:
        assert flag in help_text
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"anyattn {__version__}\n"
    assert main([]) == 2


def test_plugin_that_raises_on_import(capsys, tmp_path, monkeypatch, register):
    (tmp_path / "anyattn_raising_plugin.py").write_text('raise RuntimeError("no driver")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    register("RAISING", "anyattn_raising_plugin:Backend")
    assert main(["backends", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["RAISING"]["error"].startswith("ImportError: backend RAISING: cannot import")
    assert "RuntimeError: no driver" in records["RAISING"]["error"]
    assert records["TORCH"]["error"] is None
    # the broken plugin is one unavailable row; selection still works
    assert main(["explain", "--head-size", "64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["chosen"] == "TORCH"
    raising = next(b for b in result["backends"] if b["name"] == "RAISING")
    assert "RuntimeError: no driver" in raising["unavailable"]


def test_names_and_reasons_in_square_brackets_are_printed_as_given(
    capsys, monkeypatch, make_backend, register
):
    # Text that is not the command's own (plugin names, install hints) is never read as markup.
    monkeypatch.setenv("COLUMNS", "200")
    hint = "pip install 'anyattn[flashinfer]' :smile:"
    register("FAKE[RED]", make_backend("fake[red]", unavailable=hint))
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "fake[red]" in out and hint in out
    assert main(["explain", "--head-size", "64", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "FAKE[RED]" in out and hint in out


def test_explain_judges_one_backend_not_a_pair(capsys):
    assert main(["explain", "--head-size", "64", "--backend", "TORCH,FLEX_ATTENTION"]) == 1
    assert capsys.readouterr().err == (
        "anyattn explain: error: --backend: one backend name expected (got "
        "'TORCH,FLEX_ATTENTION', a pair).\n"
    )
